"""A client that does not read its answers, over real sockets (issue 25).

While the shim holds the runtime's answers back for a client (its write buffer is over
server.write_buffer_high_bytes), it reads neither the runtime nor that client: the
client's new calls wait in its own socket instead of being relayed, so the runtime is
not left holding answers nobody drains. A client that pauses, then reads, gets every
answer and goes on. (The stream limit itself is tested frame by frame in
test_relay_core_streams.py; tests/e2e/test_relay_abuse.py measures RSS with containerd.)
"""

from __future__ import annotations

import asyncio

from shim.relay.connection import ClientConnection
from tests.support.fake_runtime import FakeRuntime
from tests.support.h2raw import (REFUSED_STREAM, RST_STREAM, SETTINGS, SETTINGS_MAX_CONCURRENT_STREAMS, RawH2,
                                 grpc_message, unary_calls)
from tests.support.inproc import running_shim

LIST = "/runtime.v1.RuntimeService/ListContainers"
ANSWER = b"x" * (16 << 10)  # 100 of them are far more than the socket and the shim's buffer hold
CALLS = 100  # server.max_concurrent_streams's default: a client may have this many in flight
SMALL_BUFFERS = {"server": {"write_buffer_high_bytes": "16KiB", "write_buffer_low_bytes": "4KiB"}}


def calls(first_sid: int, n: int) -> bytes:
    return unary_calls(LIST, b"", first_sid, n)


def open_client(path: str) -> RawH2:
    """A client whose flow-control windows never hold anything back: only reading does."""
    c = RawH2(path, timeout=10)
    c.open_windows()
    return c


async def held_back(shim) -> ClientConnection:
    """The client's connection once the shim stopped reading it and its runtime connection."""
    for _ in range(500):
        conn = next(iter(shim.server.relay.connections), None)
        if conn is not None and "client-slow" in conn.paused("client"):
            assert "client-slow" in conn.paused("upstream")
            return conn
        await asyncio.sleep(0.01)
    raise AssertionError("the shim kept reading a client that reads nothing")


async def test_a_client_that_reads_nothing_gets_no_more_calls_relayed(runtime: FakeRuntime) -> None:
    """40 calls, unread, then 40 more: all within the stream limit, yet the later ones wait
    in the client's socket while the earlier answers wait in the runtime."""
    runtime.unary[LIST] = ANSWER
    n = 40  # their answers (640 KiB) are far more than the buffers on the way hold
    async with running_shim(runtime.endpoint, SMALL_BUFFERS, engine="relay") as shim:
        c = open_client(shim.path)
        assert await asyncio.to_thread(c.send, calls(1, n), 10)
        conn = await held_back(shim)
        for _ in range(500):
            if len(runtime.calls("ListContainers")) == n:
                break
            await asyncio.sleep(0.01)
        assert len(runtime.calls("ListContainers")) == n
        assert await asyncio.to_thread(c.send, calls(2 * n + 1, n), 10)
        await asyncio.sleep(1.0)  # time the runtime would need to see them
        assert len(runtime.calls("ListContainers")) == n
        assert len(conn.core.streams.relayed) <= n  # and the shim never saw them
        c.close()


async def test_a_client_that_pauses_then_reads_gets_every_answer_and_goes_on(runtime: FakeRuntime) -> None:
    runtime.unary[LIST] = ANSWER
    async with running_shim(runtime.endpoint, SMALL_BUFFERS, engine="relay") as shim:
        c = open_client(shim.path)
        assert await asyncio.to_thread(c.send, calls(1, CALLS), 10)
        await held_back(shim)
        await asyncio.sleep(3.0)  # the client's pause
        first = await asyncio.to_thread(c.read_answers, CALLS)
        assert first == {sid: (len(grpc_message(ANSWER)), b"0") for sid in range(1, 2 * CALLS, 2)}
        # drained: the next calls are relayed and answered as usual
        assert await asyncio.to_thread(c.send, calls(2 * CALLS + 1, CALLS), 10)
        second = await asyncio.to_thread(c.read_answers, CALLS)
        assert second == {sid: (len(grpc_message(ANSWER)), b"0") for sid in range(2 * CALLS + 1, 4 * CALLS, 2)}
        c.close()


async def test_server_max_concurrent_streams_is_advertised_and_a_call_beyond_it_refused(runtime: FakeRuntime,
                                                                                        caplog) -> None:
    release = asyncio.Event()

    async def hang(request: bytes, context: object) -> bytes:
        await release.wait()
        return b"late"
    runtime.unary[LIST] = hang
    async with running_shim(runtime.endpoint, {"server": {"max_concurrent_streams": 2}}, engine="relay") as shim:
        c = RawH2(shim.path, timeout=10)
        settings, _ = await asyncio.to_thread(c.read_until, lambda f: f.type == SETTINGS and not f.flags & 1, 10)
        assert settings is not None and settings.settings[SETTINGS_MAX_CONCURRENT_STREAMS] == 2
        assert await asyncio.to_thread(c.send, calls(1, 3), 10)
        refused, _ = await asyncio.to_thread(c.read_until, lambda f: f.type == RST_STREAM, 10)
        assert refused is not None and (refused.stream_id, refused.error_code) == (5, REFUSED_STREAM)
        release.set()
        assert await asyncio.to_thread(c.read_answers, 2) == {1: (len(grpc_message(b"late")), b"0"),
                                                             3: (len(grpc_message(b"late")), b"0")}
        assert len(runtime.calls("ListContainers")) == 2  # the refused call never reached it
        assert "server.max_concurrent_streams reached" in caplog.text
        c.close()
