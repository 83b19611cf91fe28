"""The generic gRPC handler: raw-bytes passthrough plus a small interception table.

Every method is served, known or not. Requests and responses stay bytes (no
serializers), so a method we don't intercept costs one upstream call and nothing
else. Known CRI methods use their real cardinality; a method we have never heard
of is proxied as a bidirectional stream, which carries any gRPC call shape.

Observability (``on_call`` for the rpc duration metric, ``tracing`` for spans) is
applied on the interception path. With tracing off the passthrough handlers are
exactly the plain ones; with tracing on, unary and server-streaming passthrough calls
that continue a sampled trace (``traceparent`` with the sampled flag) get a SERVER span
too; others pass as they are (the shim never starts a trace for kubelet's polling).

Every call is routed by ``router`` (shim/cri/routing.py: the runtime's spelling rules, the
interception table, the allowed services). Intercepted methods are looked up in its
``table``: canonical method name -> Handler. A unary
handler is ``async def (request: bytes, call: Call) -> bytes``; a server-streaming
one is ``def (request: bytes, call: Call) -> AsyncIterator[bytes]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Union

import grpc

from .observability import logs
from .errors import Metadata, RpcError
from .cri.methods import Cardinality, cardinality
from .cri.routing import Intercept, Refusal, Router
from .observability.tracing import NOOP_SPAN, Span, Tracing
from .cri.upstream import Upstream

_log = logs.get("proxy")

# Request headers that belong to the hop, not to the call.
_HOP_HEADERS = frozenset({"user-agent", "te", "content-type", "grpc-timeout", "grpc-encoding",
                          "grpc-accept-encoding", ":authority", "host"})


@dataclass(slots=True)
class Call:
    """What an interception handler gets besides the request bytes."""

    method: str
    metadata: Metadata  # request metadata to forward upstream (traceparent etc.)
    timeout: float | None  # seconds left before the caller's deadline, None = none
    context: grpc.aio.ServicerContext
    upstream: Upstream
    span: Span = NOOP_SPAN  # this call's SERVER span (a no-op span when tracing is off)
    sent_as: str = ""  # :path as the client spelled it, if not ``method``

    async def forward(self, request: bytes, method: str | None = None) -> bytes:
        """Send (possibly rewritten) request bytes to the runtime, same metadata and deadline.

        The call itself goes under the client's spelling of its method: the runtime routes it
        (or refuses a spelling it does not route) as it would have without the shim.
        """
        return await self.upstream.unary(method or self.sent_as or self.method, request, metadata=self.metadata,
                                         timeout=self.context.time_remaining())

    def forward_stream(self, request: bytes) -> AsyncIterator[bytes]:
        return self.upstream.server_stream(self.sent_as or self.method, request, metadata=self.metadata,
                                           timeout=self.context.time_remaining())


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


UnaryHandler = Callable[[bytes, Call], Awaitable[bytes]]
StreamHandler = Callable[[bytes, Call], AsyncIterator[bytes]]
Handler = Union[UnaryHandler, StreamHandler]
CallObserver = Callable[[str, float, grpc.StatusCode], None]


def forward_metadata(context: grpc.aio.ServicerContext) -> Metadata:
    md = context.invocation_metadata() or ()
    return tuple((k, v) for k, v in md if k not in _HOP_HEADERS)


async def _fail(context: grpc.aio.ServicerContext, e: RpcError) -> None:
    await context.abort(e.code, e.details, e.trailing_metadata)


def _refuse(refusal: Refusal) -> Callable[[Any, Any], AsyncIterator[bytes]]:
    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        await context.abort(refusal.code, refusal.message)
        yield b""  # never reached: makes this an async generator, as stream_stream handlers are

    return refuse


class Proxy(grpc.GenericRpcHandler):
    """Serves every method: intercepted ones via ``table``, the rest byte for byte."""

    def __init__(self, upstream: Upstream, table: Mapping[str, Handler] | None = None,
                 on_call: CallObserver | None = None, tracing: Tracing | None = None,
                 allowed_services: tuple[str, ...] = ()) -> None:
        self.upstream = upstream
        self.router: Router[Handler] = Router(table, allowed_services)
        self._cache: dict[str, grpc.RpcMethodHandler] = {}
        self._on_call = on_call
        self.tracing = tracing if tracing is not None and tracing.enabled else None

    @property
    def table(self) -> Mapping[str, Handler]:
        return self.router.table

    def set_table(self, table: Mapping[str, Handler]) -> None:
        self.router.set_table(table)
        self._cache.clear()

    def set_allowed_services(self, entries: tuple[str, ...]) -> None:
        self.router.set_allowed_services(entries)
        self._cache.clear()

    # grpc.GenericRpcHandler
    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method: str = details.method  # type: ignore[attr-defined]
        h = self._cache.get(method)
        if h is None:
            h = self._build(method)
            if cardinality(method) is not None:  # don't let unknown names grow the cache
                self._cache[method] = h
        return h

    def _build(self, method: str) -> grpc.RpcMethodHandler:
        route = self.router.route(method)
        if isinstance(route, Refusal):
            return grpc.stream_stream_rpc_method_handler(_refuse(route))
        card = cardinality(method)
        if isinstance(route, Intercept):
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

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
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

        async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
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
        mc = self.upstream.channel.stream_unary(method)

        async def client_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
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
        mc = self.upstream.channel.stream_stream(method)

        async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
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

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
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
                code = grpc.StatusCode.CANCELLED
                raise
            finally:
                tracing.end(span, code, details)

        return unary

    def _traced_passthrough_server_stream(self, method: str) -> Callable[[bytes, Any], AsyncIterator[bytes]]:
        plain = self._passthrough_server_stream(method)
        mc = self.upstream.stream_callable(method)
        tracing = self.tracing
        assert tracing is not None

        async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
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
                code = grpc.StatusCode.CANCELLED
                raise
            finally:
                call.cancel()
                tracing.end(span, code, details)

        return server_stream

    # ------------------------------------------------------------------ interception

    @contextlib.contextmanager
    def observe(self, call: Call) -> Iterator[Call]:
        """Around one intercepted call, in either engine: its SERVER span (``call.span``, and
        ``call.metadata`` rewritten to carry it upstream) and its rpc duration, by final code."""
        started = time.perf_counter()
        tracing = self.tracing
        if tracing is not None:
            call.span, call.metadata = tracing.server_span(call.method, call.metadata)
        code, details = grpc.StatusCode.OK, None
        try:
            yield call
        except RpcError as e:
            code, details = e.code, e.details
            raise
        except (asyncio.CancelledError, GeneratorExit):
            remaining = call.context.time_remaining()
            expired = remaining is not None and remaining <= 0.001
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            code, details = grpc.StatusCode.INTERNAL, "internal error"
            raise
        finally:
            if self._on_call is not None:
                self._on_call(call.method, time.perf_counter() - started, code)
            if tracing is not None:
                tracing.end(call.span, code, details)

    def _call(self, method: str, context: grpc.aio.ServicerContext, sent_as: str) -> Call:
        return Call(method, forward_metadata(context), context.time_remaining(), context, self.upstream,
                    sent_as=sent_as)

    def _intercepted_unary(self, method: str, handler: Handler,
                           sent_as: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        h: UnaryHandler = handler  # type: ignore[assignment]

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                with self.observe(self._call(method, context, sent_as)) as call:
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
        h: StreamHandler = handler  # type: ignore[assignment]

        async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            try:
                with self.observe(self._call(method, context, sent_as)) as call:
                    async for msg in h(request, call):
                        yield msg
            except RpcError as e:
                await _fail(context, e)

        return server_stream
