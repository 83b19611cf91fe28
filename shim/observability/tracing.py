"""Tracing: OpenTelemetry spans that continue the caller's (kubelet's) trace.

Configured only by the standard OpenTelemetry environment, read once at start:

- off unless a trace destination is given: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
  ``OTEL_EXPORTER_OTLP_ENDPOINT``, or ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``;
  ``none`` = off). ``OTEL_SDK_DISABLED=true`` turns it off whatever else is set.
- ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``: ``grpc`` (default, like the Python SDK) or
  ``http/protobuf``. Endpoint, headers, certificates, timeout and compression are read by
  the OTLP exporters themselves; ``OTEL_BSP_*`` by the batch processor.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (service name ``cri-shim`` if
  neither names one), ``OTEL_TRACES_SAMPLER`` / ``_ARG`` (default ``parentbased_always_on``:
  follow kubelet's sampling decision).

A bad value logs one error and leaves tracing off: observability must never stop the
node's CRI path.

Context travels as W3C ``traceparent``/``tracestate`` in gRPC metadata. An intercepted
call gets a SERVER span, child of the incoming context; the metadata forwarded to the
runtime then carries that span as parent, so the runtime's spans join the same trace.
``baggage`` and all other metadata pass unchanged. When tracing is off nothing here runs
on any call path: ``Proxy`` only consults ``Tracing`` when ``enabled``; and the
OpenTelemetry SDK and exporters are not even imported (only the API, for its no-op span).

Span attributes are method names, image references, handlers, counts and codes, never
request metadata or credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Callable, Iterator, Mapping
from urllib.parse import urlsplit, urlunsplit

import grpc
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Span as Span
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..errors import Metadata, RpcError
from . import logs

if TYPE_CHECKING:  # the SDK and its exporters are imported only when tracing is on (from_env)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

_log = logs.get("tracing")

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
DEFAULT_SERVICE_NAME = "cri-shim"
SHUTDOWN_EXPORT_SECONDS = 3.0  # at exit, how long the last spans may take to export

# Status codes that make a *server* span an error (OpenTelemetry gRPC semantic conventions).
_SERVER_ERRORS = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
_PROTOCOLS = ("grpc", "http/protobuf")


class _MetadataGetter(Getter[Metadata]):
    """Reads W3C headers from gRPC metadata, a tuple of (key, value) pairs (keys lower case)."""

    def get(self, carrier: Metadata, key: str) -> list[str] | None:
        values = [v for k, v in carrier if k == key and isinstance(v, str)]
        return values or None

    def keys(self, carrier: Metadata) -> list[str]:
        return [k for k, _ in carrier]


_GETTER = _MetadataGetter()


def _sampled_flag(traceparent: str | bytes) -> bool | None:
    """The sampled flag of a version-00 traceparent; None if it is not one."""
    if not isinstance(traceparent, str) or len(traceparent) != 55 or not traceparent.startswith("00-"):
        return None
    try:
        return bool(int(traceparent[53:], 16) & 1)
    except ValueError:
        return None


Route = Callable[[str], "str | None"]  # a :path -> the method the runtime routes it to (cri.methods.canonical)


def _unrouted(path: str) -> str | None:
    return None


def span_name(method: str, route: Route) -> str:
    """``service/method`` as the runtime routes ``method``; the method as sent if it routes nowhere."""
    routed = route(method)
    return routed[1:] if routed is not None else method


def rpc_attributes(method: str, route: Route) -> dict[str, str]:
    """Service and method as the runtime routes ``method``."""
    service, _, name = span_name(method, route).rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def redact_url(url: str) -> str:
    """An endpoint fit for a log line: user info, query and fragment removed."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable>"
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class TracingConfigError(ValueError):
    """An OTEL_* variable has a value we cannot use; the message names the variable."""


