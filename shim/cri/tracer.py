"""What the call model needs of tracing: a SERVER span per intercepted call, CLIENT spans
around the calls a handler makes upstream, and the trace context carried in the metadata.

observability/tracing.py implements it (process/app.py builds it from the OTEL_* environment);
with tracing off, ``NO_TRACING`` does nothing and every span is ``NOOP_SPAN``.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Protocol

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span as Span

from ..errors import Metadata

NOOP_SPAN: Span = trace.INVALID_SPAN  # what handlers see when there is no span (tracing off)


class Tracer(Protocol):
    @property
    def enabled(self) -> bool:
        """Whether spans are made at all (off: nothing here runs on any call path)."""

    def wants_passthrough_span(self, metadata: Metadata) -> bool:
        """Whether a passthrough call with this metadata gets a span."""

    def server_span(self, method: str, metadata: Metadata) -> tuple[Span, Metadata]:
        """The SERVER span of an incoming call, and the metadata to forward (naming the span)."""

    def end(self, span: Span, code: grpc.StatusCode, details: str | None = None, *, server: bool = True) -> None:
        """Record the call's status and end the span."""

    def client_span(self, method: str, parent: Span, metadata: Metadata) -> ContextManager[Metadata]:
        """A CLIENT span around a call to the runtime on behalf of ``parent``; yields the metadata to send."""


class _NoTracing:
    enabled = False

    def wants_passthrough_span(self, metadata: Metadata) -> bool:
        return False

    def server_span(self, method: str, metadata: Metadata) -> tuple[Span, Metadata]:
        return NOOP_SPAN, metadata

    def end(self, span: Span, code: grpc.StatusCode, details: str | None = None, *, server: bool = True) -> None:
        pass

    @contextlib.contextmanager
    def client_span(self, method: str, parent: Span, metadata: Metadata) -> Iterator[Metadata]:
        yield metadata


NO_TRACING: Tracer = _NoTracing()
