"""Observability end to end: the shim as a process (OTEL_* set) in front of real containerd
pulling from a real registry through the counting proxy.

- A pull storm (12 identical + 3 other pulls, max_parallel 2, blobs held at the registry):
  `cri-shim status` and /metrics show what is running, queued and waiting while it lasts;
  afterwards the figures match what the registry saw, and every caller's PullImage span
  is in its own trace with its own span as parent, collapsed ones marked joined.
- Pulls with registry credentials: they work (containerd got them), and the password is
  in no log line (debug), span, metric or status output.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from pathlib import Path

import pytest

from tests.support import cri
from tests.support.containerd import Containerd
from tests.support.fixtures import AUTH_PASSWORD, AUTH_USER
from tests.support.otlp_collector import OtlpCollector, ReceivedSpan
from tests.support.prom import free_port, scrape
from tests.support.proxy import CountingProxy
from tests.support.registry import RegistryWithProxy
from tests.support.wait import wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PULL_SPAN = "runtime.v1.ImageService/PullImage"
HOLD = 0.5  # seconds the registry holds blobs while the storm is looked at


def traceparent(i: int) -> tuple[str, str, str]:
    trace_id, span_id = f"{i + 1:032x}", f"{0xabc000 + i:016x}"
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


@pytest.fixture
async def collector():
    col = await OtlpCollector().start()
    yield col
    await col.stop()


def otel_env(collector: OtlpCollector) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_SERVICE_NAME": "cri-shim-e2e", "OTEL_BSP_SCHEDULE_DELAY": "50"}


async def status_cli(admin: str, *flags: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "shim", "status", "--admin-socket", admin, *flags,
                                             cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE,
                                             stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 30)
    assert p.returncode == 0, err.decode()
    return out.decode()


async def test_pull_storm_is_visible_in_status_metrics_and_traces(
        shim_factory, containerd: Containerd, make_image, proxy: CountingProxy, collector: OtlpCollector,
        short_tmp) -> None:
    hot = make_image(filler_bytes=20_000)
    others = [make_image(filler_bytes=20_000) for _ in range(3)]
    admin = str(short_tmp / "admin.sock")
    metrics = f"127.0.0.1:{free_port()}"
    shim = shim_factory({"pulls": {"max_parallel": 2}, "metrics": {"address": metrics},
                         "server": {"admin_socket": admin}}, env=otel_env(collector))

    async def pull(i: int, ref: str) -> cri.CallResult:
        return await cri.acall(str(shim.socket), "PullImage", cri.pull_image_request(ref), timeout=120,
                               metadata=[("traceparent", traceparent(i)[2])])

    proxy.hold_blobs()
    try:
        storm = [asyncio.ensure_future(pull(i, hot.ref)) for i in range(12)]

        async def hot_has_all_waiters() -> bool:
            doc = json.loads(await status_cli(admin, "--json"))
            return any(p["image"] == hot.ref and p["waiters"] == 12 for p in doc["pulls"]["in_flight"])
        await wait_for(hot_has_all_waiters, 30.0)
        rest = [asyncio.ensure_future(pull(12 + i, img.ref)) for i, img in enumerate(others)]

        async def two_queued() -> bool:
            return len(json.loads(await status_cli(admin, "--json"))["pulls"]["queued"]) == 2
        await wait_for(two_queued, 30.0)

        doc = json.loads(await status_cli(admin, "--json"))
        text = await status_cli(admin)
        during = await scrape(metrics)
        await asyncio.sleep(HOLD)
    finally:
        proxy.release_blobs()
    results = await asyncio.gather(*storm, *rest)
    after = await scrape(metrics)
    spans = await collector.wait_for(PULL_SPAN, 15 + 4)

    # What the caller and the runtime saw.
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    assert {cri.decode_pull_image_response(r.response) for r in results[:12]} == {hot.image_id}
    stats = proxy.stats()
    assert stats.blob_requests_for(hot.repository, hot.tag) == 2  # config + layer: one pull for 12 callers
    assert stats.max_concurrent_images <= 2

    # During the storm: status for a person and for a script, and the gauges.
    assert doc["upstream"]["state"] == "ready"
    running = {p["image"]: p for p in doc["pulls"]["in_flight"]}
    assert len(running) == 2 and running[hot.ref]["waiters"] == 12
    assert len(doc["pulls"]["queued"]) == 2 and all(p["waiters"] == 1 for p in doc["pulls"]["queued"])
    assert "2 running, 2 queued" in text and "12 waiting" in text and hot.ref in text
    assert during.value("cri_shim_pulls_in_flight") == 2
    assert during.value("cri_shim_pull_queue_length") == 2
    assert during.value("cri_shim_pull_dedup_joins_total") == 11

    # Afterwards: the figures are what happened.
    assert after.value("cri_shim_pulls_total", result="success") == 4
    assert after.value("cri_shim_pull_requests_total", priority="foreground") == 15
    assert after.value("cri_shim_pull_dedup_joins_total") == 11
    assert after.value("cri_shim_pulls_in_flight") == 0 and after.value("cri_shim_pull_queue_length") == 0
    wait = "cri_shim_pull_queue_wait_seconds"
    assert after.value(f"{wait}_count", priority="foreground") == 4
    assert after.bucket(wait, "0.25", priority="foreground") == 2  # two went at once, two waited
    assert after.value("cri_shim_rpc_duration_seconds_count", method="PullImage", code="OK") == 15

    # Traces: every caller's span in its own trace, child of the caller's span.
    server = [s for s in spans if s.kind == ReceivedSpan.KIND_SERVER]
    client = [s for s in spans if s.kind == ReceivedSpan.KIND_CLIENT]
    assert len(server) == 15 and len(client) == 4
    assert sorted((s.trace_id, s.parent_span_id) for s in server) == sorted(traceparent(i)[:2] for i in range(15))
    assert all(s.resource["service.name"] == "cri-shim-e2e" for s in server)
    hot_spans = [s for s in server if s.attributes["cri_shim.image"] == hot.ref]
    assert sorted(s.attributes["cri_shim.pull.joined"] for s in hot_spans) == [False] + [True] * 11
    leaders = [s for s in server if not s.attributes["cri_shim.pull.joined"]]
    assert sorted(s.span_id for s in leaders) == sorted(c.parent_span_id for c in client)
    waited = [s for s in leaders if s.attributes["cri_shim.pull.queued_seconds"] >= HOLD]
    assert len(waited) == 2 and all("pull slot acquired" in s.events for s in leaders)


async def test_registry_credentials_stay_out_of_logs_spans_metrics_and_status(
        shim_factory, containerd: Containerd, make_image, auth_registry: RegistryWithProxy,
        collector: OtlpCollector, short_tmp) -> None:
    img = make_image(registry=auth_registry, filler_bytes=20_000)
    admin = str(short_tmp / "admin.sock")
    metrics = f"127.0.0.1:{free_port()}"
    shim = shim_factory({"metrics": {"address": metrics}, "server": {"admin_socket": admin}},
                        env=otel_env(collector), log_level="debug")
    basic = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()
    secrets = [AUTH_PASSWORD, basic]
    md = [("traceparent", traceparent(0)[2])]

    auth_registry.proxy.hold_blobs()
    try:
        pulls = [asyncio.ensure_future(cri.acall(str(shim.socket), "PullImage", request, timeout=120, metadata=md))
                 for request in (cri.pull_image_request(img.ref, username=AUTH_USER, password=AUTH_PASSWORD),
                                 cri.pull_image_request(img.ref, auth=basic))]

        async def in_flight() -> bool:
            return bool(json.loads(await status_cli(admin, "--json"))["pulls"]["in_flight"])
        await wait_for(in_flight, 30.0)
        status_out = [await status_cli(admin, "--json"), await status_cli(admin)]
    finally:
        auth_registry.proxy.release_blobs()
    results = await asyncio.gather(*pulls)
    wrong = await cri.acall(str(shim.socket), "PullImage",
                            cri.pull_image_request(img.ref + "-nope", username=AUTH_USER, password=AUTH_PASSWORD),
                            timeout=60, metadata=md)
    metrics_text = (await scrape(metrics)).text
    await collector.wait_for(PULL_SPAN, 3)
    assert await asyncio.to_thread(shim.stop) == 0  # the collector runs on this loop: don't block it
    log = shim.log_text()

    assert all(r.ok for r in results), results  # the credentials reached containerd and worked
    assert not wrong.ok
    assert img.ref in status_out[0] and "pull done" in log
    for secret in secrets:
        assert secret not in log
        assert secret not in metrics_text
        assert all(secret not in s for s in status_out)
        assert all(secret.encode() not in raw for raw in collector.raw)
