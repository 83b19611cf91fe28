"""pytest fixtures for end-to-end tests (imported by ``tests/e2e/conftest.py``).

Session scoped: ``registry`` (docker-registry + counting proxy),
``auth_registry`` (same, with htpasswd basic auth), ``containerd`` (pulling
through both proxies).  Function scoped: ``proxy`` (the registry proxy with
counters reset), ``make_image``, ``containerd_factory``, ``ctd_socket`` (a fresh
containerd of each generation and pull path), ``shim_factory``, ``crictl``,
``crictl_factory``.  ``cri_call`` lives in ``tests/conftest.py``.

CRI-O: ``crio`` (session, pulling through the registry's counting proxy) and
``crio_factory`` (private ones, other config). Runtime-parametrized tests: ``cri_runtime``,
one :class:`CriRuntime` per runtime (containerd 1.6, containerd 2.x, CRI-O; the CRI-O
parameter carries the ``crio`` marker, see :data:`RUNTIMES`), so a test that holds for
every runtime is written once; a test picks a subset with
``@pytest.mark.parametrize("cri_runtime", [...], indirect=True)``.

Any fixture value with a ``log_tails()`` method gets its logs attached to the
report of a failing test (see ``tests/conftest.py``).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import binaries, containerd2, oci
from tests.support import crio as crio_support
from tests.support.containerd import Containerd, hosts_toml
from tests.support.crictl import Crictl
from tests.support.crio import Crio
from tests.support.oci import PushedImage
from tests.support.proxy import CountingProxy
from tests.support.registry import RegistryWithProxy
from tests.support.shim import ShimProcess

#: Credentials of the ``auth_registry`` fixture.
AUTH_USER = "shim-user"
AUTH_PASSWORD = "shim-pass-42"


def _short_tmpdir(prefix: str) -> Path:
    """A short directory for unix sockets (paths must stay < 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def _fast_dir_base() -> str | None:
    """tmpfs for registry storage when available (pushing is ~2x faster)."""
    base = os.environ.get("CRI_SHIM_E2E_FAST_TMP", "/dev/shm")
    return base if os.path.isdir(base) and os.access(base, os.W_OK) else None


class _Logs:
    """Mixin-free adapter: something with ``log_tails()`` for failure reports."""

    def __init__(self, **sources: Callable[[], str]) -> None:
        self.sources = sources

    def log_tails(self) -> dict[str, str]:
        return {name: fn() for name, fn in self.sources.items()}


# --------------------------------------------------------------------------
# registries
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fast_tmp() -> Iterator[Path]:
    """A session temp dir on tmpfs when possible (removed at the end)."""
    base = _fast_dir_base()
    path = Path(tempfile.mkdtemp(prefix="cri-shim-e2e-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start_registry(
    tmp_path_factory: pytest.TempPathFactory, fast_tmp: Path, name: str, credentials: tuple[str, str] | None
) -> RegistryWithProxy:
    binary = binaries.require("docker-registry")
    if credentials is not None and importlib.util.find_spec("bcrypt") is None and not shutil.which("htpasswd"):
        binaries.require_module("bcrypt", "pip install bcrypt")
    workdir = tmp_path_factory.mktemp(name)
    reg = RegistryWithProxy(workdir, binary=binary, credentials=credentials)
    reg.registry.storage = fast_tmp / name
    return reg.start()


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory, fast_tmp: Path) -> Iterator[RegistryWithProxy]:
    """docker-registry (no auth) with a counting proxy; ``registry.host`` is the proxy."""
    reg = _start_registry(tmp_path_factory, fast_tmp, "registry", None)
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def auth_registry(
    tmp_path_factory: pytest.TempPathFactory, fast_tmp: Path, containerd: Containerd
) -> Iterator[RegistryWithProxy]:
    """A registry requiring basic auth (:data:`AUTH_USER` / :data:`AUTH_PASSWORD`).

    Its proxy host is registered with the session ``containerd``.
    """
    reg = _start_registry(tmp_path_factory, fast_tmp, "auth-registry", (AUTH_USER, AUTH_PASSWORD))
    containerd.add_registry_host(reg.host)
    yield reg
    reg.stop()


@pytest.fixture
def proxy(registry: RegistryWithProxy) -> CountingProxy:
    """The session registry's counting proxy, counters reset for this test."""
    assert registry.proxy is not None
    registry.proxy.reset()
    return registry.proxy


@pytest.fixture(autouse=True)
def _reset_proxies_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Undo throttles, holds and pending faults a test left on any proxy."""
    yield
    for name in ("registry", "auth_registry"):
        if name in request.fixturenames:
            reg: RegistryWithProxy = request.getfixturevalue(name)
            if reg.proxy is not None:
                reg.proxy.restore_defaults()


# --------------------------------------------------------------------------
# images
# --------------------------------------------------------------------------

_image_counter = itertools.count(1)


def _slug(text: str, limit: int = 40) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return (s[:limit].strip("-")) or "image"


MakeImage = Callable[..., PushedImage]


@pytest.fixture
def make_image(request: pytest.FixtureRequest, registry: RegistryWithProxy) -> MakeImage:
    """``make_image(name=None, tag="v1", *, filler_bytes=0, registry=None, ...) -> PushedImage``.

    Fabricates a unique image and pushes it (directly, uncounted) to
    ``registry`` (default: the session registry).  The result's ``ref`` /
    ``digest_ref`` point at the registry's counting proxy, ``image_id`` is the
    config digest.  Without ``name`` a unique repository name derived from
    the test name is used; a given ``name`` is used verbatim.
    Extra keyword arguments go to :func:`tests.support.oci.make_image`
    (``layers``, ``labels``, ``unique``, ...).
    """
    base = _slug(request.node.name)

    def make(
        name: str | None = None,
        tag: str = "v1",
        *,
        filler_bytes: int = 0,
        registry: RegistryWithProxy | None = None,
        **image_kwargs: Any,
    ) -> PushedImage:
        reg = registry or request.getfixturevalue("registry")
        repo = name or f"e2e/{base}-{os.getpid()}-{next(_image_counter)}"
        image = oci.make_image(filler_bytes=filler_bytes, **image_kwargs)
        return reg.push(image, repo, tag)

    return make


# --------------------------------------------------------------------------
# containerd
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def containerd(
    registry: RegistryWithProxy, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Containerd]:
    """A session containerd whose registry hosts include ``registry.host`` (the proxy).

    Its root/state live in a short /tmp dir (socket path limits, removed at
    the end); its log stays in pytest's temp dir (``containerd.log``).
    """
    binary = binaries.require("containerd")
    workdir = _short_tmpdir("e2e-ctd-")
    log = tmp_path_factory.mktemp("containerd") / "containerd.log"
    ctd = Containerd(workdir, binary=binary, registries=[registry.host], log_path=log)
    try:
        ctd.start()
        yield ctd
    finally:
        ctd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class ContainerdFactory(_Logs):
    def __init__(self, registries: Sequence[str], log_dir: Path) -> None:
        super().__init__()
        self.registries = list(registries)
        self.log_dir = log_dir
        self.instances: list[Containerd] = []

    def __call__(self, *, start: bool = True, registries: Sequence[str] | None = None, **kwargs: Any) -> Containerd:
        workdir = _short_tmpdir("e2e-ctd-")
        kwargs.setdefault("log_path", self.log_dir / f"containerd-{len(self.instances) + 1}.log")
        ctd = Containerd(
            workdir,
            binary=binaries.require("containerd"),
            registries=self.registries if registries is None else registries,
            **kwargs,
        )
        self.instances.append(ctd)
        self.sources[f"containerd {workdir}"] = ctd.log_tail
        return ctd.start() if start else ctd

    def close(self) -> None:
        for ctd in self.instances:
            ctd.stop()
            shutil.rmtree(ctd.workdir, ignore_errors=True)


@pytest.fixture
def containerd_factory(registry: RegistryWithProxy, tmp_path: Path) -> Iterator[ContainerdFactory]:
    """``containerd_factory(start=True, **Containerd kwargs) -> Containerd``: a private
    containerd (for restarts/kills) pulling via ``registry``; stopped and its
    root removed after the test (its log stays in ``tmp_path``)."""
    factory = ContainerdFactory([registry.host], tmp_path)
    yield factory
    factory.close()


class TransferContainerd2(containerd2.Containerd2):
    """containerd 2.x pulling the way it does by default on a node: through its transfer
    service (not the CRI plugin's local pull), into overlayfs."""

    def _config(self) -> str:
        return super()._config().replace("use_local_image_pull = true", "use_local_image_pull = false") \
            .replace('snapshotter = "native"', 'snapshotter = "overlayfs"')


@pytest.fixture(params=["containerd-1.6", "containerd-2.x", "containerd-2.x-transfer"])
def ctd_socket(request: pytest.FixtureRequest, containerd_factory: ContainerdFactory,
               registry: RegistryWithProxy, tmp_path: Path) -> Iterator[Path]:
    """The socket of a fresh containerd of each generation and pull path (1.6; 2.x through
    the CRI plugin's local pull; 2.x through its transfer service), pulling via ``registry``."""
    if request.param == "containerd-1.6":
        yield containerd_factory().socket
        return
    cls = TransferContainerd2 if request.param.endswith("transfer") else containerd2.Containerd2
    c = _containerd2_for(registry, cls(containerd2.require(), tmp_path / "c2", {}))
    yield c.socket
    c.stop()


def _containerd2_for(registry: RegistryWithProxy, c: containerd2.Containerd2) -> containerd2.Containerd2:
    """``c`` started, pulling from ``registry`` over plain HTTP (certs.d hosts.toml)."""
    (c.dir / "certs.d" / registry.host).mkdir(parents=True)
    (c.dir / "certs.d" / registry.host / "hosts.toml").write_text(hosts_toml(registry.host))
    c.start()
    return c


# --------------------------------------------------------------------------
# crictl
# --------------------------------------------------------------------------


@pytest.fixture
def crictl_factory() -> Callable[..., Crictl]:
    """``crictl_factory(runtime_endpoint, image_endpoint=None, timeout=30) -> Crictl``."""
    binary = binaries.require("crictl")

    def make(runtime_endpoint: str | os.PathLike[str], image_endpoint: str | os.PathLike[str] | None = None, *, timeout: float = 30.0) -> Crictl:
        return Crictl(runtime_endpoint, image_endpoint, binary=binary, timeout=timeout)

    return make


@pytest.fixture
def crictl(crictl_factory: Callable[..., Crictl], containerd: Containerd) -> Crictl:
    """crictl talking directly to the session containerd."""
    return crictl_factory(containerd.socket)


# --------------------------------------------------------------------------
# the shim
# --------------------------------------------------------------------------


class ShimFactory(_Logs):
    """Starts shims; all are stopped (SIGTERM, then SIGKILL after 10 s) at teardown."""

    def __init__(self, default_upstream: Callable[[], str], log_dir: Path) -> None:
        super().__init__()
        self._default_upstream = default_upstream
        self.log_dir = log_dir
        self.shims: list[ShimProcess] = []
        self._dirs: list[Path] = []

    def __call__(
        self,
        config: Mapping[str, object] | None = None,
        *,
        upstream: str | os.PathLike[str] | None = None,
        start: bool = True,
        timeout: float = 10.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_level: str = "debug",
        module: str = "shim",
    ) -> ShimProcess:
        sockdir = _short_tmpdir("e2e-shim-")
        self._dirs.append(sockdir)
        workdir = self.log_dir / f"shim-{len(self.shims) + 1}"
        shim = ShimProcess(
            workdir,
            socket_path=sockdir / "shim.sock",
            upstream=upstream if upstream is not None else self._default_upstream(),
            config=config,
            extra_args=extra_args,
            env=env,
            log_level=log_level,
            module=module,
        )
        self.shims.append(shim)
        self.sources[f"shim #{len(self.shims)} ({shim.log_path})"] = shim.log_tail
        if start:
            shim.start(timeout=timeout)
        return shim

    def close(self) -> list[str]:
        """Stop all shims; returns complaints (e.g. needed SIGKILL)."""
        problems = []
        for shim in self.shims:
            was_running = shim.running
            shim.stop(timeout=10.0)
            if was_running and shim.killed:
                problems.append(f"shim {shim.socket} ignored SIGTERM for 10 s and was killed")
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        return problems


@pytest.fixture
def shim_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ShimFactory]:
    """``shim_factory(config=None, *, upstream=None, start=True, timeout=10, extra_args=(), env=None, log_level="debug", module="shim") -> ShimProcess``.

    Runs ``python -m shim serve --listen unix://SOCK --upstream UPSTREAM
    --config CONFIG.yaml --log-level debug`` (cwd and PYTHONPATH = repo root),
    with ``config`` written as YAML.  ``upstream`` defaults to the session
    ``containerd`` socket.  Waits until SOCK accepts a connection.  Config
    and ``shim.log`` (stdout+stderr) are in ``tmp_path/shim-N``; SOCK is in a
    short /tmp dir.
    """

    def default_upstream() -> str:
        return str(request.getfixturevalue("containerd").socket)

    factory = ShimFactory(default_upstream, tmp_path)
    yield factory
    for problem in factory.close():
        warnings.warn(problem, stacklevel=1)


@pytest.fixture
def ctrd2(tmp_path: Path, registry: RegistryWithProxy) -> Iterator[containerd2.Containerd2]:
    """containerd 2.x pulling from the session registry; runtime ``fast`` unpacks with overlayfs
    (its default snapshotter is native). Skipped without a binary, failed under CI."""
    c = _containerd2_for(registry, containerd2.Containerd2(containerd2.require(), tmp_path / "c2",
                                                           {"fast": "overlayfs"}))
    yield c
    c.stop()


# --------------------------------------------------------------------------
# CRI-O
# --------------------------------------------------------------------------


def _new_crio(registry: RegistryWithProxy, log_path: Path, **kwargs: Any) -> Crio:
    paths = crio_support.require()
    workdir = tempfile.mkdtemp(prefix="e2e-crio-", dir="/tmp")  # short: unix socket paths
    return Crio(workdir, binary=paths["crio"], pinns=paths["pinns"], conmon=paths["conmon"],
                runc=paths.get("runc"), registries=[registry.host], log_path=log_path, **kwargs)


@pytest.fixture(scope="session")
def crio(registry: RegistryWithProxy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crio]:
    """A session CRI-O pulling from ``registry.host`` (the counting proxy). Skipped without
    its binaries, failed under CI."""
    c = _new_crio(registry, tmp_path_factory.mktemp("crio") / "crio.log")
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.workdir, ignore_errors=True)


