"""Runtime handlers on image requests, judged by what a scripted runtime received:
rules (namespace, image, labels, annotations), learned from RunPodSandbox, found by
ListPodSandbox after a restart, an explicit handler kept, none invented, and every
other byte of the request as kubelet sent it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from shim import config as config_mod
from shim.cri import protowire as wire
from shim.config import ConfigError
from shim.runtime_handlers.inject import inject_image_handler
from shim.runtime_handlers.pods import PodCache
from shim.runtime_handlers.resolver import NEGATIVE_TTL_SECONDS
from shim.runtime_handlers.rules import compile_rules, reference_names
from shim.proto.runtime.v1 import api_pb2 as pb
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim

PULL = "/runtime.v1.ImageService/PullImage"
RUN = "/runtime.v1.RuntimeService/RunPodSandbox"
REMOVE = "/runtime.v1.RuntimeService/RemovePodSandbox"
LIST = "/runtime.v1.RuntimeService/ListPodSandbox"
TRACEPARENT = "00-" + "c" * 32 + "-" + "d" * 16 + "-01"


@pytest.fixture(params=["relay", "grpc"])
async def runtime(tmp_path, request):
    """The scripted runtime; each test runs through both passthrough engines."""
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    rt.engine = request.param  # type: ignore[attr-defined]
    rt.unary[PULL] = pb.PullImageResponse(image_ref="sha256:" + "a" * 64).SerializeToString()
    rt.unary[LIST] = b""
    yield rt
    await rt.stop()


def serve(rt: FakeRuntime, settings: dict | None = None):
    return running_shim(rt.endpoint, settings, engine=rt.engine)  # type: ignore[attr-defined]


def sandbox_config(uid: str = "", namespace: str = "default", labels: dict | None = None,
                   annotations: dict | None = None) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="p", uid=uid, namespace=namespace, attempt=0),
                               labels=labels or {}, annotations=annotations or {})


def pull_request(image: str, sc: pb.PodSandboxConfig | None = None, handler: str = "",
                 image_annotations: dict | None = None) -> bytes:
    req = pb.PullImageRequest(image=pb.ImageSpec(image=image, runtime_handler=handler,
                                                 annotations=image_annotations or {}))
    if sc is not None:
        req.sandbox_config.CopyFrom(sc)
    return req.SerializeToString()


def rules(*rs: dict, **more) -> dict:
    return {"runtime_handlers": {"rules": list(rs), **more}}


async def pull(shim, request: bytes, metadata=()) -> bytes:
    async with grpc.aio.insecure_channel(shim.endpoint) as ch:
        return await ch.unary_unary(PULL)(request, metadata=metadata, timeout=5)


def received_handlers(rt: FakeRuntime) -> list[str]:
    return [pb.PullImageRequest.FromString(r.request).image.runtime_handler for r in rt.calls("PullImage")]


# --------------------------------------------------------------------------- rules


async def test_rule_by_namespace(runtime: FakeRuntime) -> None:
    async with serve(runtime, rules({"handler": "gvisor", "namespaces": ["untrusted"]})) as shim:
        await pull(shim, pull_request("nginx:1", sandbox_config("u1", "untrusted")))
        await pull(shim, pull_request("nginx:2", sandbox_config("u2", "default")))
        await pull(shim, pull_request("nginx:3"))  # no pod at all: a namespace rule cannot match
    assert received_handlers(runtime) == ["gvisor", "", ""]


async def test_rule_by_image_on_the_normalized_reference(runtime: FakeRuntime) -> None:
    settings = rules({"handler": "nvidia", "images": ["registry.example.com/gpu/*"]},
                     {"handler": "kata", "images": ["busybox:*"]})  # = docker.io/library/busybox:*
    async with serve(runtime, settings) as shim:
        await pull(shim, pull_request("registry.example.com/gpu/cuda:12.4"))
        await pull(shim, pull_request("docker.io/library/busybox:1.36", sandbox_config("u1")))
        await pull(shim, pull_request("busybox:1.36"))
        await pull(shim, pull_request("registry.example.com/cpu/app:1"))
    assert received_handlers(runtime) == ["nvidia", "kata", "kata", ""]


async def test_rule_by_labels_and_annotations_all_must_match(runtime: FakeRuntime) -> None:
    settings = rules({"handler": "kata", "pod_labels": {"tier": "secure"},
                      "pod_annotations": {"example.com/isolation": "vm"}})
    async with serve(runtime, settings) as shim:
        both = sandbox_config("u1", labels={"tier": "secure", "app": "x"}, annotations={"example.com/isolation": "vm"})
        label_only = sandbox_config("u2", labels={"tier": "secure"})
        wrong_value = sandbox_config("u3", labels={"tier": "secure"}, annotations={"example.com/isolation": "no"})
        await pull(shim, pull_request("a", both))
        await pull(shim, pull_request("b", label_only))
        await pull(shim, pull_request("c", wrong_value))
        # the annotation may come from ImageSpec instead of the sandbox config
        await pull(shim, pull_request("d", label_only, image_annotations={"example.com/isolation": "vm"}))
    assert received_handlers(runtime) == ["kata", "", "", "kata"]


async def test_first_matching_rule_wins_and_source_is_logged(runtime: FakeRuntime, caplog) -> None:
    settings = rules({"handler": "first", "namespaces": ["ml"], "images": ["quay.io/gpu/*"]},
                     {"handler": "second", "namespaces": ["ml"]},
                     {"handler": "third"})
    caplog.set_level("INFO", logger="cri_shim")
    async with serve(runtime, settings) as shim:
        await pull(shim, pull_request("quay.io/gpu/train:1", sandbox_config("u1", "ml")))
        await pull(shim, pull_request("quay.io/cpu/train:1", sandbox_config("u2", "ml")))
        await pull(shim, pull_request("quay.io/cpu/train:2", sandbox_config("u3", "web")))
    assert received_handlers(runtime) == ["first", "second", "third"]
    sources = [r.fields["source"] for r in caplog.records if r.getMessage() == "runtime handler injected"]
    assert sources == ["runtime_handlers.rules[0]", "runtime_handlers.rules[1]", "runtime_handlers.rules[2]"]
    assert not runtime.calls("ListPodSandbox")  # a rule decided: no lookup


async def test_explicit_handler_is_kept_byte_for_byte(runtime: FakeRuntime) -> None:
    request = pull_request("nginx", sandbox_config("u1", "untrusted"), handler="runc")
    async with serve(runtime, rules({"handler": "gvisor"})) as shim:
        await pull(shim, request)
    assert runtime.calls("PullImage")[0].request == request


async def test_sandbox_config_and_every_other_byte_unchanged(runtime: FakeRuntime) -> None:
    # Fields the shim does not declare (hostname=2, log_directory=3, linux=8), an unknown
    # field number (99) and map entries in an order protobuf would not choose.
    extra_config = (wire.string_field(2, "host-a") + wire.string_field(3, "/var/log/pods/x")
                    + wire.len_field(8, wire.string_field(1, "/kubepods/x")) + wire.string_field(99, "future"))
    entries = b"".join(wire.len_field(6, wire.string_field(1, k) + wire.string_field(2, "v")) for k in ("z", "a"))
    config = sandbox_config("u1", "untrusted").SerializeToString() + extra_config + entries
    spec = pb.ImageSpec(image="nginx:1.27", annotations={"k": "v"}).SerializeToString() + wire.string_field(77, "x")
    auth = pb.AuthConfig(username="u", password="secret-pw").SerializeToString()
    request = wire.len_field(1, spec) + wire.len_field(2, auth) + wire.len_field(3, config)
    async with serve(runtime, rules({"handler": "gvisor", "namespaces": ["untrusted"]})) as shim:
        await pull(shim, request)
    got = runtime.calls("PullImage")[0].request
    assert pb.PullImageRequest.FromString(got).image.runtime_handler == "gvisor"
    # everything but the ImageSpec is the very same bytes, in the same order
    sent_fields = [(n, request[s:e]) for n, _, s, _, e in wire.fields(request)]
    got_fields = [(n, got[s:e]) for n, _, s, _, e in wire.fields(got)]
    assert [f for f in got_fields if f[0] != 1] == [f for f in sent_fields if f[0] != 1]
    # the ImageSpec is kubelet's bytes with one field appended
    got_spec = next(got[vs:e] for n, _, _, vs, e in wire.fields(got) if n == 1)
    assert got_spec == spec + wire.string_field(19, "gvisor")


# --------------------------------------------------------------------------- learned per pod


def run_request(uid: str, handler: str, namespace: str = "default") -> bytes:
    return pb.RunPodSandboxRequest(config=sandbox_config(uid, namespace), runtime_handler=handler).SerializeToString()


async def call(shim, method: str, request: bytes) -> bytes:
    async with grpc.aio.insecure_channel(shim.endpoint) as ch:
        return await ch.unary_unary(method)(request, timeout=5)


async def test_learned_from_run_pod_sandbox_and_forgotten_on_remove(runtime: FakeRuntime) -> None:
    runtime.unary[RUN] = pb.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString()
    async with serve(runtime) as shim:
        run = run_request("u1", "kata")
        assert await call(shim, RUN, run) == runtime.unary[RUN]
        await pull(shim, pull_request("nginx", sandbox_config("u1")))
        assert not runtime.calls("ListPodSandbox")  # known from RunPodSandbox: no lookup
        await call(shim, REMOVE, pb.RemovePodSandboxRequest(pod_sandbox_id="sb-1").SerializeToString())
        await pull(shim, pull_request("redis", sandbox_config("u1")))
    assert runtime.calls("RunPodSandbox")[0].request == run  # forwarded unchanged
    assert received_handlers(runtime) == ["kata", ""]
    assert len(runtime.calls("ListPodSandbox")) == 1  # forgotten: looked up (and not found)


async def test_default_handler_pod_gets_none_and_no_lookup(runtime: FakeRuntime) -> None:
    runtime.unary[RUN] = pb.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString()
    async with serve(runtime) as shim:
        await call(shim, RUN, run_request("u1", ""))
        request = pull_request("nginx", sandbox_config("u1"))
        await pull(shim, request)
    assert runtime.calls("PullImage")[0].request == request
    assert not runtime.calls("ListPodSandbox")


async def test_failed_run_pod_sandbox_teaches_nothing(runtime: FakeRuntime) -> None:
    runtime.unary[RUN] = (grpc.StatusCode.UNKNOWN, "cni failed", (("x-why", "net"),))
    async with serve(runtime) as shim:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(shim, RUN, run_request("u1", "kata"))
        await pull(shim, pull_request("nginx", sandbox_config("u1")))
    assert e.value.code() is grpc.StatusCode.UNKNOWN and e.value.details() == "cni failed"
    assert received_handlers(runtime) == [""]


def sandbox(uid: str, sid: str, handler: str, state=pb.SANDBOX_READY, created=1) -> pb.PodSandbox:
    return pb.PodSandbox(id=sid, metadata=pb.PodSandboxMetadata(name="p", uid=uid, namespace="default"),
                         state=state, created_at=created, runtime_handler=handler)


async def test_found_by_list_pod_sandbox_after_restart(runtime: FakeRuntime) -> None:
    # The runtime lists every pod; the shim matches metadata.uid itself.
    runtime.unary[LIST] = pb.ListPodSandboxResponse(items=[
        sandbox("other", "sb-9", "gvisor"),
        sandbox("u1", "sb-old", "kata", state=pb.SANDBOX_NOTREADY, created=1),
        sandbox("u1", "sb-new", "kata", created=2),
    ]).SerializeToString()
    runtime.unary[RUN] = pb.RunPodSandboxResponse(pod_sandbox_id="sb-x").SerializeToString()
    async with serve(runtime) as shim:
        await call(shim, RUN, run_request("before-restart", "wasm"))
    async with serve(runtime) as shim:  # a new process: it knows nothing
        await pull(shim, pull_request("nginx", sandbox_config("u1")), metadata=(("traceparent", TRACEPARENT),))
        await pull(shim, pull_request("redis", sandbox_config("u1")))
        await pull(shim, pull_request("redis", sandbox_config("other")))  # listed in the same answer
    assert received_handlers(runtime) == ["kata", "kata", "gvisor"]
    lists = runtime.calls("ListPodSandbox")
    assert len(lists) == 1
    assert lists[0].metadata["traceparent"] == TRACEPARENT  # the caller's metadata
    assert lists[0].deadline is not None and lists[0].deadline <= 2.05  # a short timeout


class CountingPods(PodCache):
    """The shim's pod cache, counting the lookups asked for; ``all_asked`` is set at ``expected``."""

    def __init__(self, like: PodCache, expected: int) -> None:
        super().__init__(like.size, like.negative_ttl, time.monotonic)
        self.expected, self.asked, self.all_asked = expected, 0, asyncio.Event()

    def known_unknown(self, uid: str) -> bool:  # the first step of every lookup
        self.asked += 1
        if self.asked >= self.expected:
            self.all_asked.set()
        return super().known_unknown(uid)


