"""The connection to the real runtime (containerd or CRI-O).

One grpc.aio channel, created at start whether or not the runtime socket exists yet.
While the runtime is away, calls fail fast with UNAVAILABLE (no wait_for_ready);
reconnect backoff is capped at one second so service resumes within seconds of
the runtime (re)appearing, and a call that finds the channel still backing off while
the runtime's socket already accepts waits for the reconnect instead of failing
(the relay serves relayed calls on fresh connections at once: intercepted ones must
not lag behind). Multi-callables are cached per method.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

from ..errors import Metadata, RpcError
from ..observability import logs
from .deadline import NO_DEADLINE, Deadline

_log = logs.get("upstream")


def channel_options(max_message_bytes: int) -> list[tuple[str, int | str]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.enable_retries", 0),
        ("grpc.default_authority", "localhost"),
    ]


# grpc-core's status for a call that found no connection (the request was never sent).
_NOT_CONNECTED = "failed to connect to all addresses"
RECONNECT_WAIT_SECONDS = 2.0


async def _accepts(path: str) -> bool:
    """Does the unix socket at ``path`` accept a connection right now?"""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 0.5)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


class Upstream:
    """Raw-bytes calls to the runtime. Errors become RpcError(from_upstream=True).

    A call ends at its ``deadline`` (cri/deadline.py): the caller's, or one the shim sets
    for its own calls (``Deadline.after(seconds)``); grpc.aio gets what is left of it."""

    def __init__(self, target: str, max_message_bytes: int) -> None:
        self.target = target
        self.path = target[len("unix://"):] if target.startswith("unix://") else target.removeprefix("unix:")
        self.channel = grpc.aio.insecure_channel(target, options=channel_options(max_message_bytes))
        self._unary: dict[str, grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._stream: dict[str, grpc.aio.UnaryStreamMultiCallable[bytes, bytes]] = {}
        self.state: str = "connecting"
        self._watcher: asyncio.Task[None] | None = None

    def unary_callable(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
        mc = self._unary.get(method)
        if mc is None:
            mc = self._unary[method] = self.channel.unary_unary(method)
        return mc

    def stream_callable(self, method: str) -> grpc.aio.UnaryStreamMultiCallable[bytes, bytes]:
        mc = self._stream.get(method)
        if mc is None:
            mc = self._stream[method] = self.channel.unary_stream(method)
        return mc

    async def unary(self, method: str, request: bytes, *, metadata: Metadata = (),
                    deadline: Deadline = NO_DEADLINE) -> bytes:
        mc = self.unary_callable(method)
        try:
            return await mc(request, metadata=metadata, timeout=deadline.remaining())
        except grpc.aio.AioRpcError as e:
            if not await self._back_after_outage(e, deadline):
                raise RpcError.from_aio(e) from None
        try:  # the first attempt never left this process: sending it now is no retry
            return await mc(request, metadata=metadata, timeout=deadline.remaining())
        except grpc.aio.AioRpcError as e:
            raise RpcError.from_aio(e) from None

    async def _back_after_outage(self, e: grpc.aio.AioRpcError, deadline: Deadline) -> bool:
        """The call failed without a connection, yet the runtime's socket accepts one now:
        the channel is still in reconnect backoff from an outage (up to a second). Wait
        for it, within the caller's deadline. A runtime that is really away still
        fails the call at once."""
        if e.code() is not grpc.StatusCode.UNAVAILABLE or not (e.details() or "").startswith(_NOT_CONNECTED):
            return False
        left = deadline.remaining()
        wait = RECONNECT_WAIT_SECONDS if left is None else min(left, RECONNECT_WAIT_SECONDS)
        if wait <= 0 or not await _accepts(self.path):
            return False
        try:
            await asyncio.wait_for(self.channel.channel_ready(), wait)
        except TimeoutError:
            return False
        logs.log(_log, logging.DEBUG, "runtime back; call sent after the channel reconnected", target=self.target)
        return True

    async def server_stream(self, method: str, request: bytes, *, metadata: Metadata = (),
                            deadline: Deadline = NO_DEADLINE) -> AsyncIterator[bytes]:
        call = self.stream_callable(method)(request, metadata=metadata, timeout=deadline.remaining())
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as e:
            raise RpcError.from_aio(e) from None
        finally:
            call.cancel()

    def start_watch(self) -> None:
        """Log upstream down/up transitions (one line each) and keep ``state`` current."""
        self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="upstream-watch")

    async def _watch(self) -> None:
        s = self.channel.get_state(try_to_connect=True)
        while True:
            new = _STATE_NAMES.get(s, str(s))
            if new != self.state:
                if new == "ready":
                    logs.log(_log, logging.INFO, "upstream up", target=self.target)
                elif new == "transient_failure" and self.state in ("ready", "connecting"):
                    logs.log(_log, logging.WARNING, "upstream down", target=self.target)
                self.state = new
            await self.channel.wait_for_state_change(s)
            s = self.channel.get_state(try_to_connect=True)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await self.channel.close()


_STATE_NAMES = {
    grpc.ChannelConnectivity.IDLE: "idle",
    grpc.ChannelConnectivity.CONNECTING: "connecting",
    grpc.ChannelConnectivity.READY: "ready",
    grpc.ChannelConnectivity.TRANSIENT_FAILURE: "transient_failure",
    grpc.ChannelConnectivity.SHUTDOWN: "shutdown",
}
