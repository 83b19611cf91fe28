"""The generic gRPC handler: raw-bytes passthrough plus a small interception table.

Every method is served, known or not. Requests and responses stay bytes (no
serializers), so a method we don't intercept costs one upstream call and nothing
else. Known CRI methods use their real cardinality; a method we have never heard
of is proxied as a bidirectional stream, which carries any gRPC call shape.

Observability (the App's ``Observation``: the rpc duration metric and spans) is applied
on the interception path. With tracing off the passthrough handlers are
exactly the plain ones; with tracing on, unary and server-streaming passthrough calls
that continue a sampled trace (``traceparent`` with the sampled flag) get a SERVER span
too; others pass as they are (the shim never starts a trace for kubelet's polling).

Every call is routed once by the App's ``router`` (shim/cri/routing.py: the runtime's
spelling rules, the interception table, the allowed services); handlers follow the call
model of shim/cri/call.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, TypeAlias, cast

import grpc

from ..cri.call import (
    Call,
    Handler,
    Observation,
    StreamHandler,
    UnaryHandler,
    forwardable,
)
from ..cri.deadline import Deadline
from ..cri.methods import Cardinality, cardinality
from ..cri.peer import UNIDENTIFIED
from ..cri.routing import Intercept, Patch, Refusal, Router
from ..cri.upstream import Upstream
from ..errors import Metadata, RpcError
from ..observability import logs

_log = logs.get("proxy")

# Requests and responses are bytes: no serializers on either side.
Context: TypeAlias = "grpc.aio.ServicerContext[bytes, bytes]"
MethodHandler: TypeAlias = "grpc.RpcMethodHandler[bytes, bytes]"

# What grpc.aio puts in place of a call's status when writing a request message fails.
_WRITE_FAILED = "Internal error from Core"


class StreamedCallStatus:
    """The runtime's own status for a call whose request messages we stream upstream.

    grpc.aio replaces a call's status with INTERNAL "Internal error from Core" when a
    request write fails because the runtime has already answered and reset the stream.
    grpc-go does exactly that for a method it doesn't know: UNIMPLEMENTED on the HEADERS
    frame, before our copy of the request arrives. The runtime's status is set on the call
    too, before or after the write failure: a done callback sees the first status set, the
    call keeps the last one, and the one that is not the write failure is the runtime's.
    """

    def __init__(self, call: grpc.aio.Call) -> None:
        self._call = call
        self._first: RpcError | None = None
        call.add_done_callback(self._done)

    def _done(self, call: grpc.aio.Call) -> None:
        # Runs inside grpc.aio when the first status is set, which is already there:
        # its coroutines complete without suspending.
        code, details, trailers = _now(call.code()), _now(call.details()), _now(call.trailing_metadata())
        if code is not None:
            self._first = RpcError(code, details or "", tuple(trailers or ()), from_upstream=True)

    async def error(self, wait: float = 1.0) -> RpcError | None:
        """The runtime's error, None if it answered OK. Call once the call is done."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            first = self._first
            if first is not None and first.details != _WRITE_FAILED:
                return None if first.code is grpc.StatusCode.OK else first
            code, details = await self._call.code(), await self._call.details()
            if details != _WRITE_FAILED:  # the runtime's status replaced the write failure
                if code is grpc.StatusCode.OK:
                    return None
                md = await self._call.trailing_metadata()
                return RpcError(code, details or "", tuple(md or ()), from_upstream=True)
            if loop.time() >= deadline:  # never seen: report what grpc.aio says
                return RpcError(code, details or "", from_upstream=True)
            await asyncio.sleep(0.005)


