"""Running crictl against arbitrary runtime/image endpoints.

A private ``--config`` file is always passed, so no ``/etc/crictl.yaml`` is
needed (and none is read).
"""

from __future__ import annotations

import atexit
import functools
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.support.binaries import require


# Endpoints are always given on the command line; the file only keeps crictl
# from looking for /etc/crictl.yaml.
_CONFIG = "debug: false\npull-image-on-create: false\n"


@functools.cache
def _shared_config() -> Path:
    fd, path = tempfile.mkstemp(prefix="crictl-", suffix=".yaml")
    os.write(fd, _CONFIG.encode())
    os.close(fd)
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return Path(path)


def endpoint(socket: str | os.PathLike[str]) -> str:
    s = str(socket)
    return s if s.startswith("unix:") else f"unix://{s}"


class Crictl:
    """``crictl`` bound to endpoints.  ``image_endpoint`` defaults to ``runtime_endpoint``."""

    def __init__(
        self,
        runtime_endpoint: str | os.PathLike[str],
        image_endpoint: str | os.PathLike[str] | None = None,
        *,
        binary: str | None = None,
        timeout: float = 30.0,
        config_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.binary = binary or require("crictl")
        self.runtime_endpoint = endpoint(runtime_endpoint)
        self.image_endpoint = endpoint(image_endpoint if image_endpoint is not None else runtime_endpoint)
        self.timeout = timeout
        if config_dir is None:
            self.config_path = _shared_config()
        else:
            self.config_path = Path(config_dir) / "crictl.yaml"
            self.config_path.write_text(_CONFIG)

    def argv(self, *args: str, timeout: float | None = None) -> list[str]:
        t = self.timeout if timeout is None else timeout
        return [
            self.binary,
            "--config",
            str(self.config_path),
            "--runtime-endpoint",
            self.runtime_endpoint,
            "--image-endpoint",
            self.image_endpoint,
            "--timeout",
            f"{t:g}s",
            *args,
        ]

    def run(
        self,
        *args: str,
        timeout: float | None = None,
        check: bool = False,
        input: str | None = None,  # noqa: A002
    ) -> subprocess.CompletedProcess[str]:
        """Run ``crictl ARGS``; the process gets ``timeout`` + 30 s before being killed."""
        t = self.timeout if timeout is None else timeout
        return subprocess.run(
            self.argv(*args, timeout=t),
            capture_output=True,
            text=True,
            check=check,
            input=input,
            timeout=t + 30,
        )

    # Convenience wrappers -------------------------------------------------

    def pull(self, image: str, *, creds: str | None = None, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        args = ["pull"] + (["--creds", creds] if creds else []) + [image]
        return self.run(*args, timeout=timeout)

    def images(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.run("images", *extra)

    def rmi(self, *images: str) -> subprocess.CompletedProcess[str]:
        return self.run("rmi", *images)

    def inspecti(self, image: str) -> subprocess.CompletedProcess[str]:
        return self.run("inspecti", "-o", "json", image)


def run_crictl(
    args: Sequence[str],
    *,
    runtime_endpoint: str,
    image_endpoint: str | None = None,
    timeout: float = 30.0,
) -> subprocess.CompletedProcess[str]:
    """One-shot ``crictl`` run (creates a throw-away config file)."""
    with tempfile.TemporaryDirectory(prefix="crictl-") as d:
        return Crictl(runtime_endpoint, image_endpoint, timeout=timeout, config_dir=d).run(*args)