async def test_concurrent_lookups_share_one_call(runtime: FakeRuntime) -> None:
    async with serve(runtime, {"pulls": {"dedup": False}}) as shim:
        pods = shim.app.handlers.pods = CountingPods(shim.app.handlers.pods, expected=20)

        async def list_once_all_wait(request: bytes, context) -> bytes:
            await pods.all_asked.wait()  # every pull is waiting for a lookup before the answer comes
            return pb.ListPodSandboxResponse(items=[sandbox("u1", "sb-1", "kata")]).SerializeToString()
        runtime.unary[LIST] = list_once_all_wait
        await asyncio.gather(*(pull(shim, pull_request(f"img{i}", sandbox_config("u1"))) for i in range(20)))
    assert received_handlers(runtime) == ["kata"] * 20
    assert len(runtime.calls("ListPodSandbox")) == 1


async def test_unknown_pod_gets_no_handler_and_the_answer_is_cached_briefly(runtime: FakeRuntime) -> None:
    runtime.unary[LIST] = pb.ListPodSandboxResponse(items=[sandbox("u1", "sb-1", "kata")]).SerializeToString()
    now = [0.0]
    async with serve(runtime) as shim:
        shim.app.handlers.pods = PodCache(shim.app.handlers.pods.size, NEGATIVE_TTL_SECONDS, lambda: now[0])
        request = pull_request("nginx", sandbox_config("ghost"))
        await pull(shim, request)
        now[0] += NEGATIVE_TTL_SECONDS - 0.01
        await pull(shim, request)
        assert len(runtime.calls("ListPodSandbox")) == 1
        now[0] += 0.01  # remembered as unknown for NEGATIVE_TTL_SECONDS, then asked again
        await pull(shim, request)
        assert len(runtime.calls("ListPodSandbox")) == 2
        no_pod = pull_request("nginx")
        await pull(shim, no_pod)
        assert len(runtime.calls("ListPodSandbox")) == 2  # no pod UID: nothing to look up
    assert [r.request for r in runtime.calls("PullImage")] == [request] * 3 + [no_pod]