class CrioFactory(_Logs):
    def __init__(self, registry: RegistryWithProxy, log_dir: Path) -> None:
        super().__init__()
        self.registry = registry
        self.log_dir = log_dir
        self.instances: list[Crio] = []

    def __call__(self, *, start: bool = True, **kwargs: Any) -> Crio:
        c = _new_crio(self.registry, self.log_dir / f"crio-{len(self.instances) + 1}.log", **kwargs)
        self.instances.append(c)
        self.sources[f"crio {c.workdir}"] = c.log_tail
        return c.start() if start else c

    def close(self) -> None:
        for c in self.instances:
            c.stop()
            shutil.rmtree(c.workdir, ignore_errors=True)


@pytest.fixture
def crio_factory(registry: RegistryWithProxy, tmp_path: Path) -> Iterator[CrioFactory]:
    """``crio_factory(start=True, **Crio kwargs) -> Crio``: a private CRI-O, removed after the test."""
    factory = CrioFactory(registry, tmp_path)
    yield factory
    factory.close()


# --------------------------------------------------------------------------
# one test, every runtime
# --------------------------------------------------------------------------

#: The CRI-O parameter of a runtime-parametrized test: marked ``crio`` (``pytest -m crio``
#: selects it, and it is not marked ``e2e``: it needs no containerd).
CRIO = pytest.param("crio", marks=pytest.mark.crio)
#: Every runtime ``cri_runtime`` knows, by test id.
RUNTIMES = ["containerd-1.6", "containerd-2.x", CRIO]

