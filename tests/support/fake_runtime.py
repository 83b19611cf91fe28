"""A scripted in-process CRI runtime: a raw-bytes gRPC server on a unix socket.

Tests script answers per method (bytes, an error, a stream, or a coroutine) and read
back what the runtime received: request bytes and metadata, in order. Used where
real containerd can't help here (RunPodSandbox, streams) and for fault tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

Reply = bytes | grpc.StatusCode | tuple | Callable[..., Awaitable[bytes]]


@dataclass
class Received:
    method: str
    request: bytes
    metadata: dict[str, Any]
    deadline: float | None


FAKE_BIDI = "/runtime.v1.FakeBidi/"  # any method: a bidi echo (a CRI service from the future)


@dataclass
class FakeRuntime:
    path: str
    unary: dict[str, Reply] = field(default_factory=dict)
    streams: dict[str, Callable[[bytes, Any], AsyncIterator[bytes]]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    server: grpc.aio.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.path}"

    def calls(self, method_suffix: str) -> list[Received]:
        return [r for r in self.received if r.method.endswith("/" + method_suffix)]

    async def start(self) -> "FakeRuntime":
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        self.server.add_generic_rpc_handlers((_Handler(self),))
        self.server.add_insecure_port(f"unix:{self.path}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method  # type: ignore[attr-defined]
        rt = self.rt
        if method in rt.streams:
            gen = rt.streams[method]

            async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                rt.received.append(Received(method, request, dict(context.invocation_metadata()),
                                            context.time_remaining()))
                async for msg in gen(request, context):
                    yield msg

            return grpc.unary_stream_rpc_method_handler(stream)
        if method.startswith(FAKE_BIDI):
            async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                async for r in requests:
                    rt.received.append(Received(method, r, dict(context.invocation_metadata()), None))
                    yield b"echo:" + r

            return grpc.stream_stream_rpc_method_handler(bidi)

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            rt.received.append(Received(method, request, dict(context.invocation_metadata()),
                                        context.time_remaining()))
            reply = rt.unary.get(method, b"")
            if callable(reply):
                return await reply(request, context)
            if isinstance(reply, grpc.StatusCode):
                await context.abort(reply, f"fake runtime says {reply.name}")
            if isinstance(reply, tuple):  # (code, details, trailing_metadata)
                await context.abort(*reply)
            return reply

        return grpc.unary_unary_rpc_method_handler(unary)


def socket_in(tmpdir: str, name: str = "fake-runtime.sock") -> str:
    return os.path.join(tmpdir, name)
