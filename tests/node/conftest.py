"""Node fixtures: the e2e registry plus containerd 2.x running pods and a standalone kubelet
(tests/support/node.py)."""

from tests.support.fixtures import _reset_proxies_after_test, fast_tmp, registry  # noqa: F401
from tests.support.node import kubelet_factory, node_binaries, node_containerd, node_images  # noqa: F401
