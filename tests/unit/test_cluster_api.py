"""The cluster source against the API server as it really behaves, with an in-process fake of it
(tests/support/fake_kube.py): the shared backoff and /readyz probe after an outage, 429 +
Retry-After, MCO looked up by discovery instead of re-listed, pull Secrets watched by name.
No timing is asserted: a reader that should resume at once is given a backoff far longer than
the test's deadline."""

from __future__ import annotations

import asyncio
import base64
import json
from email.utils import format_datetime
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
import yaml
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from shim import config
from shim.cluster import objects
from shim.cluster.discovery import mco_kinds
from shim.cluster.informer import Informer
from shim.cluster.reachability import Reachability, retry_after, unreachable
from shim.cluster.secrets import PullSecrets
from shim.cluster.source import ClusterSource
from shim.observability.metrics import Metrics
from tests.support.fake_kube import FakeKube
from tests.unit.test_cluster_source import FakeSets, node, pis, pool
from tests.support.wait import wait_for

NODES = "/api/v1/nodes"
MCO = "machineconfiguration.openshift.io"
PIS_V1 = f"/apis/{MCO}/v1/pinnedimagesets"
MCP_V1 = f"/apis/{MCO}/v1/machineconfigpools"
DEADLINE = 10.0  # a hung wait fails the test with a stack instead of hanging


@pytest.fixture
async def kube() -> Any:
    api = await FakeKube().start()
    yield api
    await api.stop()


def never() -> Reachability:
    return Reachability(None, probe_interval=1.0, request_timeout=5.0)


# ------------------------------------------------------------------ the backoff and its shared end

def test_retry_after_seconds_date_capped_or_absent() -> None:
    def e429(value: str | None, status: int = 429) -> ApiException:
        e = ApiException(status=status, reason="Too Many Requests")
        e.headers = {} if value is None else {"Retry-After": value}
        return e
    assert retry_after(e429("1"), 60) == 1.0
    assert retry_after(e429("3600"), 60) == 60  # bounded
    assert retry_after(e429("0"), 60) == retry_after(e429("-5"), 60) == 0.1  # never a busy loop
    when = format_datetime(datetime.fromtimestamp(1_000_030, tz=timezone.utc), usegmt=True)
    assert retry_after(e429(when), 60, now=lambda: 1_000_000.0) == pytest.approx(30.0)
    assert retry_after(e429(None), 60) is None  # a 429 without it is a failure like any other
    assert retry_after(e429("soon"), 60) is None
    assert retry_after(e429("1", status=503), 60) is None
    assert retry_after(ConnectionRefusedError(), 60) is None


def test_unreachable_is_no_answer_from_the_server_itself() -> None:
    assert unreachable(ConnectionRefusedError())
    assert unreachable(asyncio.TimeoutError())
    assert unreachable(ApiException(status=503))  # a load balancer without a backend
    assert not unreachable(ApiException(status=500))
    assert not unreachable(ApiException(status=403))


async def test_first_success_after_a_failure_ends_every_wait() -> None:
    reach = never()
    reach.failed("a", ApiException(status=500))
    reach.failed("b", ApiException(status=500))
    waiting = asyncio.ensure_future(reach.wait(3600))
    await asyncio.sleep(0)
    reach.succeeded("c")  # a reader that never failed: its routine successes wake nobody
    await asyncio.sleep(0.05)
    assert not waiting.done()
    reach.succeeded("b")
    assert await asyncio.wait_for(waiting, DEADLINE) is True
    assert reach.status()["failing"] == ["a"]


async def test_probe_runs_only_while_unreachable_and_its_200_wakes_every_reader() -> None:
    answers = [False, False, True]
    calls = 0

    async def probe() -> bool:
        nonlocal calls
        calls += 1
        return answers.pop(0)

    reach = Reachability(probe, probe_interval=0.01, request_timeout=5.0)
    reach.failed("a", ApiException(status=500))  # the server answered: no probe
    await asyncio.sleep(0.1)
    assert calls == 0
    reach.failed("b", ConnectionRefusedError())
    woken = await asyncio.wait_for(reach.wait(3600), DEADLINE)
    assert woken and calls == 3 and reach.status()["unreachable"] == []
    await asyncio.sleep(0.1)
    assert calls == 3  # stopped once the server answered
    await reach.stop()


# ------------------------------------------------------------------ one informer

def informer(api: Any, reach: Reachability, changes: list[int], **kw: Any) -> Informer:
    return Informer(api, "nodes", CoreV1Api(api).list_node, on_change=lambda: changes.append(1), reach=reach,
                    kind=("v1", "Node"), watch_timeout=30, request_timeout=5, **kw)


