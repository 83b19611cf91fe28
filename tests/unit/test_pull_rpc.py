"""PullImage through the shim (both engines) against a scripted runtime: collapse,
credentials, cap, deadlines, errors and bad input, as a CRI client sees them."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim
from tests.support.wait import wait_for

PULL = "/runtime.v1.ImageService/PullImage"


def pull_request(image: str, user: str = "", password: str = "", uid: str = "", ns: str = "") -> bytes:
    req = api_pb2.PullImageRequest()
    req.image.image = image
    if user:
        req.auth.username, req.auth.password = user, password
    if uid:
        req.sandbox_config.metadata.uid = uid
        req.sandbox_config.metadata.namespace = ns
    return req.SerializeToString()


class SlowPulls:
    """A runtime whose pulls take until released; counts concurrency."""

    def __init__(self) -> None:
        self.active = 0
        self.max_active = 0
        self.release = asyncio.Event()

    async def __call__(self, request: bytes, context) -> bytes:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self.release.wait()
        finally:
            self.active -= 1
        image = api_pb2.PullImageRequest.FromString(request).image.image
        return api_pb2.PullImageResponse(image_ref=f"sha256:{abs(hash(image)):064d}"[:71]).SerializeToString()


def waiters(shim) -> list[int]:
    """Callers waiting on each upstream pull in flight, fewest first."""
    return sorted(row["waiters"] for row in shim.app.scheduler.snapshot()["in_flight"])


async def test_identical_pulls_collapse_and_credentials_split(runtime: FakeRuntime, engine: str) -> None:
    slow = SlowPulls()
    runtime.unary[PULL] = slow
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            calls = [pull(pull_request("reg/app:1"), timeout=10) for _ in range(10)]
            calls += [pull(pull_request("reg/app:1", "alice", "s3cret"), timeout=10) for _ in range(2)]
            tasks = [asyncio.ensure_future(c) for c in calls]
            # every caller has joined one of two pulls, and both have reached the runtime
            await wait_for(lambda: waiters(shim) == [2, 10] and len(runtime.calls("PullImage")) == 2)
            slow.release.set()
            responses = await asyncio.gather(*tasks)
    assert len(runtime.calls("PullImage")) == 2  # one per credential group
    assert len({r for r in responses}) == 1
    assert api_pb2.PullImageResponse.FromString(responses[0]).image_ref.startswith("sha256:")


async def test_cap_limits_concurrent_upstream_pulls(runtime: FakeRuntime, engine: str) -> None:
    slow = SlowPulls()
    runtime.unary[PULL] = slow
    async with running_shim(runtime.endpoint, {"pulls": {"max_parallel": 2}}, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            tasks = [asyncio.ensure_future(pull(pull_request(f"reg/app{i}:1"), timeout=10)) for i in range(6)]
            await wait_for(lambda: slow.active == 2 and shim.app.scheduler.queued == 4)  # all six arrived
            assert shim.app.scheduler.in_flight == 2
            slow.release.set()
            await asyncio.gather(*tasks)
    assert slow.max_active == 2 and len(runtime.calls("PullImage")) == 6


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
async def test_the_callers_uid_decides_its_share_of_the_slots(runtime: FakeRuntime, engine: str,
                                                              trusted: bool) -> None:
    """The relay reads the caller's uid (SO_PEERCRED): outside server.trusted_uids its pulls get
    pulls.untrusted_share of the slots (1 of 2). The grpc engine cannot read it: trusted there."""
    slow = SlowPulls()
    runtime.unary[PULL] = slow
    uid = os.getuid()
    settings = {"pulls": {"max_parallel": 2}, "server": {"trusted_uids": [uid] if trusted else [uid + 1]}}
    async with running_shim(runtime.endpoint, settings, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            tasks = [asyncio.ensure_future(pull(pull_request(f"reg/app{i}:1"), timeout=10)) for i in range(3)]
            await wait_for(lambda: shim.app.scheduler.queued + shim.app.scheduler.in_flight == 3)
            await asyncio.sleep(0.05)
            running = shim.app.scheduler.running.describe()
            gauge = shim.app.metrics.registry.get_sample_value
            as_trusted = trusted or engine == "grpc"
            if as_trusted:
                assert (slow.active, running["trusted"], running["untrusted"]) == (2, 2, 0)
                assert gauge("cri_shim_pulls_running", {"class": "trusted"}) == 2
                assert gauge("cri_shim_pull_requests_total", {"priority": "foreground"}) == 3
            else:
                assert (slow.active, running["untrusted"], running["untrusted_by_uid"]) == (1, 1, {str(uid): 1})
                assert gauge("cri_shim_pulls_running", {"class": "untrusted"}) == 1
                assert gauge("cri_shim_pull_requests_total", {"priority": "untrusted"}) == 3
                assert [r["uid"] for r in shim.app.scheduler.snapshot()["queued"]] == [uid, uid]
            slow.release.set()
            await asyncio.gather(*tasks)


async def test_deadline_while_queued_is_deadline_exceeded(runtime: FakeRuntime, engine: str) -> None:
    slow = SlowPulls()
    runtime.unary[PULL] = slow
    async with running_shim(runtime.endpoint, {"pulls": {"max_parallel": 1}}, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            first = asyncio.ensure_future(pull(pull_request("reg/a:1"), timeout=10))
            await wait_for(lambda: slow.active == 1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pull(pull_request("reg/b:1"), timeout=0.3)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_for(lambda: shim.app.scheduler.queued == 0)  # the queued pull left with its caller
            slow.release.set()
            await first
    assert [api_pb2.PullImageRequest.FromString(r.request).image.image for r in runtime.calls("PullImage")] == ["reg/a:1"]


async def test_runtime_error_reaches_every_waiter_unchanged(runtime: FakeRuntime, engine: str) -> None:
    gate = asyncio.Event()

    async def failing(request: bytes, context) -> bytes:
        await gate.wait()
        await context.abort(grpc.StatusCode.NOT_FOUND, "failed to resolve reference: not found",
                            (("grpc-status-details-bin", b"\x08\x05"),))
        return b""
    runtime.unary[PULL] = failing
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            tasks = [asyncio.ensure_future(pull(pull_request("reg/missing:1"), timeout=10)) for _ in range(3)]
            # all three wait on the one pull, which has reached the runtime
            await wait_for(lambda: waiters(shim) == [3] and len(runtime.calls("PullImage")) == 1)
            gate.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        assert isinstance(r, grpc.aio.AioRpcError)
        assert r.code() is grpc.StatusCode.NOT_FOUND
        assert r.details() == "failed to resolve reference: not found"
        assert dict(r.trailing_metadata())["grpc-status-details-bin"] == b"\x08\x05"
    assert len(runtime.calls("PullImage")) == 1


async def test_cancelled_callers_cancel_the_upstream_pull(runtime: FakeRuntime, engine: str) -> None:
    cancelled = asyncio.Event()

    async def hang(request: bytes, context) -> bytes:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return b""
    runtime.unary[PULL] = hang
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            calls = [pull(pull_request("reg/a:1"), timeout=10) for _ in range(2)]
            await wait_for(lambda: len(runtime.calls("PullImage")) == 1 and waiters(shim) == [2])
            for c in calls:
                c.cancel()
            await asyncio.wait_for(cancelled.wait(), 5)
            await wait_for(lambda: shim.app.scheduler.in_flight == 0)


async def test_malformed_request_is_invalid_argument(runtime: FakeRuntime, engine: str) -> None:
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(PULL)(b"\x0a\xff\xff\xff", timeout=5)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "PullImageRequest" in e.value.details()
            # the shim is still serving
            runtime.unary["/runtime.v1.RuntimeService/Version"] = b"ok"
            assert await ch.unary_unary("/runtime.v1.RuntimeService/Version")(b"", timeout=5) == b"ok"
    assert runtime.calls("PullImage") == []


async def test_request_bytes_reach_runtime_unchanged(runtime: FakeRuntime, engine: str) -> None:
    runtime.unary[PULL] = b"\x0a\x07sha256:x"
    raw = pull_request("reg/a:1", uid="u1", ns="ns1") + b"\xfa\x3e\x03odd"  # a field we don't know (1000)
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            md = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
            assert await ch.unary_unary(PULL)(raw, timeout=5, metadata=md) == b"\x0a\x07sha256:x"
    got = runtime.calls("PullImage")[0]
    assert got.request == raw
    assert got.metadata["traceparent"] == md[0][1]


async def test_pulls_collapse_only_when_spelled_alike_and_each_request_is_sent_as_spelled(runtime: FakeRuntime,
                                                                                          engine: str) -> None:
    """One image, four requests (spelled alike up to the implied :latest): four runtime pulls, each
    as one of its callers spelled it (the runtimes do not pull the normal form: containerd keeps
    the host's case, CRI-O resolves a short name through its search registries)."""
    slow = SlowPulls()
    runtime.unary[PULL] = slow
    requests = [("nginx", "nginx:latest"), ("docker.io/library/nginx", "docker.io/library/nginx:latest"),
                ("Docker.IO/library/nginx:latest",), ("index.docker.io/nginx",)]
    spellings = [s for group in requests for s in group]
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            tasks = [asyncio.ensure_future(pull(pull_request(s), timeout=10)) for s in spellings * 2]
            tasks.append(asyncio.ensure_future(pull(pull_request("nginx:1.27"), timeout=10)))  # another image
            await wait_for(lambda: shim.app.metrics.registry.get_sample_value(
                "cri_shim_pull_dedup_joins_total") == len(spellings) * 2 - len(requests))
            slow.release.set()  # (pulls.max_parallel 4: one of the five waits for a slot until now)
            await asyncio.gather(*tasks)
    sent = [api_pb2.PullImageRequest.FromString(c.request).image.image for c in runtime.calls("PullImage")]
    assert len(sent) == len(requests) + 1 and "nginx:1.27" in sent
    for group in requests:  # each request once, as one of its callers spelled it
        assert sum(s in group for s in sent) == 1


_SPEC = api_pb2.ImageSpec(image="nginx").SerializeToString()
_GOOD = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="nginx")).SerializeToString()


