"""End-to-end fixtures: real docker-registry, containerd, crictl and shim processes.

The fixture implementations live in :mod:`tests.support.fixtures` so other
test directories can import them too. ``cri_runtime`` parametrizes a test over the
runtimes (containerd 1.6, containerd 2.x, CRI-O): its CRI-O case is marked ``crio``
(and not ``e2e``), so ``pytest -m crio`` runs it with tests/crio.
"""

from tests.support.fixtures import (  # noqa: F401  (re-exported fixtures)
    _reset_proxies_after_test,
    auth_registry,
    containerd,
    containerd_factory,
    crictl,
    cri_runtime,
    crictl_factory,
    crio,
    crio_factory,
    ctd_socket,
    ctrd2,
    fast_tmp,
    make_image,
    proxy,
    registry,
    shim_factory,
)