async def test_429_with_retry_after_waited_out_not_a_failure(kube: FakeKube) -> None:
    kube.put(NODES, node({"a": "1"}))
    kube.fail(NODES, 429, times=3, headers={"Retry-After": "0"})
    reach, changes = never(), []
    # a failure would back off at least 1000 s (initial / 10): only the 429 path can list in time
    inf = informer(kube.client(), reach, changes, backoff_initial=10_000, backoff_max=10_000)
    task = asyncio.ensure_future(inf.run())
    try:
        await wait_for(lambda: inf.synced, what="listed after three 429s")
        assert (inf.throttled, inf.failures, inf.error) == (3, 0, "")
        assert reach.status()["failing"] == []
        assert inf.items["n1"]["kind"] == "Node"
        await wait_for(lambda: kube.count(NODES, watch=True) == 1, what="watching")
        kube.put(NODES, node({"a": "2"}))
        await wait_for(lambda: inf.items["n1"]["metadata"]["labels"] == {"a": "2"}, what="the watch event applied")
        assert kube.count(NODES, watch=False) == 4  # three 429s and one list: no re-list
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_after_an_outage_every_watch_resumes_when_readyz_answers(kube: FakeKube) -> None:
    """Two informers backed off for far longer than the test lasts; the API server comes back
    (first not ready, then ready): the probe's 200 resumes both watches, without re-listing."""
    kube.put(NODES, node({}))
    kube.put("/apis/cri-shim.io/v1/imagesets", {"metadata": {"name": "s"}, "spec": {}})
    api = kube.client()
    reach = Reachability(partial(_readyz, api), probe_interval=0.02, request_timeout=5)
    changes: list[int] = []
    infs = [informer(api, reach, changes, backoff_initial=10_000, backoff_max=10_000),
            Informer(api, "imagesets", partial(_custom_list, api, "imagesets"), on_change=lambda: None,
                     reach=reach, backoff_initial=10_000, backoff_max=10_000, request_timeout=5)]
    tasks = [asyncio.ensure_future(i.run()) for i in infs]
    try:
        await wait_for(lambda: kube.count(NODES, watch=True) == 1 and kube.count(
            "/apis/cri-shim.io/v1/imagesets", watch=True) == 1, what="both watching")
        await kube.down()
        await wait_for(lambda: all(i.failures for i in infs), what="both failed")
        kube.ready = False
        await kube.up()
        await wait_for(lambda: kube.count("/readyz") >= 2, what="probed while not ready")
        assert all(i.failures for i in infs)  # readyz 500: still waiting
        kube.ready = True
        await wait_for(lambda: all(not i.error for i in infs), what="both watching again")
        assert kube.count(NODES, watch=False) == 1  # resumed from its resourceVersion: no re-list
        kube.put(NODES, node({"back": "yes"}))
        await wait_for(lambda: infs[0].items["n1"]["metadata"].get("labels") == {"back": "yes"}, what="event after the outage")
        probes = kube.count("/readyz")
        await asyncio.sleep(0.2)
        assert kube.count("/readyz") == probes  # nothing unreachable: no more probes
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await reach.stop()


async def _readyz(api: Any) -> bool:
    from shim.cluster.reachability import readyz
    return await readyz(api, 5)


def _custom_list(api: Any, plural: str, **kw: Any) -> Awaitable[Any]:
    from kubernetes_asyncio.client import CustomObjectsApi
    return CustomObjectsApi(api).list_cluster_custom_object("cri-shim.io", "v1", plural, **kw)


async def test_410_during_a_watch_lists_once_more(kube: FakeKube) -> None:
    kube.put(NODES, node({}))
    reach, changes = never(), []
    inf = informer(kube.client(), reach, changes)
    task = asyncio.ensure_future(inf.run())
    try:
        await wait_for(lambda: kube.count(NODES, watch=True) == 1, what="watching")
        kube.watch_event(NODES, {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                             "message": "too old resource version"}})
        await wait_for(lambda: kube.count(NODES, watch=False) == 2 and kube.count(NODES, watch=True) == 2,
                       what="listed again, then watching")
        assert inf.failures == 0 and inf.lists == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# ------------------------------------------------------------------ MCO through discovery

def group(*versions: str) -> dict[str, Any]:
    return {"kind": "APIGroup", "name": MCO, "versions": [{"groupVersion": f"{MCO}/{v}", "version": v}
                                                          for v in versions]}


