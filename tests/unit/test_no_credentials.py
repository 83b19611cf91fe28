"""No credential a client sends with a pull (AuthConfig password, auth, identity and
registry tokens) shows up in a log line at debug level, a span, a metric or the status."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import grpc
import pytest

from shim.observability import logs
from shim.proto.runtime.v1 import api_pb2
from shim.process.status_render import print_status
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim
from tests.support.otlp_collector import OtlpCollector
from tests.support.prom import free_port, scrape

PULL = "/runtime.v1.ImageService/PullImage"
SECRETS = {
    "password": "pw-7f3a9c1e-hunter2",
    "auth": "dXNlcjpwdy03ZjNhOWMxZS1odW50ZXIy",  # base64 of user:password
    "identity_token": "idtok-0d5b2e8a4c",
    "registry_token": "regtok-91c4f7d2b6",
}
TRACEPARENT = "00-" + "5" * 32 + "-" + "6" * 16 + "-01"


def pull_request(image: str) -> bytes:
    auth = api_pb2.AuthConfig(username="robot", server_address="registry.example:5000", **SECRETS)
    return api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image), auth=auth).SerializeToString()


@pytest.fixture
def captured_logs():
    """Every record the shim and the OpenTelemetry SDK log, rendered in both formats, at debug."""
    lines: list[str] = []
    formatters = (logs.KeyValueFormatter(), logs.JsonFormatter())

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.extend(f.format(record) for f in formatters)

    handler = Keep()
    saved = []
    for name in ("cri_shim", "opentelemetry"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield lines
    for logger, level in saved:
        logger.removeHandler(handler)
        logger.setLevel(level)


def leaks(text: str | bytes) -> list[str]:
    if isinstance(text, bytes):
        return [k for k, v in SECRETS.items() if v.encode() in text]
    return [k for k, v in SECRETS.items() if v in text]


async def test_credentials_appear_nowhere(engine: str, tmp_path, short_tmp, monkeypatch, captured_logs) -> None:
    collector = await OtlpCollector().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    runtime = await FakeRuntime(socket_in(str(tmp_path))).start()
    gate = asyncio.Event()

    async def pull(request: bytes, context) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        await gate.wait()
        if image.startswith("denied"):
            await context.abort(grpc.StatusCode.UNKNOWN, f"pulling {image}: 401 Unauthorized")
        return api_pb2.PullImageResponse(image_ref="sha256:" + "4" * 64).SerializeToString()

    runtime.unary[PULL] = pull
    address = f"127.0.0.1:{free_port()}"
    admin = str(short_tmp / "admin.sock")
    settings = {"pulls": {"max_parallel": 1}, "metrics": {"address": address},
                "server": {"admin_socket": admin}}
    status_out: list[str] = []
    try:
        async with running_shim(runtime.endpoint, settings, engine=engine) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                call = ch.unary_unary(PULL)
                md = (("traceparent", TRACEPARENT),)
                held = [asyncio.ensure_future(call(pull_request("private/app:1"), metadata=md, timeout=10))
                        for _ in range(2)]  # the second collapses into the first
                while not runtime.calls("PullImage"):
                    await asyncio.sleep(0.01)
                denied = asyncio.ensure_future(call(pull_request("denied/app:1"), metadata=md, timeout=10))
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # no slot before its deadline
                    await call(pull_request("private/other:1"), metadata=md, timeout=0.2)
                assert refused.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                while shim.app.scheduler.queued != 1:
                    await asyncio.sleep(0.01)
                for as_json in (True, False):
                    out = io.StringIO()
                    assert await asyncio.to_thread(print_status, admin, as_json, out) == 0
                    status_out.append(out.getvalue())
                gate.set()
                await asyncio.gather(*held)
                with pytest.raises(grpc.aio.AioRpcError):
                    await denied
            metrics = (await scrape(address)).text
    finally:
        await runtime.stop()
        await collector.stop()

    # The runtime got the credentials: the test exercised the real thing.
    assert all(not set(SECRETS) - set(leaks(r.request)) for r in runtime.calls("PullImage"))
    assert "private/app:1" in json.dumps(json.loads(status_out[0])) and "private/app:1" in status_out[1]
    assert any("pull collapsed" in ln for ln in captured_logs)
    assert any("pull refused" in ln for ln in captured_logs)
    assert any(s.attributes.get("cri_shim.image") == "denied/app:1" for s in collector.spans)

    assert [ln for ln in captured_logs if leaks(ln)] == []
    assert [s.name for s in collector.spans if leaks(repr(s))] == []
    assert [i for i, raw in enumerate(collector.raw) if leaks(raw)] == []
    assert leaks(metrics) == []
    assert [s for s in status_out if leaks(s)] == []


async def test_image_set_credentials_from_config_json_appear_nowhere(engine: str, tmp_path, monkeypatch,
                                                                     captured_logs) -> None:
    import base64

    collector = await OtlpCollector().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    runtime = await FakeRuntime(socket_in(str(tmp_path))).start()
    present: list[api_pb2.Image] = []

    async def pull(request: bytes, context) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        if image.startswith("denied"):
            await context.abort(grpc.StatusCode.UNKNOWN, f"pulling {image}: 401 Unauthorized")
        present.append(api_pb2.Image(id="sha256:" + "5" * 64, repo_tags=[image]))
        return api_pb2.PullImageResponse(image_ref="sha256:" + "5" * 64).SerializeToString()

    async def list_images(request: bytes, context) -> bytes:
        return api_pb2.ListImagesResponse(images=present).SerializeToString()

    runtime.unary[PULL] = pull
    runtime.unary["/runtime.v1.ImageService/ListImages"] = list_images
    creds = tmp_path / "config.json"
    creds.write_text(json.dumps({"auths": {
        "registry.example:5000": {"auth": base64.b64encode(f"robot:{SECRETS['password']}".encode()).decode()},
        "denied.example": {"username": "robot", "password": SECRETS["password"],
                           "identitytoken": SECRETS["identity_token"]}}}))
    sets = tmp_path / "sets"
    sets.mkdir()
    (sets / "a.yaml").write_text("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: private}\n"
                                 "spec:\n  images:\n  - name: registry.example:5000/app:1\n"
                                 "  - name: denied.example/app:1\n")
    address = f"127.0.0.1:{free_port()}"
    admin = str(tmp_path / "admin.sock")
    settings = {"metrics": {"address": address}, "server": {"admin_socket": admin},
                "image_sets": {"dir": str(sets), "docker_config": [str(creds)], "retry_initial_seconds": 0.05,
                               "retry_max_seconds": 0.1, "debounce_seconds": 0.05}}
    status_out: list[str] = []
    try:
        async with running_shim(runtime.endpoint, settings, engine=engine) as shim:
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while not (len(runtime.calls("PullImage")) >= 3
                       and shim.app.image_sets_status()["sets"]["private"]["present"] == 1):
                assert loop.time() < end, "prefetch did not run"
                await asyncio.sleep(0.02)
            for as_json in (True, False):
                out = io.StringIO()
                assert await asyncio.to_thread(print_status, admin, as_json, out) == 0
                status_out.append(out.getvalue())
            metrics = (await scrape(address)).text
    finally:
        await runtime.stop()
        await collector.stop()

    sent = [api_pb2.PullImageRequest.FromString(r.request) for r in runtime.calls("PullImage")]
    assert {(r.image.image, r.auth.password) for r in sent} >= {("registry.example:5000/app:1", SECRETS["password"]),
                                                                ("denied.example/app:1", SECRETS["password"])}
    assert "401 Unauthorized" in status_out[0] and "registry.example:5000" in status_out[0]
    assert [ln for ln in captured_logs if leaks(ln)] == []
    assert [s.name for s in collector.spans if leaks(repr(s))] == []
    assert [i for i, raw in enumerate(collector.raw) if leaks(raw)] == []
    assert leaks(metrics) == []
    assert [s for s in status_out if leaks(s)] == []
    encoded = base64.b64encode(f"robot:{SECRETS['password']}".encode()).decode()
    assert not any(encoded in ln for ln in captured_logs) and not any(encoded in s for s in status_out)
