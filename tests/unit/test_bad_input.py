"""Bad input on every intercepted method, through real calls on both engines.

* Malformed or truncated protobuf (hypothesis mutates valid requests: truncation,
  flipped and inserted bytes, random bytes) is refused with INVALID_ARGUMENT and a
  message naming the request type, never reaches the runtime, and the shim keeps
  serving. A request that still parses is served as usual. RunPodSandbox and
  RemovePodSandbox are intercepted only to learn pods' runtime handlers, after the
  runtime has answered: whatever their bytes, the runtime's answer reaches the client
  (shim/runtime_handlers/sandboxes.py), and the shim keeps serving.
  With the relay engine, ImageStatus and ListImages are relayed (only their answer is
  rewritten, shim/relay/patched.py): the runtime judges their request, as it gets it.
* A request over ``server.max_message_bytes`` is refused with RESOURCE_EXHAUSTED
  naming the limit, and the connection goes on serving other calls (the relay engine's
  ImageStatus and ListImages: the runtime judges the size).
* A ListImages of 20,000 images (pins configured) passes, with exactly the pinned
  ones marked; StreamImages and ImageStatus too.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shim.proto.runtime.v1 import api_pb2
from tests.support import h2raw
from tests.support.fake_images import SVC, FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim

PULL, REMOVE, STATUS, LIST, STREAM = (SVC + m for m in ("PullImage", "RemoveImage", "ImageStatus", "ListImages",
                                                        "StreamImages"))
VERSION = "/runtime.v1.RuntimeService/Version"
RUN_SB, REMOVE_SB = "/runtime.v1.RuntimeService/RunPodSandbox", "/runtime.v1.RuntimeService/RemovePodSandbox"
SANDBOX = {RUN_SB: api_pb2.RunPodSandboxRequest, REMOVE_SB: api_pb2.RemovePodSandboxRequest}
REQUEST = {PULL: api_pb2.PullImageRequest, REMOVE: api_pb2.RemoveImageRequest, STATUS: api_pb2.ImageStatusRequest,
           LIST: api_pb2.ListImagesRequest, STREAM: api_pb2.StreamImagesRequest}
PINS = {"pins": {"images": ["nginx", "registry.k8s.io/pause:*"]}}  # pins: the image calls are intercepted too
ENGINES = ("relay", "grpc")
PATCHED = {STATUS, LIST}  # the relay engine relays them, rewriting only the answer: the runtime judges the request


def nginx() -> StoredImage:
    return StoredImage(image_id(1), ["docker.io/library/nginx:latest"])


class Env(tuple):
    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return "env"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One scripted runtime and a shim per engine, for all examples (their own loop)."""
    loop = asyncio.new_event_loop()
    rt = FakeRuntime(socket_in(str(tmp_path_factory.mktemp("rt"))))
    FakeImageStore([nginx()]).install(rt)
    rt.unary[PULL] = api_pb2.PullImageResponse(image_ref="sha256:" + "0" * 64).SerializeToString()
    rt.unary[VERSION] = b"v"
    rt.unary[RUN_SB] = api_pb2.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString()
    rt.unary[REMOVE_SB] = b""
    loop.run_until_complete(rt.start())
    shims, cms = {}, []
    for engine in ENGINES:
        cm = running_shim(rt.endpoint, PINS, engine=engine)
        shims[engine] = loop.run_until_complete(cm.__aenter__())
        cms.append(cm)
    yield Env((loop, rt, shims))
    for cm in cms:
        loop.run_until_complete(cm.__aexit__(None, None, None))
    loop.run_until_complete(rt.stop())
    loop.close()


text = st.text(max_size=24)
specs = st.builds(lambda image, annotations, handler: api_pb2.ImageSpec(
    image=image, annotations=annotations, runtime_handler=handler),
    st.one_of(text, st.sampled_from(["nginx", "docker.io/library/nginx:latest", "reg/app:1"])),
    st.dictionaries(text, text, max_size=3), text)
auths = st.builds(api_pb2.AuthConfig, username=text, password=text, auth=text, identity_token=text,
                  registry_token=text)