async def test_lookup_failure_does_not_fail_the_pull(runtime: FakeRuntime) -> None:
    runtime.unary[LIST] = grpc.StatusCode.UNAVAILABLE
    async with serve(runtime) as shim:
        request = pull_request("nginx", sandbox_config("u1"))
        assert pb.PullImageResponse.FromString(await pull(shim, request)).image_ref.startswith("sha256:")
    assert runtime.calls("PullImage")[0].request == request


async def test_learning_off_means_rules_only(runtime: FakeRuntime) -> None:
    runtime.unary[RUN] = pb.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString()
    runtime.unary[LIST] = pb.ListPodSandboxResponse(items=[sandbox("u1", "sb-1", "kata")]).SerializeToString()
    async with serve(runtime, rules(learn_from_sandboxes=False)) as shim:
        await call(shim, RUN, run_request("u1", "kata"))
        await pull(shim, pull_request("nginx", sandbox_config("u1")))
    assert received_handlers(runtime) == [""]
    assert not runtime.calls("ListPodSandbox")


async def test_reload_replaces_rules_and_keeps_learned_pods(runtime: FakeRuntime) -> None:
    runtime.unary[RUN] = pb.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString()
    async with serve(runtime, rules({"handler": "old", "namespaces": ["ml"]})) as shim:
        await call(shim, RUN, run_request("u1", "kata"))
        await pull(shim, pull_request("a", sandbox_config("u2", "ml")))
        new = config_mod.from_dict({**rules({"handler": "new", "namespaces": ["ml"]}),
                                    "listen": shim.app.cfg.listen, "upstream": shim.app.cfg.upstream})
        await shim.app.reload(new)
        await pull(shim, pull_request("b", sandbox_config("u2", "ml")))
        await pull(shim, pull_request("c", sandbox_config("u1")))
    assert received_handlers(runtime) == ["old", "new", "kata"]


