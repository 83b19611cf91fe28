"""The shim as a process (``python -m shim serve``) with OTEL_* set, against the fake
runtime: spans reach an OTLP receiver in the caller's trace, the runtime sees that trace,
`cri-shim status` and /metrics answer, logs are JSON lines, and no credential leaks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import grpc
import yaml

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.otlp_collector import OtlpCollector, ReceivedSpan
from tests.support.prom import free_port, scrape
from tests.support.shim import socket_accepts

ROOT = Path(__file__).resolve().parents[2]
PULL = "/runtime.v1.ImageService/PullImage"
TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
SECRET = "s3cr3t-registry-password-5521"


async def cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "shim", *args, cwd=ROOT, env=env,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 30)
    return p.returncode, out.decode(), err.decode()


async def test_shim_process_traces_reports_and_keeps_secrets(tmp_path, short_tmp) -> None:
    runtime = await FakeRuntime(socket_in(str(tmp_path))).start()
    runtime.unary[PULL] = api_pb2.PullImageResponse(image_ref="sha256:" + "9" * 64).SerializeToString()
    collector = await OtlpCollector().start()
    d = str(short_tmp)
    listen, admin, metrics = os.path.join(d, "shim.sock"), os.path.join(d, "admin.sock"), f"127.0.0.1:{free_port()}"
    config = os.path.join(d, "config.yaml")
    Path(config).write_text(yaml.safe_dump({"server": {"admin_socket": admin}, "metrics": {"address": metrics}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(PYTHONPATH=str(ROOT), OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
               OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_SERVICE_NAME="cri-shim-node-a", OTEL_BSP_SCHEDULE_DELAY="50")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shim", "serve", "--listen", f"unix://{listen}", "--upstream", runtime.endpoint,
        "--config", config, "--log-level", "debug", "--log-format", "json",
        cwd=ROOT, env=env, stderr=asyncio.subprocess.PIPE)
    try:
        for _ in range(200):
            if socket_accepts(listen):
                break
            assert proc.returncode is None, "shim exited early"
            await asyncio.sleep(0.05)
        # Once the CRI socket accepts, metrics and status answer too.
        assert (await scrape(metrics)).value("cri_shim_pulls_in_flight") == 0
        code, _, err_out = await cli("status", "--admin-socket", admin, "--json", env=env)
        assert code == 0, err_out
        auth = api_pb2.AuthConfig(username="robot", password=SECRET)
        request = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="registry.example/app:7"),
                                           auth=auth).SerializeToString()
        async with grpc.aio.insecure_channel(f"unix://{listen}") as ch:
            await ch.unary_unary(PULL)(request, metadata=(("traceparent", f"00-{TRACE}-{PARENT}-01"),), timeout=10)
        spans = await collector.wait_for("runtime.v1.ImageService/PullImage", 2)
        code, status_json, _ = await cli("status", "--admin-socket", admin, "--json", env=env)
        assert code == 0
        code, status_text, _ = await cli("status", "--admin-socket", admin, env=env)
        assert code == 0
        scraped = await scrape(metrics)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        await runtime.stop()
        await collector.stop()
    assert proc.returncode == 0

    server = next(s for s in spans if s.kind == ReceivedSpan.KIND_SERVER)
    assert (server.trace_id, server.parent_span_id) == (TRACE, PARENT)
    assert server.resource["service.name"] == "cri-shim-node-a"
    assert server.attributes["cri_shim.image"] == "registry.example/app:7"
    got = runtime.calls("PullImage")[0]
    assert got.metadata["traceparent"].split("-")[1] == TRACE
    assert SECRET.encode() in got.request

    doc = json.loads(status_json)
    assert doc["upstream"]["state"] == "ready" and doc["tracing"]["exporter"] == "otlp"
    assert "upstream" in status_text and "ready" in status_text
    assert scraped.value("cri_shim_pulls_total", result="success") == 1

    ours = [ln for ln in err.decode().splitlines() if ln.startswith("{")]  # grpc-core and asyncio may add their own lines
    lines = [json.loads(ln) for ln in ours]
    assert any(ln["msg"] == "tracing on" and ln["protocol"] == "grpc" for ln in lines)
    assert any(ln["msg"] == "pull done" and ln["image"] == "registry.example/app:7" for ln in lines)
    for text in (err.decode(), status_json, status_text, scraped.text, *(repr(s) for s in collector.spans)):
        assert SECRET not in text
