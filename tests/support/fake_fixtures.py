"""Fixtures for tests that run a shim (in-process or as a process) in front of a scripted
runtime (imported by ``tests/unit/conftest.py`` and ``tests/process/conftest.py``)."""

from __future__ import annotations

import pytest

from tests.support.fake_runtime import FakeRuntime, socket_in


@pytest.fixture(params=["relay", "grpc"])
def engine(request) -> str:
    """Both passthrough engines (server.engine) must behave the same."""
    return request.param


@pytest.fixture
async def runtime(tmp_path):
    """A scripted runtime on a unix socket; tests set its answers."""
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    yield rt
    await rt.stop()
