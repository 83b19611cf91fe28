"""Tracing against a real OTLP receiver: the shim's spans land in the caller's trace, and
the runtime is handed a traceparent of that same trace."""

from __future__ import annotations

import asyncio
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from shim.observability import logs
from shim.proto.runtime.v1 import api_pb2
from shim.observability import tracing as shim_tracing
from shim.observability.tracing import Tracing, redact_url
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim
from tests.support.otlp_collector import OtlpCollector, ReceivedSpan

PULL = "/runtime.v1.ImageService/PullImage"
VERSION = "/runtime.v1.RuntimeService/Version"
PULL_SPAN = "runtime.v1.ImageService/PullImage"
KUBELET_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
KUBELET_SPAN = "00f067aa0ba902b7"


def traceparent(trace_id: str = KUBELET_TRACE, span_id: str = KUBELET_SPAN, flags: str = "01") -> str:
    return f"00-{trace_id}-{span_id}-{flags}"


def parse_traceparent(v: str) -> tuple[str, str, str]:
    version, trace_id, span_id, flags = v.split("-")
    assert version == "00"
    return trace_id, span_id, flags


def pull_request(image: str) -> bytes:
    return api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)).SerializeToString()


def pulled(ref: str = "sha256:" + "1" * 64) -> bytes:
    return api_pb2.PullImageResponse(image_ref=ref).SerializeToString()


@pytest.fixture
def runtime(runtime: FakeRuntime) -> FakeRuntime:
    """the runtime fixture (tests/support/fake_fixtures.py), answering PullImage."""
    runtime.unary[PULL] = pulled()
    return runtime


@pytest.fixture
async def collector(monkeypatch):
    col = await OtlpCollector().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", col.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "cri-shim-test")
    yield col
    await col.stop()


def by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.span_id: s for s in spans}


async def test_pull_span_joins_kubelet_trace_and_runtime_gets_it(engine: str,
                                                                 runtime: FakeRuntime, collector: OtlpCollector):
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            md = (("traceparent", traceparent()), ("tracestate", "k8s=1"), ("baggage", "pod=web-0"))
            resp = await ch.unary_unary(PULL)(pull_request("nginx:1.27"), metadata=md, timeout=5)
    assert api_pb2.PullImageResponse.FromString(resp).image_ref.startswith("sha256:")

    server = [s for s in collector.named(PULL_SPAN) if s.kind == ReceivedSpan.KIND_SERVER]
    client = [s for s in collector.named(PULL_SPAN) if s.kind == ReceivedSpan.KIND_CLIENT]
    assert len(server) == 1 and len(client) == 1
    srv, cli = server[0], client[0]
    # Our server span continues kubelet's trace; the call to the runtime is its child.
    assert (srv.trace_id, srv.parent_span_id) == (KUBELET_TRACE, KUBELET_SPAN)
    assert (cli.trace_id, cli.parent_span_id) == (KUBELET_TRACE, srv.span_id)
    assert srv.resource["service.name"] == "cri-shim-test"
    assert srv.attributes["cri_shim.image"] == "nginx:1.27"
    assert srv.attributes["cri_shim.runtime_handler.source"] == "none"
    assert srv.attributes["cri_shim.pull.joined"] is False
    assert srv.attributes["cri_shim.pull.result"] == "OK"
    assert 0 <= srv.attributes["cri_shim.pull.queued_seconds"] < 1
    assert srv.attributes["rpc.grpc.status_code"] == 0
    assert "pull slot acquired" in srv.events

    # The runtime was handed the same trace, with the shim's upstream call as parent;
    # tracestate and baggage went through as kubelet sent them.
    got = runtime.calls("PullImage")[0].metadata
    trace_id, parent, flags = parse_traceparent(got["traceparent"])
    assert (trace_id, parent, flags) == (KUBELET_TRACE, cli.span_id, "01")
    assert got["tracestate"] == "k8s=1"
    assert got["baggage"] == "pod=web-0"