def resources(*plurals: str) -> dict[str, Any]:
    return {"kind": "APIResourceList", "resources": [{"name": p} for p in plurals]}


async def test_discovery_finds_the_served_version(kube: FakeKube) -> None:
    api = kube.client()
    assert await mco_kinds(api, 5) is None  # no group: one 404
    assert kube.requests == [(f"/apis/{MCO}", False)]
    kube.discovery[f"/apis/{MCO}"] = group("v1")
    kube.discovery[f"/apis/{MCO}/v1"] = resources("machineconfigpools", "machineconfigs")
    assert await mco_kinds(api, 5) is None  # OpenShift before 4.16: pools, no PinnedImageSet
    kube.discovery[f"/apis/{MCO}"] = group("v1", "v1alpha1")
    kube.discovery[f"/apis/{MCO}/v1alpha1"] = resources("pinnedimagesets")
    assert await mco_kinds(api, 5) == (objects.PINNED_IMAGE_SETS[1], objects.MACHINE_CONFIG_POOL)
    kube.discovery[f"/apis/{MCO}/v1"] = resources("machineconfigpools", "pinnedimagesets")
    assert await mco_kinds(api, 5) == (objects.PINNED_IMAGE_SETS[0], objects.MACHINE_CONFIG_POOL)
    kube.fail(f"/apis/{MCO}", 500)
    with pytest.raises(ApiException):  # not an answer: the caller retries
        await mco_kinds(api, 5)


def kubeconfig(kube: FakeKube, path: Path) -> str:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "t",
           "clusters": [{"name": "t", "cluster": {"server": kube.url}}],
           "users": [{"name": "u", "user": {"token": "t"}}],
           "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}]}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


async def test_without_mco_one_discovery_request_per_interval_and_no_list(kube: FakeKube, tmp_path: Path) -> None:
    """cluster.mco: true on a cluster without MCO: discovery is asked once per interval, MCO's
    resources are never listed; when the group appears its sets apply; when it goes away the
    watches stop and the PinnedImageSets applied last stay in force."""
    kube.put(NODES, node({"role": "worker"}))
    kube.collections["/apis/cri-shim.io/v1/imagesets"] = {}
    cfg = config.ClusterConfig(kubeconfig=kubeconfig(kube, tmp_path / "kc"), node_name="n1", mco=True,
                               state_file=str(tmp_path / "state.json"), mco_discovery_seconds=1.0)
    sets = FakeSets()
    src = ClusterSource(cfg, sets, Metrics())  # type: ignore[arg-type]
    await src.start()
    try:
        await wait_for(lambda: src.mco_checks >= 2, what="asked twice (start, one interval later)")
        assert kube.count(f"/apis/{MCO}") == src.mco_checks
        assert not any(p.startswith(f"/apis/{MCO}/") for p, _ in kube.requests)  # never listed
        assert src.status()["mco"] == {"served": False, "discovery_answers": src.mco_checks}

        kube.put(PIS_V1, pis("w", ["reg/w:1"]))
        kube.put(MCP_V1, pool("worker", {"matchLabels": {"role": "worker"}}, ["w"]))
        kube.discovery[f"/apis/{MCO}"] = group("v1")
        kube.discovery[f"/apis/{MCO}/v1"] = resources("machineconfigpools", "pinnedimagesets")
        await wait_for(lambda: "w" in sets.sources.get("cluster", {}), what="the PinnedImageSet applied once served")
        checks = src.mco_checks
        await asyncio.sleep(1.5)
        assert src.mco_checks == checks  # served and watched without error: discovery not asked again

        del kube.discovery[f"/apis/{MCO}"]
        kube.fail(PIS_V1, 404, times=1000)  # the CRD is gone: the watch fails, discovery is asked again
        kube.end_watches(PIS_V1)
        await wait_for(lambda: src.status()["mco"]["served"] is False, what="noticed the group went away")
        await wait_for(lambda: "pinnedimagesets" not in src.informers, what="its watches stopped")
        assert "w" in sets.sources["cluster"]  # losing a resource never unpins
    finally:
        await src.stop()


# ------------------------------------------------------------------ pull Secrets

SECRETS = "/api/v1/namespaces/ns/secrets"


def secret(name: str, host: str, password: str) -> dict[str, Any]:
    auth = base64.b64encode(f"u:{password}".encode()).decode()
    cfg = json.dumps({"auths": {host: {"auth": auth}}})
    return {"metadata": {"name": name, "namespace": "ns"}, "type": objects.DOCKER_CONFIG_JSON,
            "data": {".dockerconfigjson": base64.b64encode(cfg.encode()).decode()}}