def test_bad_image_pattern_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        config_mod.from_dict(rules({"handler": "kata", "images": ["ok/*", "Not A Ref"]}))
    assert e.value.key == "runtime_handlers.rules[0].images[1]"


def test_rule_patterns_read_an_ipv6_registry_as_a_host_as_pins_do() -> None:
    """``[fc00::1]:5000/`` is a host (shim/image_patterns.py), not a character class."""
    cfg = config_mod.from_dict(rules({"handler": "kata", "images": ["[fc00::1]:5000/team/*", "[fc00::1]:5000/one:1"]}))
    (rule,) = compile_rules(cfg.runtime_handlers.rules)
    for image, matched in [("[fc00::1]:5000/team/app:1", True), ("[fc00::1]:5000/one:1", True),
                           ("[fc00::1]:5000/one:2", False), ("f:5000/team/app:1", False)]:
        assert rule.matches(reference_names(image), None, None, ()) is matched, image


def test_pod_cache_is_bounded_lru_and_forgets_by_sandbox() -> None:
    now = [0.0]
    cache = PodCache(2, negative_ttl=5, clock=lambda: now[0])
    cache.put("a", "sb-a", "kata", learned=True)
    cache.put("b", "sb-b", "kata", learned=True)
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", "sb-c", "kata", learned=True)
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 2
    assert cache.forget_sandbox("sb-b") is None  # evicted with its pod
    cache.put("a", "sb-a2", "kata", learned=True)  # a second sandbox of the same pod
    cache.forget_sandbox("sb-a")
    assert cache.get("a") is not None
    cache.forget_sandbox("sb-a2")
    assert cache.get("a") is None
    cache.mark_unknown("z")
    assert cache.known_unknown("z")
    now[0] = 5.0
    assert not cache.known_unknown("z")