async def test_queued_and_collapsed_pulls_show_in_their_spans(engine: str,
                                                              runtime: FakeRuntime, collector: OtlpCollector):
    gate = asyncio.Event()

    async def slow(request: bytes, context) -> bytes:
        await gate.wait()
        return pulled()

    runtime.unary[PULL] = slow
    async with running_shim(runtime.endpoint, {"pulls": {"max_parallel": 1}}, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            first = asyncio.ensure_future(pull(pull_request("busy:1"), timeout=10,
                                               metadata=(("traceparent", traceparent("1" * 32)),)))
            while not runtime.calls("PullImage"):
                await asyncio.sleep(0.01)
            # Two pods want the same image while the only slot is busy: one pull, queued.
            waiting = [asyncio.ensure_future(pull(pull_request("app:2"), timeout=10,
                                                  metadata=(("traceparent", traceparent(t * 32)),)))
                       for t in ("2", "3")]
            while shim.app.scheduler.queued != 1 or shim.app.scheduler.snapshot()["queued"][0]["waiters"] != 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            gate.set()
            await asyncio.gather(first, *waiting)

    spans = [s for s in collector.named(PULL_SPAN) if s.kind == ReceivedSpan.KIND_SERVER
             and s.attributes["cri_shim.image"] == "app:2"]
    assert sorted(s.trace_id for s in spans) == ["2" * 32, "3" * 32]
    leader = next(s for s in spans if not s.attributes["cri_shim.pull.joined"])
    joiner = next(s for s in spans if s.attributes["cri_shim.pull.joined"])
    assert leader.attributes["cri_shim.pull.queued_seconds"] >= 0.3
    assert joiner.attributes["cri_shim.pull.queued_seconds"] >= 0.3
    assert "pull slot acquired" in leader.events and "pull slot acquired" not in joiner.events
    # Exactly one upstream pull for app:2, in the leader's trace, started after the wait.
    app_calls = [r for r in runtime.calls("PullImage") if b"app:2" in r.request]
    assert len(app_calls) == 1
    assert parse_traceparent(app_calls[0].metadata["traceparent"])[0] == leader.trace_id
    upstream = next(s for s in collector.named(PULL_SPAN)
                    if s.kind == ReceivedSpan.KIND_CLIENT and s.parent_span_id == leader.span_id)
    assert (upstream.start_ns - leader.start_ns) / 1e9 >= 0.3


async def test_failed_pull_is_an_error_span(engine: str, runtime: FakeRuntime, collector: OtlpCollector):
    runtime.unary[PULL] = (grpc.StatusCode.UNKNOWN, "failed to resolve reference: not found")
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await ch.unary_unary(PULL)(pull_request("nope:1"), metadata=(("traceparent", traceparent()),),
                                           timeout=5)
    srv = next(s for s in collector.named(PULL_SPAN) if s.kind == ReceivedSpan.KIND_SERVER)
    assert srv.attributes["cri_shim.pull.result"] == "UNKNOWN"
    assert srv.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNKNOWN.value[0]
    assert srv.status_code == 2 and "failed to resolve reference" in srv.status_message  # STATUS_CODE_ERROR


async def test_pull_without_caller_trace_starts_one_and_hands_it_on(engine: str,
                                                                    runtime: FakeRuntime, collector: OtlpCollector):
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await ch.unary_unary(PULL)(pull_request("nginx:1.27"), timeout=5)
    srv = next(s for s in collector.named(PULL_SPAN) if s.kind == ReceivedSpan.KIND_SERVER)
    assert srv.parent_span_id == ""
    assert parse_traceparent(runtime.calls("PullImage")[0].metadata["traceparent"])[0] == srv.trace_id


async def test_unsampled_caller_gets_no_spans_but_context_still_flows(engine: str, runtime: FakeRuntime,
                                                                       collector: OtlpCollector):
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await ch.unary_unary(PULL)(pull_request("nginx:1.27"), timeout=5,
                                       metadata=(("traceparent", traceparent(flags="00")),))
    assert collector.spans == []
    trace_id, _, flags = parse_traceparent(runtime.calls("PullImage")[0].metadata["traceparent"])
    assert (trace_id, flags) == (KUBELET_TRACE, "00")


async def test_passthrough_continues_caller_trace(engine: str, runtime: FakeRuntime, collector: OtlpCollector):
    """grpc engine: a sampled passthrough call gets a span in the caller's trace. Relay
    engine: frames pass byte for byte, so the runtime gets the caller's traceparent as it
    was sent (same trace, the caller's span as parent) and the shim records no span."""
    runtime.unary[VERSION] = b"\x0a\x020.1"
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            version = ch.unary_unary(VERSION)
            assert await version(b"", metadata=(("traceparent", traceparent()),), timeout=5) == b"\x0a\x020.1"
            assert await version(b"", timeout=5) == b"\x0a\x020.1"  # kubelet with tracing off
    spans = collector.named("runtime.v1.RuntimeService/Version")
    traced, untraced = runtime.calls("Version")
    assert "traceparent" not in untraced.metadata  # the shim never starts a trace on passthrough
    if engine == "relay":
        assert spans == []
        assert traced.metadata["traceparent"] == traceparent()
        return
    assert len(spans) == 1
    assert (spans[0].trace_id, spans[0].parent_span_id) == (KUBELET_TRACE, KUBELET_SPAN)
    assert parse_traceparent(traced.metadata["traceparent"])[:2] == (KUBELET_TRACE, spans[0].span_id)


async def test_passthrough_span_of_a_call_past_its_deadline_says_so(runtime: FakeRuntime, collector: OtlpCollector):
    """grpc engine: a traced passthrough call whose client deadline runs out while the runtime
    is still working ends its span with DEADLINE_EXCEEDED, not CANCELLED."""
    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(30)
        return b""
    runtime.unary[VERSION] = slow
    async with running_shim(runtime.endpoint, engine="grpc") as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(VERSION)(b"", metadata=(("traceparent", traceparent()),), timeout=0.5)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    [span] = collector.named("runtime.v1.RuntimeService/Version")
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert span.status_message.startswith("DEADLINE_EXCEEDED")


async def test_passthrough_from_unsampled_caller_is_forwarded_as_sent(engine: str, runtime: FakeRuntime,
                                                                      collector: OtlpCollector):
    runtime.unary[VERSION] = b"\x0a\x020.1"
    md = (("traceparent", traceparent(flags="00")), ("tracestate", "k8s=1"))
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await ch.unary_unary(VERSION)(b"", metadata=md, timeout=5)
    assert collector.spans == []
    got = runtime.calls("Version")[0].metadata
    assert (got["traceparent"], got["tracestate"]) == (md[0][1], md[1][1])


async def test_tracing_off_forwards_trace_headers_unchanged(engine: str, runtime: FakeRuntime, monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(var, raising=False)
    md = (("traceparent", traceparent()), ("tracestate", "k8s=1"), ("baggage", "pod=web-0"))
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        assert not shim.app.tracing.enabled
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await ch.unary_unary(PULL)(pull_request("nginx:1.27"), metadata=md, timeout=5)
            await ch.unary_unary(VERSION)(b"", metadata=md, timeout=5)
    for got in (runtime.calls("PullImage")[0].metadata, runtime.calls("Version")[0].metadata):
        assert {k: got[k] for k in ("traceparent", "tracestate", "baggage")} == dict(md)


# --------------------------------------------------------------------------- OTLP over HTTP


class _HttpReceiver(BaseHTTPRequestHandler):
    bodies: list[bytes]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append((self.path, self.headers.get("Content-Type"), body))  # type: ignore[attr-defined]
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


async def test_otlp_http_protobuf(engine: str, runtime: FakeRuntime, monkeypatch):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _HttpReceiver)
    httpd.bodies = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{httpd.server_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        async with running_shim(runtime.endpoint, engine=engine) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                await ch.unary_unary(PULL)(pull_request("nginx:1.27"), timeout=5,
                                           metadata=(("traceparent", traceparent()),))
    finally:
        httpd.shutdown()
        httpd.server_close()
    spans = []
    for path, ctype, body in httpd.bodies:  # type: ignore[attr-defined]
        assert (path, ctype) == ("/v1/traces", "application/x-protobuf")
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        spans += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    server = [s for s in spans if s.name == PULL_SPAN and s.kind == s.SPAN_KIND_SERVER]
    assert len(server) == 1
    assert (server[0].trace_id.hex(), server[0].parent_span_id.hex()) == (KUBELET_TRACE, KUBELET_SPAN)


# --------------------------------------------------------------------------- configuration


@pytest.fixture
def log_lines():
    """Lines the shim logs while the test runs (text format, debug)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(logs.KeyValueFormatter().format(record))

    root = logging.getLogger("cri_shim")
    handler, level = Keep(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield lines
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.mark.parametrize("env", [
    {},
    {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"},  # no destination: still off
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"},
])
def test_tracing_stays_off_without_a_destination(env, log_lines):
    assert not Tracing.from_env(env).enabled
    assert log_lines == []


def test_tracing_on_names_its_destination_without_credentials(log_lines):
    t = Tracing.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://bob:s3cret@otel.example:4317/?token=abc",
                          "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cret"})
    try:
        assert t.enabled
        assert t.description == {"exporter": "otlp", "protocol": "grpc", "endpoint": "https://otel.example:4317/"}
        assert len(log_lines) == 1 and "tracing on" in log_lines[0]
        assert "s3cret" not in log_lines[0] and "abc" not in log_lines[0]
    finally:
        t.shutdown()


def test_bad_protocol_leaves_tracing_off_and_says_which_variable(log_lines):
    t = Tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                          "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})
    assert not t.enabled
    assert len(log_lines) == 1
    assert "level=error" in log_lines[0] and "OTEL_EXPORTER_OTLP_PROTOCOL" in log_lines[0]


def test_redact_url():
    assert redact_url("http://u:p@h:1/v1/traces?x=y#z") == "http://h:1/v1/traces"


class _StuckCollector(OtlpCollector):
    async def Export(self, request, context):
        await asyncio.sleep(3600)


async def test_a_stuck_collector_does_not_hold_up_shutdown(runtime: FakeRuntime, monkeypatch, log_lines):
    stuck = await _StuckCollector().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", stuck.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # everything is left for the shutdown export
    loop = asyncio.get_running_loop()
    try:
        async with running_shim(runtime.endpoint) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                await ch.unary_unary(PULL)(pull_request("nginx:1.27"), timeout=5,
                                           metadata=(("traceparent", traceparent()),))
            started = loop.time()
        took = loop.time() - started
    finally:
        await stuck.stop()
    assert took < shim_tracing.SHUTDOWN_EXPORT_SECONDS + 1.5
    assert any("the last spans were not exported in time" in ln for ln in log_lines)
