"""An in-process OTLP/gRPC trace receiver: the collector's TraceService.Export, from the
``opentelemetry-proto`` package's generated stubs, keeping every span it is sent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # hex, as in traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    attributes: dict[str, Any]
    events: list[str]
    status_code: int
    status_message: str
    resource: dict[str, Any]
    start_ns: int
    end_ns: int

    KIND_SERVER = trace_pb2.Span.SPAN_KIND_SERVER
    KIND_CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    spans: list[ReceivedSpan] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)  # every Export request as received
    headers: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    server: grpc.aio.Server | None = None
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "OtlpCollector":
        self.server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
                     context: grpc.aio.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        self.raw.append(request.SerializeToString())
        self.headers.append(dict(context.invocation_metadata() or ()))
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(ReceivedSpan(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind, attributes=_attrs(s.attributes),
                        events=[e.name for e in s.events], status_code=s.status.code,
                        status_message=s.status.message, resource=resource,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano))
        self._arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name == name]

    async def wait_for(self, name: str, count: int = 1, timeout: float = 10.0) -> list[ReceivedSpan]:
        """Wait until ``count`` spans called ``name`` have arrived."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.named(name)) < count:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"{len(self.named(name))} of {count} {name} spans after {timeout}s; "
                                   f"got {[s.name for s in self.spans]}")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(left, 0.2))
            except asyncio.TimeoutError:
                pass
        return self.named(name)
