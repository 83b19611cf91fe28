"""Running a local docker-registry (distribution 2.x), optionally with htpasswd auth.

:class:`Registry` runs ``docker-registry serve`` on a free loopback port with
its storage in a temp dir.  :class:`RegistryWithProxy` adds a
:class:`~tests.support.proxy.CountingProxy` in front of it; image refs given
to containerd should use the *proxy* host so that all pulls are counted,
while pushes go straight to the registry (and are not counted).
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from tests.support import procs
from tests.support.oci import OciImage, PushedImage, RegistryClient
from tests.support.proxy import CountingProxy, ProxyStats

__all__ = [
    "CountingProxy",
    "ProxyStats",
    "Registry",
    "RegistryWithProxy",
    "free_port",
    "htpasswd_line",
]


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def htpasswd_line(user: str, password: str) -> str:
    """``user:bcrypt-hash`` as docker-registry's htpasswd auth expects.

    Uses python ``bcrypt`` (``pip install bcrypt``) with cost 4 (the registry
    checks the hash on every request, so a low cost keeps tests fast); falls
    back to ``htpasswd`` from apache2-utils.
    """
    try:
        import bcrypt
    except ImportError:
        exe = shutil.which("htpasswd")
        if exe is None:
            raise RuntimeError("need python bcrypt (`pip install bcrypt`) or htpasswd (apache2-utils)") from None
        out = subprocess.run([exe, "-nbB", "-C", "4", user, password], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    return f"{user}:{hashed}"


class Registry:
    """A docker-registry process listening on ``127.0.0.1:<port>``."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        binary: str = "docker-registry",
        credentials: tuple[str, str] | None = None,
        extra_users: Sequence[tuple[str, str]] = (),
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.binary = binary
        self.credentials = credentials
        self.extra_users = list(extra_users)  # more htpasswd users (only with credentials)
        self.port = port or free_port()
        self.storage = self.workdir / "storage"
        self.config_path = self.workdir / "config.yml"
        self.log_path = self.workdir / "registry.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def _write_config(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(parents=True, exist_ok=True)
        config: dict[str, object] = {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage)},
                "delete": {"enabled": True},
                "redirect": {"disable": True},
                "cache": {"blobdescriptor": "inmemory"},
            },
            "http": {"addr": self.host, "secret": "cri-shim-test-secret"},
            "health": {"storagedriver": {"enabled": False}},
        }
        if self.credentials is not None:
            htpasswd = self.workdir / "htpasswd"
            users = [self.credentials, *self.extra_users]
            htpasswd.write_text("".join(htpasswd_line(*u) + "\n" for u in users))
            config["auth"] = {"htpasswd": {"realm": "cri-shim-test", "path": str(htpasswd)}}
        self.config_path.write_text(yaml.safe_dump(config))

    def start(self, timeout: float = 15.0) -> Registry:
        self._write_config()
        log = open(self.log_path, "ab")
        try:
            env = dict(os.environ)
            env.setdefault("GOGC", "400")  # less GC churn when pushing thousands of images
            self._proc = subprocess.Popen(
                [self.binary, "serve", str(self.config_path)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection(self.host, timeout=1)
                conn.request("GET", "/v2/")
                status = conn.getresponse().status
                conn.close()
                if status in (200, 401):
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"docker-registry did not answer on {self.host}:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            procs.terminate(proc, timeout)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def client(self, *, authenticated: bool = True, timeout: float = 30.0) -> RegistryClient:
        """A pushing client talking to the registry directly (not via a proxy)."""
        user, password = self.credentials if (self.credentials and authenticated) else (None, None)
        return RegistryClient(self.host, username=user, password=password, timeout=timeout)

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RegistryWithProxy:
    """A :class:`Registry` with a :class:`CountingProxy` in front of it.

    ``host`` is the proxy's address: use it in image refs.  ``push`` uploads
    directly to the registry but returns refs that point at the proxy.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        binary: str = "docker-registry",
        credentials: tuple[str, str] | None = None,
        extra_users: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.registry = Registry(workdir, binary=binary, credentials=credentials, extra_users=extra_users)
        self.proxy: CountingProxy | None = None
        self._client: RegistryClient | None = None

    @property
    def credentials(self) -> tuple[str, str] | None:
        return self.registry.credentials

    @property
    def host(self) -> str:
        assert self.proxy is not None, "not started"
        return self.proxy.host

    @property
    def direct_host(self) -> str:
        return self.registry.host

    def start(self) -> RegistryWithProxy:
        self.registry.start()
        self.proxy = CountingProxy(self.registry.host).start()
        self._client = self.registry.client()
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        self.registry.stop()

    @property
    def client(self) -> RegistryClient:
        assert self._client is not None, "not started"
        return self._client

    def push(self, image: OciImage, repository: str, tag: str) -> PushedImage:
        return self.client.push(image, repository, tag, pull_host=self.host)

    def push_many(self, items: list[tuple[OciImage, str, str]], *, workers: int = 8) -> list[PushedImage]:
        return self.client.push_many(items, workers=workers, pull_host=self.host)

    def stats(self) -> ProxyStats:
        assert self.proxy is not None
        return self.proxy.stats()

    def log_tail(self, lines: int = 40) -> str:
        return self.registry.log_tail(lines)

    def __enter__(self) -> RegistryWithProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