def _now(coro: Any) -> Any:
    """Run a coroutine that completes without suspending; None if it would suspend."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    return None


def forward_metadata(context: Context) -> Metadata:
    return forwardable(tuple(context.invocation_metadata() or ()))


def _ended_by(context: Context) -> grpc.StatusCode:
    """What a call cancelled under its handler ended with for its client: its deadline
    (DEADLINE_EXCEEDED, which grpc.aio also delivers as a cancel) or its own cancel."""
    remaining = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED


async def _fail(context: Context, e: RpcError) -> None:
    await context.abort(e.code, e.details, e.trailing_metadata)


def _refuse(refusal: Refusal) -> Callable[[Any, Any], AsyncIterator[bytes]]:
    async def refuse(requests: Any, context: Context) -> AsyncIterator[bytes]:
        for _ in ():  # never runs: the yield makes this an async generator, as stream_stream handlers are
            yield b""
        await context.abort(refusal.code, refusal.message)

    return refuse


class Proxy(grpc.GenericRpcHandler):
    """Serves every method: intercepted ones via ``table``, the rest byte for byte."""

    def __init__(self, upstream: Upstream, router: Router[Handler], observation: Observation) -> None:
        self.upstream = upstream
        self.router = router  # the App's: its table and allowed services, changed on reload
        self._cache: dict[str, MethodHandler] = {}
        self._generation = router.generation
        self.observation = observation
        self.tracing = observation.tracing

    # grpc.GenericRpcHandler
    def service(self, details: grpc.HandlerCallDetails) -> MethodHandler:
        method = details.method
        if self._generation != self.router.generation:  # the table changed (reload, pins)
            self._cache.clear()
            self._generation = self.router.generation
        h = self._cache.get(method)
        if h is None:
            h = self._build(method)
            if cardinality(method) is not None:  # don't let unknown names grow the cache
                self._cache[method] = h
        return h

    def _build(self, method: str) -> MethodHandler:
        route = self.router.route(method)
        if isinstance(route, Refusal):
            return grpc.stream_stream_rpc_method_handler(_refuse(route))
        card = cardinality(method)
        if isinstance(route, (Intercept, Patch)):  # this engine cannot rewrite frames: a Patch is intercepted
            sent_as = "" if route.method == method else method
            if card is Cardinality.UNARY:
                return grpc.unary_unary_rpc_method_handler(
                    self._intercepted_unary(route.method, route.handler, sent_as))
            if card is Cardinality.SERVER_STREAM:
                return grpc.unary_stream_rpc_method_handler(
                    self._intercepted_stream(route.method, route.handler, sent_as))
        if card is Cardinality.UNARY:
            if self.tracing is not None:
                return grpc.unary_unary_rpc_method_handler(self._traced_passthrough_unary(method))
            return grpc.unary_unary_rpc_method_handler(self._passthrough_unary(method))
        if card is Cardinality.SERVER_STREAM:
            if self.tracing is not None:
                return grpc.unary_stream_rpc_method_handler(self._traced_passthrough_server_stream(method))
            return grpc.unary_stream_rpc_method_handler(self._passthrough_server_stream(method))
        if card is Cardinality.CLIENT_STREAM:
            return grpc.stream_unary_rpc_method_handler(self._passthrough_client_stream(method))
        return grpc.stream_stream_rpc_method_handler(self._passthrough_bidi(method))

    # ------------------------------------------------------------------ passthrough

    def _passthrough_unary(self, method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        mc = self.upstream.unary_callable(method)

        async def unary(request: bytes, context: Context) -> bytes:
            call = mc(request, metadata=forward_metadata(context), timeout=context.time_remaining())
            try:
                response = await call
            except grpc.aio.AioRpcError as e:
                await _fail(context, RpcError.from_aio(e))
                raise  # unreachable: abort raises
            trailers = await call.trailing_metadata()
            if trailers:
                context.set_trailing_metadata(trailers)
            return response

        return unary

    def _passthrough_server_stream(self, method: str) -> Callable[[bytes, Any], AsyncIterator[bytes]]:
        mc = self.upstream.stream_callable(method)

        async def server_stream(request: bytes, context: Context) -> AsyncIterator[bytes]:
            call = mc(request, metadata=forward_metadata(context), timeout=context.time_remaining())
            try:
                async for msg in call:
                    yield msg
            except grpc.aio.AioRpcError as e:
                await _fail(context, RpcError.from_aio(e))
            finally:
                call.cancel()
            trailers = await call.trailing_metadata()
            if trailers:
                context.set_trailing_metadata(trailers)

        return server_stream

    def _passthrough_client_stream(self, method: str) -> Callable[[Any, Any], Awaitable[bytes]]:
        mc: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = self.upstream.channel.stream_unary(method)

        async def client_stream(requests: AsyncIterator[bytes], context: Context) -> bytes:
            call = mc(requests, metadata=forward_metadata(context), timeout=context.time_remaining())
            status = StreamedCallStatus(call)
            try:
                response = await call
            except grpc.aio.AioRpcError as e:
                await _fail(context, await status.error() or RpcError.from_aio(e))
                raise
            trailers = await call.trailing_metadata()
            if trailers:
                context.set_trailing_metadata(trailers)
            return response

        return client_stream

    def _passthrough_bidi(self, method: str) -> Callable[[Any, Any], AsyncIterator[bytes]]:
        mc: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = self.upstream.channel.stream_stream(method)

        async def bidi(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
            call = mc(requests, metadata=forward_metadata(context), timeout=context.time_remaining())
            status = StreamedCallStatus(call)
            try:
                initial = await call.initial_metadata()
                if initial:
                    await context.send_initial_metadata(initial)
                async for msg in call:
                    yield msg
            except grpc.aio.AioRpcError:
                error = await status.error()
                if error is not None:  # else the runtime answered OK and only our write failed
                    await _fail(context, error)
            finally:
                call.cancel()
            trailers = await call.trailing_metadata()
            if trailers:
                context.set_trailing_metadata(trailers)

        return bidi

    # ------------------------------------------------------------------ passthrough, traced

    def _traced_passthrough_unary(self, method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        plain = self._passthrough_unary(method)
        mc = self.upstream.unary_callable(method)
        tracing = self.tracing
        assert tracing is not None

        async def unary(request: bytes, context: Context) -> bytes:
            md = forward_metadata(context)
            if not tracing.wants_passthrough_span(md):
                return await plain(request, context)
            span, md = tracing.server_span(method, md)
            code, details = grpc.StatusCode.OK, None
            try:
                call = mc(request, metadata=md, timeout=context.time_remaining())
                try:
                    response = await call
                except grpc.aio.AioRpcError as e:
                    code, details = e.code(), e.details()
                    await _fail(context, RpcError.from_aio(e))
                    raise
                trailers = await call.trailing_metadata()
                if trailers:
                    context.set_trailing_metadata(trailers)
                return response
            except asyncio.CancelledError:
                code = _ended_by(context)
                raise
            finally:
                tracing.end(span, code, details)

        return unary

    def _traced_passthrough_server_stream(self, method: str) -> Callable[[bytes, Any], AsyncIterator[bytes]]:
        plain = self._passthrough_server_stream(method)
        mc = self.upstream.stream_callable(method)
        tracing = self.tracing
        assert tracing is not None

        async def server_stream(request: bytes, context: Context) -> AsyncIterator[bytes]:
            md = forward_metadata(context)
            if not tracing.wants_passthrough_span(md):
                async for msg in plain(request, context):
                    yield msg
                return
            span, md = tracing.server_span(method, md)
            code, details = grpc.StatusCode.OK, None
            call = mc(request, metadata=md, timeout=context.time_remaining())
            try:
                async for msg in call:
                    yield msg
                trailers = await call.trailing_metadata()
                if trailers:
                    context.set_trailing_metadata(trailers)
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details()
                await _fail(context, RpcError.from_aio(e))
            except (asyncio.CancelledError, GeneratorExit):
                code = _ended_by(context)
                raise
            finally:
                call.cancel()
                tracing.end(span, code, details)

        return server_stream

    # ------------------------------------------------------------------ interception

    def _call(self, method: str, context: Context, sent_as: str) -> Call:
        return Call(method, forward_metadata(context), Deadline.after(context.time_remaining()), self.upstream,
                    sent_as=sent_as, peer=UNIDENTIFIED)

    def _intercepted_unary(self, method: str, handler: Handler,
                           sent_as: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        h = cast(UnaryHandler, handler)  # the route's method is unary (cardinality, in _build)

        async def unary(request: bytes, context: Context) -> bytes:
            try:
                with self.observation.observe(self._call(method, context, sent_as)) as call:
                    return await h(request, call)
            except RpcError as e:
                await _fail(context, e)
                raise
            except Exception:
                _log.error("handler failed", extra={"fields": {"method": method}}, exc_info=True)
                await context.abort(grpc.StatusCode.INTERNAL, f"cri-shim: internal error in {method}")
                raise

        return unary

    def _intercepted_stream(self, method: str, handler: Handler,
                            sent_as: str) -> Callable[[bytes, Any], AsyncIterator[bytes]]:
        h = cast(StreamHandler, handler)  # the route's method is server-streaming (cardinality, in _build)

        async def server_stream(request: bytes, context: Context) -> AsyncIterator[bytes]:
            try:
                with self.observation.observe(self._call(method, context, sent_as)) as call:
                    async for msg in h(request, call):
                        yield msg
            except RpcError as e:
                await _fail(context, e)

        return server_stream
