"""End-to-end fixtures: real docker-registry, containerd, crictl and shim processes.

The fixture implementations live in :mod:`tests.support.fixtures` so other
test directories can import them too.
"""

from tests.support.fixtures import (  # noqa: F401  (re-exported fixtures)
    _reset_proxies_after_test,
    auth_registry,
    containerd,
    containerd_factory,
    crictl,
    crictl_factory,
    ctd_socket,
    ctrd2,
    fast_tmp,
    make_image,
    proxy,
    registry,
    shim_factory,
)
