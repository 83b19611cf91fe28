"""Fixtures for the shim in front of CRI-O (``pytest -m crio``).

The registry fixtures are the e2e ones (``tests.support.fixtures``). ``crio`` is a
session CRI-O pulling through the registry's counting proxy; ``crio_factory`` makes
private ones (other config, e.g. its own ``pinned_images``); ``shim_factory`` starts
shims whose upstream defaults to the session CRI-O.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import crio as crio_support
from tests.support.crictl import Crictl
from tests.support.crio import Crio
from tests.support.fixtures import (  # noqa: F401  (re-exported fixtures)
    ShimFactory,
    _Logs,
    _reset_proxies_after_test,
    crictl_factory,
    fast_tmp,
    make_image,
    proxy,
    registry,
)
from tests.support.registry import RegistryWithProxy


def _new(registry: RegistryWithProxy, log_path: Path, **kwargs: Any) -> Crio:
    paths = crio_support.require()
    workdir = tempfile.mkdtemp(prefix="e2e-crio-", dir="/tmp")  # short: unix socket paths
    return Crio(workdir, binary=paths["crio"], pinns=paths["pinns"], conmon=paths["conmon"],
                runc=paths.get("runc"), registries=[registry.host], log_path=log_path, **kwargs)


@pytest.fixture(scope="session")
def crio(registry: RegistryWithProxy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crio]:
    """A session CRI-O pulling from ``registry.host`` (the counting proxy)."""
    c = _new(registry, tmp_path_factory.mktemp("crio") / "crio.log")
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
        c = _new(self.registry, self.log_dir / f"crio-{len(self.instances) + 1}.log", **kwargs)
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


@pytest.fixture
def shim_factory(crio: Crio, tmp_path: Path) -> Iterator[ShimFactory]:
    """Like the e2e ``shim_factory``, in front of the session CRI-O unless told otherwise."""
    factory = ShimFactory(lambda: str(crio.socket), tmp_path)
    yield factory
    factory.close()


@pytest.fixture
def crictl(crictl_factory: Callable[..., Crictl], crio: Crio) -> Crictl:
    """crictl talking directly to the session CRI-O."""
    return crictl_factory(crio.socket)
