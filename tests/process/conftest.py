"""Process tests: the shim run as its own process (``python -m shim serve``, ``cri-shim
check-config``...; tests/support/shim.py) in front of a scripted runtime (in the test's event
loop, or a process of its own that can be killed: tests/support/runtime_process.py), or of
none. No real runtime, kubelet or systemd: those are tests/e2e, tests/crio and tests/node."""

from tests.support.fake_fixtures import engine, runtime  # noqa: F401  (re-exported fixtures)
