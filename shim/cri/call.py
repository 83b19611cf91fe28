"""The call model both engines share: one intercepted call, its deadline, its handler, its observation.

An engine (the relay, shim/relay/; or grpc.aio, shim/grpc_engine/) routes a ``:path`` once
(shim/cri/routing.py), and for a method the shim answers builds a :class:`Call` and runs the
handler inside :meth:`Observation.observe`. A handler knows nothing of the engine:

- unary: ``async def handler(request: bytes, call: Call) -> bytes``
- server-streaming: ``def handler(request: bytes, call: Call) -> AsyncIterator[bytes]``

Failures are raised as :class:`shim.errors.RpcError`; the engine answers them with that status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterator

import grpc

from ..errors import Metadata, RpcError
from .deadline import Deadline, ended
from .peer import Peer
from .tracer import NOOP_SPAN, Span, Tracer
from .upstream import Upstream

# Request headers that belong to the hop, not to the call: never forwarded as the call's metadata.
HOP_HEADERS = frozenset({"user-agent", "te", "content-type", "grpc-timeout", "grpc-encoding",
                         "grpc-accept-encoding", ":authority", "host"})

@dataclass(slots=True)
class Call:
    """What an interception handler gets besides the request bytes."""

    method: str  # canonical: ``/runtime.v1.ImageService/PullImage``
    metadata: Metadata  # request metadata to forward upstream (traceparent etc.), hop headers removed
    deadline: Deadline
    upstream: Upstream
    span: Span = NOOP_SPAN  # this call's SERVER span (a no-op span when tracing is off)
    sent_as: str = ""  # :path as the client spelled it, if not ``method``
    started: float = field(default_factory=time.perf_counter)
    peer: Peer = field(kw_only=True)  # who called (cri/peer.py): its uid decides its share of the pull slots

    async def forward(self, request: bytes, method: str | None = None) -> bytes:
        """Send (possibly rewritten) request bytes to the runtime, same metadata and deadline.

        The call itself goes under the client's spelling of its method: the runtime routes it
        (or refuses a spelling it does not route) as it would have without the shim.
        """
        return await self.upstream.unary(method or self.sent_as or self.method, request, metadata=self.metadata,
                                         deadline=self.deadline)

    def forward_stream(self, request: bytes) -> AsyncIterator[bytes]:
        return self.upstream.server_stream(self.sent_as or self.method, request, metadata=self.metadata,
                                           deadline=self.deadline)


UnaryHandler = Callable[[bytes, Call], Awaitable[bytes]]
StreamHandler = Callable[[bytes, Call], AsyncIterator[bytes]]
Handler = UnaryHandler | StreamHandler
CallObserver = Callable[[str, float, grpc.StatusCode], None]  # method, seconds, final code


def forwardable(metadata: Metadata) -> Metadata:
    """The call's metadata: the request headers less the hop's."""
    return tuple((k, v) for k, v in metadata if k not in HOP_HEADERS)


class Observation:
    """Around one intercepted call, in either engine: its SERVER span (``call.span``, and
    ``call.metadata`` rewritten to carry it upstream) and its rpc duration, by final code."""

    def __init__(self, on_call: CallObserver | None = None, tracing: Tracer | None = None) -> None:
        self.on_call = on_call
        self.tracing = tracing if tracing is not None and tracing.enabled else None

    @contextlib.contextmanager
    def observe(self, call: Call) -> Iterator[Call]:
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
            code = ended(call.deadline)
            raise
        except BaseException:
            code, details = grpc.StatusCode.INTERNAL, "internal error"
            raise
        finally:
            if self.on_call is not None:
                self.on_call(call.method, time.perf_counter() - call.started, code)
            if tracing is not None:
                tracing.end(call.span, code, details)
