"""Run the shim inside the test's event loop (for fast tests against a fake runtime)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from typing import Any, AsyncIterator

from shim import config as config_mod
from shim.process.app import App
from shim.process.server import ShimServer
from tests.support.shim import with_state_file


@dataclasses.dataclass
class RunningShim:
    endpoint: str
    path: str
    server: ShimServer

    @property
    def app(self) -> App:
        return self.server.app


@contextlib.asynccontextmanager
async def running_shim(upstream: str, settings: dict[str, Any] | None = None,
                       config_path: str | None = None, engine: str | None = None) -> AsyncIterator[RunningShim]:
    d = tempfile.mkdtemp(prefix="cri-shim-test-")
    try:
        path = os.path.join(d, "shim.sock")
        data = with_state_file(settings or {}, d)
        data.setdefault("server", {}).setdefault("admin_socket", "")
        if engine is not None:
            data["server"]["engine"] = engine
        data["listen"], data["upstream"] = f"unix://{path}", upstream
        cfg = config_mod.from_dict(data)
        srv = ShimServer(cfg, config_path, {})
        await srv.start()
        try:
            yield RunningShim(f"unix://{path}", path, srv)
        finally:
            await srv.shutdown()
    finally:
        shutil.rmtree(d, ignore_errors=True)
