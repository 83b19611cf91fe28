"""YAML bounds where an operator meets them in a shim process: a bad config at start exits with
one short line; at reload the running config stays and one short line says why.
(The parser's bounds themselves: tests/unit/test_yaml_bounds.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import yaml

from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import shim_process, start_shim
from tests.support.slow_pulls import VERSION
from tests.unit.test_yaml_bounds import SHORT, alias_bomb


def test_serve_exits_with_one_short_line_on_an_alias_bomb(tmp_path: Path) -> None:
    async def run() -> tuple[int, str]:
        shim = await start_shim("unix:///nonexistent/rt.sock", tmp_path, alias_bomb(), wait=False)
        code = await shim.await_exit(30)
        await shim.astop()
        return code, shim.logs()

    code, out = asyncio.run(run())
    assert code != 0 and out.count("\n") == 1 and "aliases (*name) are not allowed" in out and len(out) < SHORT


async def test_reload_with_an_alias_bomb_keeps_the_running_config(runtime: FakeRuntime, tmp_path: Path) -> None:
    runtime.unary[VERSION] = b"\x0a\x050.1.0"
    good = {"pulls": {"max_parallel": 3}, "server": {"admin_socket": ""}}
    async with shim_process(runtime.endpoint, tmp_path, good) as shim:
        shim.write_config(alias_bomb())
        shim.reload()
        await shim.await_log("config reload rejected")
        shim.write_config(yaml.safe_dump({**good, "pulls": {"max_parallel": "x" * 1_000_000}}))
        shim.reload()
        end = await shim.await_log("got 'xxx")
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:  # still serving
            await ch.unary_unary(VERSION)(b"", timeout=10)
        log = shim.logs()
        assert shim.proc.poll() is None and "Traceback" not in log
        assert len(log.encode()) < 4096, log[:2000]
        assert "aliases (*name) are not allowed" in log and "pulls.max_parallel" in log[:end]