VALID = {
    PULL: st.builds(lambda spec, auth, uid: api_pb2.PullImageRequest(
        image=spec, auth=auth, sandbox_config=api_pb2.PodSandboxConfig(
            metadata=api_pb2.PodSandboxMetadata(name="p", uid=uid, namespace="ns"))), specs, auths, text),
    REMOVE: st.builds(api_pb2.RemoveImageRequest, image=specs),
    STATUS: st.builds(api_pb2.ImageStatusRequest, image=specs, verbose=st.booleans()),
    LIST: st.builds(lambda spec: api_pb2.ListImagesRequest(filter=api_pb2.ImageFilter(image=spec)), specs),
    STREAM: st.builds(lambda spec: api_pb2.StreamImagesRequest(filter=api_pb2.ImageFilter(image=spec)), specs),
    RUN_SB: st.builds(lambda uid, handler, labels: api_pb2.RunPodSandboxRequest(
        config=api_pb2.PodSandboxConfig(metadata=api_pb2.PodSandboxMetadata(name="p", uid=uid, namespace="ns"),
                                        labels=labels), runtime_handler=handler),
        text, text, st.dictionaries(text, text, max_size=3)),
    REMOVE_SB: st.builds(api_pb2.RemovePodSandboxRequest, pod_sandbox_id=text),
}


@st.composite
def mutated(draw, method: str) -> bytes:
    data = bytearray(draw(VALID[method]).SerializeToString())
    how = draw(st.sampled_from(["truncate", "flip", "insert", "random", "utf8"]))
    if how == "random":
        return draw(st.binary(min_size=1, max_size=64))
    if not data:
        data = bytearray(b"\x0a\x00")
    if how == "truncate":
        return bytes(data[:draw(st.integers(0, len(data) - 1))])
    i = draw(st.integers(0, len(data) - 1))
    if how == "flip":
        data[i] ^= draw(st.integers(1, 255))
    elif how == "insert":
        data[i:i] = draw(st.binary(min_size=1, max_size=4))
    else:  # an invalid UTF-8 byte in a string
        data[i:i] = b"\x0a\x01\xff"
    return bytes(data)


def _fields(data: bytes) -> list[tuple[int, int, bytes]]:
    """(number, wire type, value) of each top-level field; DecodeError if truncated."""
    out, i = [], 0

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            if i >= len(data) or shift > 63:
                raise DecodeError("truncated varint")
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wtype = key >> 3, key & 7
        if wtype == 0:
            varint()
            value = b""
        elif wtype == 2:
            n = varint()
            value, i = data[i:i + n], i + n
        elif wtype in (1, 5):
            value, i = b"", i + (8 if wtype == 1 else 4)
        else:  # groups (3/4) and invalid types: malformed for the shim's splicing
            raise DecodeError(f"wire type {wtype}")
        if i > len(data):
            raise DecodeError("truncated field")
        out.append((number, wtype, value))
    return out


def parses(method: str, data: bytes) -> bool:
    """Would the shim accept these bytes? protobuf must parse them, and for PullImage (whose
    bytes the shim splices) the fields it reads or appends to must be length-delimited."""
    try:
        REQUEST[method].FromString(data)
        if method.endswith("/PullImage"):
            for number, wtype, value in _fields(data):
                if number in (1, 2, 3) and wtype != 2:
                    return False
                if number == 1:
                    if any(n in (1, 2, 18, 19) and w != 2 for n, w, _ in _fields(value)):
                        return False
        return True
    except DecodeError:
        return False