class Tracing:
    """Spans for intercepted calls; all methods assume ``enabled`` unless noted. ``route`` names
    a span after the method the runtime routes a call to (process/app.py gives
    cri.methods.canonical); without it, after the method as sent."""

    def __init__(self, provider: TracerProvider | None = None, description: dict[str, str] | None = None, *,
                 route: Route = _unrouted) -> None:
        self.provider = provider
        self._route = route
        self.enabled = provider is not None
        self.description: dict[str, str] = dict(description or {})  # exporter, protocol, endpoint: logs, status
        self._tracer = provider.get_tracer("cri-shim", shim_version()) if provider is not None else None
        self._propagator = TraceContextTextMapPropagator()
        # The parentbased_* samplers (the default) record nothing under an unsampled parent.
        self._parent_decides = os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower() \
            .startswith("parentbased_")

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, route: Route = _unrouted) -> Tracing:
        """Build from OTEL_* variables (see module doc). Never raises: a bad value logs and gives ``off()``.

        The OpenTelemetry SDK reads some variables (sampler, exporter options) from
        ``os.environ`` itself; ``environ`` only decides whether and how to export.
        """
        env = os.environ if environ is None else environ
        try:
            exporters, description = _exporters_from_env(env)
        except TracingConfigError as e:
            logs.log(_log, logging.ERROR, "tracing off: bad OpenTelemetry setting", error=str(e))
            return cls.off()
        if not exporters:
            return cls.off()
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=_resource(), shutdown_on_exit=False)
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        tracing = cls(provider, description, route=route)
        logs.log(_log, logging.INFO, "tracing on", **description,
                 sampler=os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"))
        return tracing

    # ------------------------------------------------------------------ spans

    def wants_passthrough_span(self, metadata: Metadata) -> bool:
        """Whether a passthrough call gets a span: only when it continues the caller's trace
        and the sampler may record it. The shim never starts a trace for routine polling,
        and an unsampled caller's context goes upstream as it is (nothing would be recorded).
        """
        for k, v in metadata:
            if k == "traceparent":
                return not self._parent_decides or _sampled_flag(v) is not False
        return False

    def server_span(self, method: str, metadata: Metadata) -> tuple[Span, Metadata]:
        """Start the SERVER span of an incoming call, child of the context in ``metadata``.

        Returns the span and the metadata to forward upstream (traceparent pointing at the span).
        """
        assert self._tracer is not None
        parent = self._propagator.extract(metadata, getter=_GETTER)
        span = self._tracer.start_span(span_name(method, self._route), context=parent, kind=SpanKind.SERVER,
                                       attributes=rpc_attributes(method, self._route))
        return span, self.inject(span, metadata)

    def inject(self, span: Span, metadata: Metadata) -> Metadata:
        """``metadata`` with traceparent/tracestate naming ``span``; the rest unchanged, in order."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        if not carrier:
            return metadata
        return tuple(kv for kv in metadata if kv[0] not in TRACE_HEADERS) + tuple(carrier.items())

    @staticmethod
    def end(span: Span, code: grpc.StatusCode, details: str | None = None, *, server: bool = True) -> None:
        """Record the call's status and end the span."""
        if span.is_recording():
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.OK and (not server or code in _SERVER_ERRORS):
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
        span.end()

    @contextlib.contextmanager
    def client_span(self, method: str, parent: Span, metadata: Metadata) -> Iterator[Metadata]:
        """A CLIENT span around a call the shim makes to the runtime on behalf of ``parent``.

        Yields the metadata to send (traceparent naming the client span). Without a
        recording parent (tracing off, or not sampled) no span is made and ``metadata``
        is yielded as it is: it already carries the right context.
        """
        if self._tracer is None or not parent.is_recording():
            yield metadata
            return
        span = self._tracer.start_span(span_name(method, self._route), context=trace.set_span_in_context(parent),
                                       kind=SpanKind.CLIENT, attributes=rpc_attributes(method, self._route))
        code, details = grpc.StatusCode.OK, None
        try:
            yield self.inject(span, metadata)
        except RpcError as e:
            code, details = e.code, e.details
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            self.end(span, code, details, server=False)

    # ------------------------------------------------------------------ lifecycle

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        return self.provider.force_flush(timeout_millis) if self.provider is not None else True

    def shutdown(self) -> None:
        """Export what is left and stop the exporter threads (blocks: up to 30 s with a stuck collector)."""
        if self.provider is not None:
            self.provider.shutdown()

    async def aclose(self, timeout: float = SHUTDOWN_EXPORT_SECONDS) -> None:
        """``shutdown()`` without holding up the process for more than ``timeout`` seconds.

        It runs in a daemon thread: a collector that is away or stuck costs at most
        ``timeout``, and the thread does not keep the process alive after that.
        """
        if self.provider is None:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                self.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop may be gone already
                    loop.call_soon_threadsafe(finish)

        threading.Thread(target=run, name="otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            logs.log(_log, logging.WARNING, "tracing: the last spans were not exported in time",
                     timeout_seconds=timeout, **self.description)


# --------------------------------------------------------------------------- environment


def _exporters_from_env(env: Mapping[str, str]) -> tuple[list[SpanExporter], dict[str, str]]:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return [], {}
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""
    if "none" in names or (not names and not endpoint):
        return [], {}
    exporters: list[SpanExporter] = []
    description: dict[str, str] = {}
    for name in names or ["otlp"]:
        if name == "otlp":
            protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                        or "grpc").strip()
            if protocol not in _PROTOCOLS:
                var = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" if env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                       else "OTEL_EXPORTER_OTLP_PROTOCOL")
                raise TracingConfigError(f"{var}: must be one of {', '.join(_PROTOCOLS)}, got {logs.shown(protocol)}")
            exporters.append(_otlp_exporter(protocol))
            description.update(exporter="otlp", protocol=protocol,
                               endpoint=redact_url(endpoint) if endpoint else "(exporter default)")
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
            description.setdefault("exporter", "console")
        else:
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER: must be otlp, console or none, got {logs.shown(name)}")
    return exporters, description


def _otlp_exporter(protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter: Callable[[], SpanExporter] = GrpcExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter
    try:
        return exporter()
    except (ValueError, TypeError) as e:  # e.g. a malformed header or certificate setting
        raise TracingConfigError(f"OTLP {protocol} exporter: {e}") from None


def _resource() -> Resource:
    """OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win; otherwise service.name is cri-shim."""
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource

    r = Resource.create({SERVICE_VERSION: shim_version()})
    if str(r.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        r = r.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return r


def shim_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cri-shim")
    except PackageNotFoundError:
        return "0+unknown"
