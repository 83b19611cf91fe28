"""The connection to the real runtime (containerd or CRI-O).

One grpc.aio channel, created at start whether or not the runtime socket exists yet.
While the runtime is away, calls fail fast with UNAVAILABLE (no wait_for_ready);
reconnect backoff is capped at one second so service resumes within seconds of
the runtime (re)appearing. Multi-callables are cached per method.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

from . import logs
from .errors import Metadata, RpcError

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


class Upstream:
    """Raw-bytes calls to the runtime. Errors become RpcError(from_upstream=True)."""

    def __init__(self, target: str, max_message_bytes: int) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(target, options=channel_options(max_message_bytes))
        self._unary: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._stream: dict[str, grpc.aio.UnaryStreamMultiCallable] = {}
        self.state: str = "connecting"
        self._watcher: asyncio.Task[None] | None = None

    def unary_callable(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        mc = self._unary.get(method)
        if mc is None:
            mc = self._unary[method] = self.channel.unary_unary(method)
        return mc

    def stream_callable(self, method: str) -> grpc.aio.UnaryStreamMultiCallable:
        mc = self._stream.get(method)
        if mc is None:
            mc = self._stream[method] = self.channel.unary_stream(method)
        return mc

    async def unary(self, method: str, request: bytes, *, metadata: Metadata = (),
                    timeout: float | None = None) -> bytes:
        try:
            return await self.unary_callable(method)(request, metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise RpcError.from_aio(e) from None

    async def server_stream(self, method: str, request: bytes, *, metadata: Metadata = (),
                            timeout: float | None = None) -> AsyncIterator[bytes]:
        call = self.stream_callable(method)(request, metadata=metadata, timeout=timeout)
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