async def call(endpoint: str, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        try:
            if method == STREAM:
                async for _ in ch.unary_stream(method)(data, timeout=5):
                    pass
            else:
                await ch.unary_unary(method)(data, timeout=5)
            return grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""


async def still_serves(endpoint: str) -> bool:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        return await ch.unary_unary(VERSION)(b"", timeout=5) == b"v"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("method", list(REQUEST), ids=lambda m: m.rsplit("/", 1)[1])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_requests_are_invalid_argument(env, engine: str, method: str, data) -> None:
    loop, rt, shims = env
    shim = shims[engine]
    request = data.draw(mutated(method))
    seen = len(rt.received)
    code, details = loop.run_until_complete(call(shim.endpoint, method, request))
    if engine == "relay" and method in PATCHED:
        assert rt.received[-1].request == request  # the runtime got it as it was, and answered
        assert "cri-shim" not in details
    elif parses(method, request):
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
        assert "malformed" not in details
        if code is grpc.StatusCode.INVALID_ARGUMENT:  # a PullImage naming no image
            assert details == "cri-shim: PullImageRequest.image.image is empty"
    else:
        assert code is grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(f"cri-shim: malformed {REQUEST[method].DESCRIPTOR.full_name.split('.')[-1]}: ")
        assert len(rt.received) == seen  # nothing reached the runtime
    assert loop.run_until_complete(still_serves(shim.endpoint))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("method", list(SANDBOX), ids=lambda m: m.rsplit("/", 1)[1])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sandbox_calls_get_the_runtimes_answer_whatever_their_bytes(env, engine: str, method: str, data) -> None:
    loop, rt, shims = env
    shim = shims[engine]
    request = data.draw(mutated(method))
    code, details = loop.run_until_complete(call(shim.endpoint, method, request))
    assert code is grpc.StatusCode.OK, details
    assert rt.received[-1].request == request
    assert loop.run_until_complete(still_serves(shim.endpoint))


# --------------------------------------------------------------------------- oversized

LIMIT = 64 * 1024


def oversized(method: str, size: int) -> bytes:
    spec = api_pb2.ImageSpec(image="reg/app:1", annotations={"big": "x" * size})
    msg = {PULL: api_pb2.PullImageRequest(image=spec), REMOVE: api_pb2.RemoveImageRequest(image=spec),
           STATUS: api_pb2.ImageStatusRequest(image=spec),
           LIST: api_pb2.ListImagesRequest(filter=api_pb2.ImageFilter(image=spec)),
           STREAM: api_pb2.StreamImagesRequest(filter=api_pb2.ImageFilter(image=spec))}[method]
    return msg.SerializeToString()


@pytest.mark.parametrize("engine", ENGINES)
async def test_oversized_requests_are_resource_exhausted(tmp_path, engine: str) -> None:
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    FakeImageStore([nginx()]).install(rt)
    rt.unary[PULL] = b""
    rt.unary[VERSION] = b"v"
    try:
        async with running_shim(rt.endpoint, {**PINS, "server": {"max_message_bytes": LIMIT}},
                                engine=engine) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                for method, size in ((m, s) for m in REQUEST for s in (LIMIT + 1, 1 << 20)):
                    request = oversized(method, size)
                    if engine == "relay" and method in PATCHED:  # relayed: the runtime's own limit (4 MiB here)
                        await ch.unary_unary(method)(request, timeout=5)
                        assert rt.received[-1].request == request
                        continue
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        if method == STREAM:
                            async for _ in ch.unary_stream(method)(request, timeout=5):
                                pass
                        else:
                            await ch.unary_unary(method)(request, timeout=5)
                    print(f"\n[{engine}] {method.rsplit('/', 1)[1]} of {len(request)} bytes: "
                          f"{e.value.code().name}: {e.value.details()}")
                    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert str(LIMIT) in e.value.details()
                    if engine == "relay":  # the grpc engine's words are grpc's own: "Received message larger than max"
                        assert "server.max_message_bytes" in e.value.details()
                    # the same connection goes on serving, relayed and intercepted calls alike
                    assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"v"
                    assert await ch.unary_unary(STATUS)(
                        api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="nginx")).SerializeToString(),
                        timeout=5)
                # just under the limit passes
                spec = api_pb2.ImageSpec(image="reg/app:1", annotations={"big": "x" * (LIMIT - 100)})
                request = api_pb2.PullImageRequest(image=spec).SerializeToString()
                assert LIMIT - 100 < len(request) <= LIMIT
                await ch.unary_unary(PULL)(request, timeout=5)
        assert not [r for r in rt.received  # none reached the runtime
                    if len(r.request) > LIMIT and not (engine == "relay" and r.method in PATCHED)]
    finally:
        await rt.stop()


# --------------------------------------------------------------------------- huge lists

N_IMAGES = 20_000
KUBELET_OPTIONS = [("grpc.max_receive_message_length", 16 << 20)]  # kubelet's CRI client limit


