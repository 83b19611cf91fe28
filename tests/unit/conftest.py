"""Unit tests: no processes of their own; a shim runs in-process, in front of a scripted runtime
where it needs one. (The shim as a process: tests/process.)"""

from tests.support.fake_fixtures import engine, runtime  # noqa: F401  (re-exported fixtures)
