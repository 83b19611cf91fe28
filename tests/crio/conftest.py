"""Fixtures for the shim in front of CRI-O (``pytest -m crio``).

The registry and CRI-O fixtures are shared ones (``tests.support.fixtures``): ``crio`` is a
session CRI-O pulling through the registry's counting proxy; ``crio_factory`` makes private
ones (other config, e.g. its own ``pinned_images``). Here ``shim_factory`` starts shims whose
upstream defaults to the session CRI-O and ``crictl`` talks to it directly.

Only what is CRI-O's own lives in tests/crio; a test that holds for every runtime is written
once, parametrized over ``cri_runtime`` (its CRI-O case is marked ``crio`` too), next to the
containerd tests in tests/e2e.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.crictl import Crictl
from tests.support.crio import Crio
from tests.support.fixtures import (  # noqa: F401  (re-exported fixtures)
    ShimFactory,
    _reset_proxies_after_test,
    crictl_factory,
    crio,
    crio_factory,
    fast_tmp,
    make_image,
    proxy,
    registry,
)


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