@pytest.mark.parametrize("raw, says", [
    (b"\x0a" + bytes([len(_SPEC) + 2]) + _SPEC + b"\x1b\x1c", "wire type 3 (group)"),  # a group in ImageSpec
    (_GOOD + b"\x2b\x2c", "wire type 3 (group)"),  # a group at the top level
    (_GOOD + b"\x18\x05", "field 3 (sandbox_config) has wire type 0"),
    (_GOOD + b"\x15\x00\x00\x00\x00", "field 2 (auth) has wire type 5"),
    (b"\x0a\x02\x08\x01", "field image.image (1) has wire type 0"),
], ids=["group-in-imagespec", "group-top-level", "sandbox-config-varint", "auth-fixed32", "image-varint"])
@pytest.mark.parametrize("rules", [False, True], ids=["no-rules", "handler-rule"])
async def test_parseable_but_malformed_request_is_invalid_argument(runtime: FakeRuntime, engine: str, raw: bytes,
                                                                    says: str, rules: bool) -> None:
    cfg = {"runtime_handlers": {"rules": [{"handler": "kata"}]}} if rules else {}
    runtime.unary[PULL] = b"\x0a\x07sha256:x"
    async with running_shim(runtime.endpoint, cfg, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(PULL)(raw, timeout=5)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("cri-shim: malformed PullImageRequest: ") and says in e.value.details()
    assert runtime.calls("PullImage") == []


def pod_pull(image: str, namespace: str, name: str, annotations: dict[str, str] | None = None) -> bytes:
    req = api_pb2.PullImageRequest()
    req.image.image = image
    req.sandbox_config.metadata.name, req.sandbox_config.metadata.namespace = name, namespace
    req.sandbox_config.metadata.uid = f"uid-{name}"
    req.sandbox_config.annotations.update(annotations or {})
    return req.SerializeToString()


async def test_a_static_pods_pull_queued_last_reaches_the_runtime_first(runtime: FakeRuntime, engine: str) -> None:
    """kubelet's sandbox config says which pod pulls: with the default pulls.priority_rules a static
    pod (kubernetes.io/config.source: file) is system-node-critical and its queued pull starts first."""
    slow = SlowPulls()
    runtime.unary[PULL] = slow
    async with running_shim(runtime.endpoint, {"pulls": {"max_parallel": 1}}, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            tasks = [asyncio.ensure_future(pull(pod_pull("reg/app0:1", "default", "app0"), timeout=10))]
            await wait_for(lambda: slow.active == 1)
            for i in (1, 2, 3):
                tasks.append(asyncio.ensure_future(pull(pod_pull(f"reg/app{i}:1", "default", f"app{i}"), timeout=10)))
                await wait_for(lambda: shim.app.scheduler.queued == i)
            tasks.append(asyncio.ensure_future(pull(pod_pull("reg/cni:1", "kube-system", "cni-node1",
                                                             {"kubernetes.io/config.source": "file"}), timeout=10)))
            await wait_for(lambda: shim.app.scheduler.queued == 4)
            queued = {r["image"]: r["pod_priority"] for r in shim.app.scheduler.snapshot()["queued"]}
            assert queued == {"docker.io/reg/app1:1": 0, "docker.io/reg/app2:1": 0, "docker.io/reg/app3:1": 0,
                              "docker.io/reg/cni:1": 2000001000}
            slow.release.set()
            await asyncio.gather(*tasks)
    order = [api_pb2.PullImageRequest.FromString(c.request).image.image for c in runtime.calls("PullImage")]
    assert order == ["reg/app0:1", "reg/cni:1", "reg/app1:1", "reg/app2:1", "reg/app3:1"]