async def test_secret_watched_by_name_rotation_applies_without_a_get(kube: FakeKube) -> None:
    kube.put(SECRETS, secret("pull", "reg.example", "one"))
    kube.put(SECRETS, secret("other", "reg.example", "not-ours"))
    api = kube.client()
    core, reach = CoreV1Api(api), never()
    changed: list[int] = []

    def watcher(ref: objects.SecretRef, on_change: Callable[[], None]) -> Informer:
        return Informer(api, f"secret {ref.name}", partial(core.list_namespaced_secret, ref.namespace),
                        on_change=on_change, reach=reach, field_selector=f"metadata.name={ref.name}",
                        give_up_on=frozenset({403}))

    ps = PullSecrets(core, refresh_seconds=300, request_timeout=5, watcher=watcher,
                     on_change=lambda: changed.append(1))
    ref = objects.SecretRef("ns", "pull")
    ps.by_set = {"s": (ref,)}
    ps.sync()
    try:
        await wait_for(lambda: ps.for_sets(frozenset({"s"})), what="entries from the watched Secret")
        assert [c.password for _, c in ps.for_sets(frozenset({"s"}))] == ["one"]
        assert ps.due() == []  # watched: nothing to GET
        kube.put(SECRETS, secret("pull", "reg.example", "two"))
        await wait_for(lambda: [c.password for _, c in ps.for_sets(frozenset({"s"}))] == ["two"], what="rotated")
        assert changed and ps.status() == {"ns/pull": "ok"}
        assert not any("/secrets/" in p for p, _ in kube.requests)  # never read by GET
        tasks = list(ps.watches().values())
        ps.by_set = {}
        ps.sync()
        assert ps.for_sets(frozenset({"s"})) == [] and ps.entries == {}
        await wait_for(lambda: all(t.done() for t in tasks), what="the watch ended with the last set naming it")
    finally:
        await ps.stop()


async def test_secret_watch_forbidden_falls_back_to_get(kube: FakeKube) -> None:
    kube.put(SECRETS, secret("pull", "reg.example", "one"))
    kube.fail(SECRETS, 403)
    api = kube.client()
    core, reach = CoreV1Api(api), never()
    ps = PullSecrets(core, refresh_seconds=300, request_timeout=5, watcher=lambda ref, cb: Informer(
        api, "s", partial(core.list_namespaced_secret, ref.namespace), on_change=cb, reach=reach,
        field_selector=f"metadata.name={ref.name}", give_up_on=frozenset({403})))
    ref = objects.SecretRef("ns", "pull")
    ps.by_set = {"s": (ref,)}
    ps.sync()
    try:
        # handed over to GET, and read at once (not at the next refresh tick, up to a minute later)
        await wait_for(lambda: ps.for_sets(frozenset({"s"})) != [], what="the refused watch's Secret read by GET at once")
        assert kube.count(SECRETS) == 1 and kube.count(f"{SECRETS}/pull") == 1  # list refused, not retried; one GET
        assert ps.due() == []  # the next GET after refresh_seconds
    finally:
        await ps.stop()


async def test_a_reader_failing_while_readyz_answers_keeps_its_backoff(kube: FakeKube, monkeypatch) -> None:
    """The API server answers /readyz but this reader's own request keeps failing as if nothing
    answered (a 504: a LIST longer than the server's request timeout; or the client's own
    timeout). The probe's 200 must not end its wait again and again: that would retry every
    probe interval (a fleet hammering an overloaded server with LISTs) instead of backing off
    to cluster.backoff_max_seconds."""
    import shim.cluster.informer as informer_module
    monkeypatch.setattr(informer_module, "backoff", lambda n, initial, maximum: min(maximum, initial * 2 ** (n - 1)))
    kube.put(NODES, node({}))
    kube.fail(NODES, 504, times=1000)
    api = kube.client()
    reach = Reachability(partial(_readyz, api), probe_interval=0.02, request_timeout=5)
    inf = informer(api, reach, [], backoff_initial=0.1, backoff_max=60)
    task = asyncio.ensure_future(inf.run())
    try:
        await asyncio.sleep(1.6)
        # backing off: at about 0, 0.1, 0.3, 0.7, 1.5 s (and the retry right after the first probe)
        assert kube.count(NODES) <= 7, f"{kube.count(NODES)} LISTs in 1.6 s"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await reach.stop()