def huge_store() -> tuple[FakeImageStore, set[str]]:
    """20,000 images; every 7th is pinned by a tag glob, every 11th by its digest, every 13th by ID."""
    images, pinned = [], set()
    for i in range(N_IMAGES):
        digest = "sha256:" + f"{i:064x}"
        tag = f"registry.example.com/team{i % 50}/app{i}:v{i % 3}"
        if i % 7 == 0:
            tag = f"registry.k8s.io/pause:{i}"
        images.append(StoredImage(image_id(i + 1), [tag], [f"registry.example.com/app{i}@{digest}"]))
        if i % 7 == 0 or i % 11 == 0 or i % 13 == 0:
            pinned.add(image_id(i + 1))
    return FakeImageStore(images), pinned


def huge_pins() -> list[str]:
    pins = ["registry.k8s.io/pause:*"]
    pins += [f"registry.example.com/app{i}@sha256:{i:064x}" for i in range(0, N_IMAGES, 11)]
    pins += [image_id(i + 1) for i in range(0, N_IMAGES, 13)]
    return pins


@pytest.mark.parametrize("engine", ENGINES)
async def test_huge_image_list_is_marked(tmp_path, engine: str) -> None:
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    store, pinned = huge_store()
    store.install(rt)
    try:
        async with running_shim(rt.endpoint, {"pins": {"images": huge_pins()}}, engine=engine) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint, options=KUBELET_OPTIONS) as ch:
                t0 = time.monotonic()
                raw = await ch.unary_unary(LIST)(b"", timeout=30)
                took, size = time.monotonic() - t0, len(raw)
                images = api_pb2.ListImagesResponse.FromString(raw).images
                assert [i.id for i in images] == [i.id for i in store.images]
                assert {i.id for i in images if i.pinned} == pinned
                streamed = []
                async for msg in ch.unary_stream(STREAM)(b"", timeout=30):
                    streamed += api_pb2.StreamImagesResponse.FromString(msg).images
                assert {i.id for i in streamed if i.pinned} == pinned and len(streamed) == N_IMAGES
                for i in (0, 1, 11, 13, 14, 19_998):
                    raw = await ch.unary_unary(STATUS)(api_pb2.ImageStatusRequest(
                        image=api_pb2.ImageSpec(image=image_id(i + 1))).SerializeToString(), timeout=5)
                    assert api_pb2.ImageStatusResponse.FromString(raw).image.pinned == (image_id(i + 1) in pinned)
                print(f"\n[{engine}] ListImages of {N_IMAGES} images ({size // 1024} KiB) with "
                      f"{len(huge_pins())} pins: {len(pinned)} marked, {took:.2f}s")
    finally:
        await rt.stop()


# --------------------------------------------------------------------------- malformed request headers


async def test_malformed_headers_free_the_stream_and_its_slot(runtime: FakeRuntime) -> None:
    """A bad ``-bin`` value or ``grpc-timeout`` on an intercepted call is answered as grpc-go
    answers it (INTERNAL "malformed ..."), and the call's slot is freed: 150 such calls on one
    connection (server.max_intercepted_streams is 100), then a good one is served."""
    pull = h2raw.grpc_message(api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="nginx")).SerializeToString())
    bad = [(b"x-trace-bin", b"!!not base64!!"), (b"x-trace-bin", b"QQ="), (b"grpc-timeout", b"5x"),
           (b"grpc-timeout", b"123456789S"), (b"grpc-timeout", b"+5S")]

    def call(c: h2raw.RawH2, sid: int, extra: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
        c.send(h2raw.headers(sid, h2raw.request_block(SVC + "PullImage", extra), end_stream=False)
               + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, sid, pull))
        f, _ = c.read_until(lambda f: f.type == h2raw.HEADERS and f.stream_id == sid and f.flags & h2raw.END_STREAM)
        assert f is not None, sid
        return c.decode_headers(f)

    async with running_shim(runtime.endpoint) as shim:
        with h2raw.RawH2(shim.path) as c:
            refused = [await asyncio.to_thread(call, c, 2 * i + 1, [bad[i % len(bad)]]) for i in range(150)]
            good = await asyncio.to_thread(call, c, 301, [(b"x-trace-bin", b"QUJD")])
            slots = [len(conn.core.local) for conn in shim.server.relay.connections]
    assert {a[b"grpc-status"] for a in refused} == {b"13"}, refused[:3]
    assert all(a[b"grpc-message"].startswith(b"malformed ") for a in refused)
    assert good[b"grpc-status"] == b"0", good
    assert slots == [0], slots
    assert len(runtime.calls("PullImage")) == 1
