"""Out of file descriptors (EMFILE), a shim process with a low RLIMIT_NOFILE: it is logged as
that, callers are told so, and the listener accepts again once descriptors are free.
(The other relay limits, in-process: tests/unit/test_relay_limits.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from shim.relay import http2
from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import ShimProcess, new_shim

VERSION = "/runtime.v1.RuntimeService/Version"


async def version(endpoint: str, timeout: float = 5) -> bytes:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        return await ch.unary_unary(VERSION)(b"", timeout=timeout)


def shim_with_fd_limit(upstream: str, workdir: Path, sock_dir: Path, nofile: int) -> ShimProcess:
    """A shim process whose RLIMIT_NOFILE is ``nofile``, soft and hard (it cannot raise it)."""
    return new_shim(upstream, workdir, {"server": {"engine": "relay"}}, listen_path=sock_dir / "shim.sock",
                    nofile=(nofile, nofile))


async def test_out_of_file_descriptors_is_reported_as_such_and_the_listener_recovers(runtime: FakeRuntime,
                                                                                      tmp_path, short_tmp) -> None:
    runtime.unary[VERSION] = b"v"
    shim = await shim_with_fd_limit(runtime.endpoint, tmp_path, short_tmp, 96).astart(wait=False)
    try:
        await shim.await_ready()
        conns = []
        for _ in range(120):  # more than the shim has descriptors for, two per connection
            try:
                r, w = await asyncio.open_unix_connection(shim.path)
            except OSError:
                break
            w.write(http2.PREFACE + http2.settings_frame({}))
            conns.append((r, w))
        await shim.await_log("out of file descriptors", timeout=10)
        assert "runtime not reachable" not in shim.logs()
        for _, w in conns:
            w.close()
        deadline = time.monotonic() + 10
        while True:  # the listener accepts again once descriptors are free
            try:
                assert await version(shim.endpoint, timeout=2) == b"v"
                break
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert shim.proc.poll() is None
    finally:
        await shim.astop()
