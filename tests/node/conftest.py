"""Node fixtures: the e2e registry plus containerd 2.x running pods and a standalone kubelet
(tests/support/node.py), and the shim as its own process in front of that containerd."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.fixtures import _reset_proxies_after_test, fast_tmp, registry  # noqa: F401
from tests.support.node import (  # noqa: F401
    NodeContainerd,
    kubelet_factory,
    node_binaries,
    node_containerd,
    node_images,
    short_dir,
)
from tests.support.prom import free_port
from tests.support.shim import ShimProcess, start_shim

StartShim = Callable[..., Awaitable[ShimProcess]]


@pytest.fixture
async def node_shim(node_containerd: NodeContainerd, tmp_path: Path) -> AsyncIterator[StartShim]:
    """``await node_shim(settings) -> ShimProcess``: ``python -m shim serve`` in front of the test's
    containerd, logging at debug (every relayed call is named) with metrics on a loopback port
    (``shim.metrics_address``). Stopped (SIGTERM) after the test."""
    started: list[ShimProcess] = []
    sock_dir = short_dir("nodeshim-")  # socket paths must stay short; removed after the test

    async def start(settings: Mapping[str, Any] | None = None, *, listen_path: str | None = None) -> ShimProcess:
        data: dict[str, Any] = {"log": {"level": "debug"}, "metrics": {"address": f"127.0.0.1:{free_port()}"}}
        for key, value in (settings or {}).items():
            data[key] = {**data.get(key, {}), **value} if isinstance(value, Mapping) else value
        shim = await start_shim(node_containerd.endpoint, tmp_path / f"shim{len(started)}", data,
                                listen_path=listen_path or str(sock_dir / f"shim{len(started)}.sock"))
        shim.metrics_address = data["metrics"]["address"]  # type: ignore[attr-defined]
        started.append(shim)
        return shim

    try:
        yield start
    finally:
        for shim in started:
            await shim.astop()
        shutil.rmtree(sock_dir, ignore_errors=True)