_RUNTIME_FIXTURES = {"containerd-1.6": "containerd", "containerd-2": "ctrd2", "containerd-2.x": "ctrd2",
                     "crio": "crio"}


@dataclass
class CriRuntime:
    """A runtime behind a runtime-parametrized test, and where runtimes answer differently."""

    name: str  # the test id: containerd-1.6, containerd-2.x (or containerd-2), crio
    instance: Any  # Containerd, containerd2.Containerd2 or Crio

    @property
    def socket(self) -> Path:
        return Path(self.instance.socket)

    @property
    def is_crio(self) -> bool:
        return self.name == "crio"

    @property
    def runtime_name(self) -> str:
        """``Version``'s runtime_name."""
        return "cri-o" if self.is_crio else "containerd"

    def image_id(self, img: PushedImage) -> str:
        """The image's ID as the runtime reports it: CRI-O the bare hex, containerd ``sha256:<hex>``."""
        return img.image_id.removeprefix("sha256:") if self.is_crio else img.image_id

    def pulled_ref(self, img: PushedImage) -> str:
        """PullImage's answer: CRI-O ``repo@sha256:<manifest digest>``, containerd the image ID."""
        return img.digest_ref if self.is_crio else img.image_id

    def log_tail(self) -> str:
        tail = getattr(self.instance, "log_tail", None)
        return tail() if callable(tail) else ""


def runtime_named(request: pytest.FixtureRequest, name: str) -> CriRuntime:
    """The runtime with test id ``name`` (its fixture is requested now: skips without binaries)."""
    return CriRuntime(name, request.getfixturevalue(_RUNTIME_FIXTURES[name]))


@pytest.fixture(params=RUNTIMES)
def cri_runtime(request: pytest.FixtureRequest) -> CriRuntime:
    """The test's runtime, each in turn (containerd 1.6 and CRI-O: the session ones; containerd
    2.x: a fresh ``ctrd2``). Skipped without a runtime's binaries, failed under CI."""
    return runtime_named(request, request.param)