# --------------------------------------------------------------------------- ImageStatus / RemoveImage


async def test_image_requests_get_image_and_annotation_rules_only(runtime: FakeRuntime) -> None:
    settings = rules({"handler": "pod-only", "namespaces": ["ml"]},
                     {"handler": "by-label", "pod_labels": {"a": "b"}},
                     {"handler": "by-annotation", "pod_annotations": {"example.com/rc": "kata"}},
                     {"handler": "by-image", "images": ["quay.io/gpu/*"]})
    async with serve(runtime, settings) as shim:
        svc = shim.app.images
        status = pb.ImageStatusRequest(image=pb.ImageSpec(image="quay.io/gpu/x:1"), verbose=True).SerializeToString()
        out = inject_image_handler(svc.handlers, svc.events, status)
        assert pb.ImageStatusRequest.FromString(out).image.runtime_handler == "by-image"
        spec = pb.ImageSpec(image="quay.io/gpu/x:1").SerializeToString()
        assert next(out[vs:e] for n, _, _, vs, e in wire.fields(out) if n == 1) == spec + wire.string_field(19, "by-image")
        assert [(n, out[s:e]) for n, _, s, _, e in wire.fields(out) if n != 1] == [(2, b"\x10\x01")]

        annotated = pb.RemoveImageRequest(image=pb.ImageSpec(image="nginx", annotations={"example.com/rc": "kata"}))
        raw = annotated.SerializeToString()
        assert pb.RemoveImageRequest.FromString(inject_image_handler(svc.handlers, svc.events, raw, annotated)).image.runtime_handler \
            == "by-annotation"

        plain = pb.RemoveImageRequest(image=pb.ImageSpec(image="nginx")).SerializeToString()
        assert inject_image_handler(svc.handlers, svc.events, plain) == plain  # pod rules cannot match without a pod
        explicit = pb.ImageStatusRequest(image=pb.ImageSpec(image="quay.io/gpu/x:1", runtime_handler="runc"))
        assert inject_image_handler(svc.handlers, svc.events, explicit.SerializeToString()) == explicit.SerializeToString()


async def test_image_status_and_remove_image_reach_the_runtime_with_a_rule_handler(runtime: FakeRuntime) -> None:
    status_m, remove_m = "/runtime.v1.ImageService/ImageStatus", "/runtime.v1.ImageService/RemoveImage"
    settings = rules({"handler": "pod-only", "namespaces": ["ml"]}, {"handler": "kata", "images": ["quay.io/vm/*"]})
    status = pb.ImageStatusRequest(image=pb.ImageSpec(image="quay.io/vm/app:1"), verbose=True).SerializeToString()
    remove = pb.RemoveImageRequest(image=pb.ImageSpec(image="quay.io/vm/app:1")).SerializeToString()
    other = pb.RemoveImageRequest(image=pb.ImageSpec(image="nginx")).SerializeToString()
    async with serve(runtime, settings) as shim:
        await call(shim, status_m, status)
        await call(shim, remove_m, remove)
        await call(shim, remove_m, other)
    got_status, = runtime.calls("ImageStatus")
    got_remove, got_other = runtime.calls("RemoveImage")
    assert pb.ImageStatusRequest.FromString(got_status.request).image.runtime_handler == "kata"
    assert pb.ImageStatusRequest.FromString(got_status.request).verbose
    assert got_remove.request == wire.append_to_submessage(remove, 1, wire.string_field(19, "kata"))
    assert got_other.request == other


async def test_pod_rules_leave_image_status_untouched(runtime: FakeRuntime) -> None:
    async with serve(runtime, rules({"handler": "pod-only", "namespaces": ["ml"]})) as shim:
        assert "/runtime.v1.ImageService/ImageStatus" not in shim.app.table()  # relayed, not decoded
        request = pb.ImageStatusRequest(image=pb.ImageSpec(image="nginx")).SerializeToString()
        await call(shim, "/runtime.v1.ImageService/ImageStatus", request)
    assert runtime.calls("ImageStatus")[0].request == request
