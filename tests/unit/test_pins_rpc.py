"""Pinned images through an in-process shim in front of a scripted runtime:
RemoveImage refusals, ``pinned`` marking in ListImages/StreamImages/ImageStatus,
mark-only mode, image-set pins and reloads."""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path

import grpc
import pytest
import yaml

from shim.cri import protowire as wire
from shim.images.remove_image import removal_request
from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_images import SVC, FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim
from tests.support.logcapture import Lines

D_NGINX = "sha256:" + "d1" * 32
D_APP = "sha256:" + "a2" * 32
REMOVE = SVC + "RemoveImage"
UNKNOWN_FIELD = wire.string_field(99, "from-the-future")  # a field we do not declare


def nginx() -> StoredImage:
    return StoredImage(image_id(1), ["docker.io/library/nginx:latest", "docker.io/library/nginx:1.27"],
                       [f"docker.io/library/nginx@{D_NGINX}"], extra=UNKNOWN_FIELD)


def app() -> StoredImage:
    return StoredImage(image_id(2), ["quay.io/org/app:v1"], [f"quay.io/org/app@{D_APP}"])


def pause() -> StoredImage:
    return StoredImage(image_id(3), ["registry.k8s.io/pause:3.10"], [], pinned=True)


@pytest.fixture(params=["relay", "grpc"])
def serve(request):
    """running_shim on each engine: both must intercept the same way."""
    return functools.partial(running_shim, engine=request.param)


@pytest.fixture
def store(runtime: FakeRuntime) -> FakeImageStore:
    s = FakeImageStore([nginx(), app(), pause()])
    s.install(runtime)
    return s


def remove_request(name: str, **spec: str) -> bytes:
    return api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=name, **spec)).SerializeToString()


def status_request(name: str, verbose: bool = False) -> bytes:
    return api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=name), verbose=verbose).SerializeToString()


async def remove(ch: grpc.aio.Channel, name: str) -> None:
    await ch.unary_unary(SVC + "RemoveImage")(remove_request(name), timeout=5)


async def listed(ch: grpc.aio.Channel) -> dict[str, bool]:
    raw = await ch.unary_unary(SVC + "ListImages")(b"", timeout=5)
    return {img.id: img.pinned for img in api_pb2.ListImagesResponse.FromString(raw).images}


def denied(shim) -> float:
    return shim.app.metrics.registry.get_sample_value("cri_shim_remove_denied_total") or 0.0


# --------------------------------------------------------------------------- RemoveImage


@pytest.mark.parametrize("name", [
    "nginx",  # short name: docker.io/library/nginx:latest
    "docker.io/library/nginx:1.27",  # the other tag of the same image
    f"docker.io/library/nginx@{D_NGINX}",  # digest reference
    image_id(1),  # what kubelet's image GC sends
])
async def test_pinned_image_is_not_removed(serve, runtime, store, name) -> None:
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx:latest"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await remove(ch, name)
        assert denied(shim) == 1
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    msg = e.value.details()
    assert msg.startswith("cri-shim: ") and name in msg and image_id(1) in msg
    assert "pins.images entry 'nginx:latest'" in msg
    assert runtime.calls("RemoveImage") == []
    assert store.resolve(image_id(1)) is not None


@pytest.mark.parametrize(("pattern", "victim"), [
    (f"nginx@{D_NGINX}", "nginx:1.27"),  # digest pin, removal by tag
    (image_id(1), "nginx"),  # image ID pin
    ("quay.io/org/*", "quay.io/org/app:v1"),  # glob
    ("docker.io/library/nginx:1.*", image_id(1)),  # glob on the other tag, removal by ID
    ("index.docker.io/library/nginx:1.27", "nginx"),  # docker.io alias
])
async def test_pin_patterns_protect(serve, runtime, store, pattern, victim) -> None:
    async with serve(runtime.endpoint, {"pins": {"images": [pattern]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await remove(ch, victim)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert repr(pattern) in e.value.details()
    assert runtime.calls("RemoveImage") == []


async def test_unpinned_image_is_removed_by_its_id_other_bytes_unchanged(serve, runtime, store) -> None:
    request = remove_request("quay.io/org/app:v1", runtime_handler="kata") + UNKNOWN_FIELD
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx", "registry.k8s.io/*"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await ch.unary_unary(SVC + "RemoveImage")(request, timeout=5)
        assert denied(shim) == 0
    by_id = remove_request(image_id(2), runtime_handler="kata") + UNKNOWN_FIELD
    assert [r.request for r in runtime.calls("RemoveImage")] == [by_id]
    # the lookup asked about the same ImageSpec, runtime handler included
    lookup = api_pb2.ImageStatusRequest.FromString(runtime.calls("ImageStatus")[0].request)
    assert (lookup.image.image, lookup.image.runtime_handler, lookup.verbose) == ("quay.io/org/app:v1", "kata", False)
    assert store.resolve("quay.io/org/app:v1") is None


async def test_a_name_repointed_after_the_check_cannot_remove_a_pinned_image(serve, runtime, store) -> None:
    """A pull moves quay.io/org/app:v1 to the pinned nginx image right after the shim looked it up."""
    status = runtime.unary[SVC + "ImageStatus"]

    async def status_then_repoint(request: bytes, context) -> bytes:
        answer = await status(request, context)
        app_image, nginx_image = store.resolve("quay.io/org/app:v1"), store.resolve("nginx")
        app_image.tags.remove("quay.io/org/app:v1")
        nginx_image.tags.append("quay.io/org/app:v1")
        return answer

    runtime.unary[SVC + "ImageStatus"] = status_then_repoint
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx:latest"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await remove(ch, "quay.io/org/app:v1")
    assert store.resolve(image_id(1)) is not None  # nginx, pinned, is still there
    assert store.resolve(image_id(2)) is None  # the image the shim checked is gone


async def test_unknown_image_is_answered_as_the_runtime_would_and_never_sent_on(serve, runtime, store) -> None:
    """A pull of the pinned name lands right after the lookup found nothing: the runtime is not asked to remove."""
    status = runtime.unary[SVC + "ImageStatus"]

    async def status_then_pull(request: bytes, context) -> bytes:
        answer = await status(request, context)
        store.add(StoredImage(image_id(4), ["docker.io/library/ghost:1"], []))
        return answer

    runtime.unary[SVC + "ImageStatus"] = status_then_pull
    async with serve(runtime.endpoint, {"pins": {"images": ["ghost:1"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            answer = await ch.unary_unary(SVC + "RemoveImage")(remove_request("ghost:1"), timeout=5)
    assert answer == b""  # containerd's and CRI-O's answer for a missing image: an empty RemoveImageResponse
    assert runtime.calls("RemoveImage") == []
    assert store.resolve("ghost:1") is not None


async def test_an_empty_name_is_answered_as_a_missing_image_and_never_sent_on(serve, runtime, store) -> None:
    """containerd resolves "" by its short-ID index: *the* image while it holds one (issue 44). Through
    the shim nothing is looked up or removed; sent to the runtime itself, the same request removes it."""
    store.images[:] = [nginx()]  # pinned, and the only image left
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            answer = await ch.unary_unary(REMOVE)(remove_request(""), timeout=5)
        assert denied(shim) == 0
    assert answer == b""  # as the runtime answers a missing image
    assert runtime.calls("ImageStatus") == [] and runtime.calls("RemoveImage") == []
    assert store.resolve(image_id(1)) is not None
    async with grpc.aio.insecure_channel(runtime.endpoint) as ch:  # what the shim keeps from happening
        await ch.unary_unary(REMOVE)(remove_request(""), timeout=5)
    assert store.resolve(image_id(1)) is None


PINNED_ID, FREE_ID = "sha256:" + "5e" * 32, "sha256:" + "5f" * 32


async def test_a_shortened_id_is_checked_as_the_image_it_resolves_to(serve, runtime, store) -> None:
    """A prefix of an ID (``crictl rmi 5e5e5e``): refused when it resolves to a pinned image, the
    runtime's own error when it matches two, and removed by the full ID when it resolves to an unpinned one."""
    store.images[:] = [StoredImage(PINNED_ID, ["quay.io/org/pinned:1"]), StoredImage(FREE_ID, ["quay.io/org/free:1"])]
    async with serve(runtime.endpoint, {"pins": {"images": ["quay.io/org/pinned:1"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            for name in ("5e5e5e", "sha256:5e5e5e"):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await remove(ch, name)
                assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert PINNED_ID in refused.value.details() and "quay.io/org/pinned:1" in refused.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as ambiguous:
                await remove(ch, "5")
            assert (ambiguous.value.code(), ambiguous.value.details()) == \
                (grpc.StatusCode.UNKNOWN, 'can not resolve "5" locally: ambiguous digest string')
            await remove(ch, "5f5f")
        assert denied(shim) == 2
    sent = [api_pb2.RemoveImageRequest.FromString(r.request).image.image for r in runtime.calls("RemoveImage")]
    assert sent == [FREE_ID]
    assert store.resolve(PINNED_ID) is not None and store.resolve(FREE_ID) is None


async def test_failed_lookup_removes_nothing(serve, runtime, store) -> None:
    runtime.unary[SVC + "ImageStatus"] = (grpc.StatusCode.UNAVAILABLE, "runtime restarting", ())
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await remove(ch, "quay.io/org/app:v1")
        errors = shim.app.metrics.registry.get_sample_value(
            "cri_shim_upstream_errors_total", {"method": "ImageStatus", "code": "UNAVAILABLE"})
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAVAILABLE, "runtime restarting")
    assert runtime.calls("RemoveImage") == []
    assert errors == 1


async def test_mark_only_marks_but_removes(serve, runtime, store) -> None:
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx"], "mode": "mark-only"}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert (await listed(ch))[image_id(1)] is True
            await remove(ch, "nginx")
            assert image_id(1) not in await listed(ch)
        assert denied(shim) == 0
    assert len(runtime.calls("RemoveImage")) == 1


async def test_without_pins_nothing_is_looked_up_or_changed(serve, runtime, store) -> None:
    store.list_extra = UNKNOWN_FIELD
    async with serve(runtime.endpoint) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert await ch.unary_unary(SVC + "ListImages")(b"", timeout=5) == store.list_bytes()
            status = await ch.unary_unary(SVC + "ImageStatus")(status_request("nginx"), timeout=5)
            assert status == wire.len_field(1, nginx().encode())
            await remove(ch, "nginx")
    assert [r.method.rsplit("/", 1)[1] for r in runtime.received] == ["ListImages", "ImageStatus", "RemoveImage"]


async def test_image_set_pins_switch_interception_on_and_off(serve, runtime, store) -> None:
    async with serve(runtime.endpoint) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert await ch.unary_unary(SVC + "ListImages")(b"", timeout=5) == store.list_bytes()
            assert REMOVE not in shim.app.router.table  # no pins: relayed, never decoded
            shim.app.declare_pins([("quay.io/org/app:v1", "base")])
            assert (await listed(ch))[image_id(2)] is True
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await remove(ch, "quay.io/org/app:v1")
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            shim.app.declare_pins([])
            assert REMOVE not in shim.app.router.table
            assert await ch.unary_unary(SVC + "ListImages")(b"", timeout=5) == store.list_bytes()
            await remove(ch, "quay.io/org/app:v1")
    assert store.resolve("quay.io/org/app:v1") is None


# --------------------------------------------------------------------------- marking


def split_images(raw: bytes) -> list[bytes]:
    return [raw[vs:end] for number, _, _, vs, end in wire.fields(raw) if number == 1]


async def test_list_images_marks_pinned_and_keeps_every_other_byte(serve, runtime, store) -> None:
    store.list_extra = UNKNOWN_FIELD
    before = [img.encode() for img in store.images]
    async with serve(runtime.endpoint, {"pins": {"images": ["docker.io/library/nginx:1.27"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            raw = await ch.unary_unary(SVC + "ListImages")(b"", timeout=5)
    resp = api_pb2.ListImagesResponse.FromString(raw)
    # nginx is ours; pause was pinned by the runtime itself and stays so; app is not pinned
    assert [(i.id, i.pinned) for i in resp.images] == [(image_id(1), True), (image_id(2), False), (image_id(3), True)]
    after = split_images(raw)
    assert after[1:] == before[1:]  # untouched images: byte for byte
    assert after[0].startswith(before[0])  # the marked one: the runtime's bytes, unknown field included, + pinned
    assert raw.endswith(UNKNOWN_FIELD)  # the response's own unknown field survives
    marked = api_pb2.Image.FromString(after[0])
    assert list(marked.repo_tags) == nginx().tags and marked.pinned


async def test_stream_images_marks_each_message(serve, runtime, store) -> None:
    async with serve(runtime.endpoint, {"pins": {"images": ["quay.io/org/*"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            msgs = [m async for m in ch.unary_stream(SVC + "StreamImages")(b"", timeout=5)]
    images = [img for m in msgs for img in api_pb2.StreamImagesResponse.FromString(m).images]
    assert len(msgs) == 2
    assert [(i.id, i.pinned) for i in images] == [(image_id(1), False), (image_id(2), True), (image_id(3), True)]


async def test_image_status_marks_pinned_keeps_info_order_and_misses(serve, runtime, store) -> None:
    store.status_info = [("zeta", "1"), ("alpha", "2")]  # not the order a re-encoder would write
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            call = ch.unary_unary(SVC + "ImageStatus")
            pinned = await call(status_request("nginx:1.27", verbose=True), timeout=5)
            plain = await call(status_request("quay.io/org/app:v1", verbose=True), timeout=5)
            missing = await call(status_request("ghost"), timeout=5)
    original = await store.image_status(status_request("nginx:1.27", verbose=True), None)
    info = original[len(wire.len_field(1, nginx().encode())):]
    assert pinned.endswith(info)  # the info map, in the runtime's order
    resp = api_pb2.ImageStatusResponse.FromString(pinned)
    assert resp.image.pinned and resp.image.id == image_id(1) and dict(resp.info) == {"zeta": "1", "alpha": "2"}
    assert plain == await store.image_status(status_request("quay.io/org/app:v1", verbose=True), None)
    assert missing == b""


# --------------------------------------------------------------------------- image sets and reload


async def test_declared_image_set_pins(serve, runtime, store) -> None:
    async with serve(runtime.endpoint, {"pins": {"images": ["registry.k8s.io/pause:*"]}}) as shim:
        shim.app.declare_pins([("quay.io/org/app:v1", "base")])
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert (await listed(ch))[image_id(2)] is True
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await remove(ch, image_id(2))
            assert "image set 'base'" in e.value.details()
            await shim.app.reload(shim.app.cfg)  # a config reload keeps the declared pins
            with pytest.raises(grpc.aio.AioRpcError):
                await remove(ch, image_id(2))
            shim.app.declare_pins([])
            await remove(ch, image_id(2))
            with pytest.raises(grpc.aio.AioRpcError):  # the config pin is still in force
                await remove(ch, "registry.k8s.io/pause:3.10")
    assert len(runtime.calls("RemoveImage")) == 1


def write_config(path: Path, pins: list[str]) -> None:
    path.write_text(yaml.safe_dump({"pins": {"images": pins}}))


async def test_reload_unpins_and_bad_config_keeps_pins(serve, runtime, store, tmp_path) -> None:
    cfg = tmp_path / "config.yaml"
    write_config(cfg, ["nginx", "quay.io/org/app:v1"])
    log = logging.getLogger("cri_shim.server")
    lines = Lines()
    log.addHandler(lines)
    try:
        async with serve(runtime.endpoint, {"pins": {"images": ["nginx", "quay.io/org/app:v1"]}},
                                config_path=str(cfg)) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                write_config(cfg, ["nginx", "Bad:Pattern"])
                await shim.server.reload(shim.app, "SIGHUP")
                rejected = [r for r in lines.records if "rejected" in r.getMessage()]
                assert rejected and "pins.images[1]" in rejected[-1].fields["error"]
                assert rejected[-1].levelno == logging.ERROR
                with pytest.raises(grpc.aio.AioRpcError):  # old pins still in force
                    await remove(ch, "quay.io/org/app:v1")

                write_config(cfg, ["nginx"])
                await shim.server.reload(shim.app, "SIGHUP")
                assert (await listed(ch))[image_id(2)] is False
                await remove(ch, "quay.io/org/app:v1")
                with pytest.raises(grpc.aio.AioRpcError):
                    await remove(ch, "nginx")
    finally:
        log.removeHandler(lines)


async def test_config_file_change_reloads_pins(serve, runtime, store, tmp_path) -> None:
    cfg = tmp_path / "config.yaml"
    write_config(cfg, ["nginx"])
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx"]}}, config_path=str(cfg)) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert (await listed(ch))[image_id(1)] is True
            write_config(cfg, ["quay.io/org/*"])  # the watcher polls the file every second
            for _ in range(50):
                if not (await listed(ch))[image_id(1)]:
                    break
                await asyncio.sleep(0.1)
            assert await listed(ch) == {image_id(1): False, image_id(2): True, image_id(3): True}
            await remove(ch, "nginx")


async def test_malformed_remove_request_is_invalid_argument(serve, runtime, store) -> None:
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            for bad in (b"\x0a\x05ab", b"\x0a\x02\x0a\x05"):  # truncated field, truncated inside ImageSpec
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary(REMOVE)(bad, timeout=5)
                assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "RemoveImageRequest" in e.value.details()
    assert runtime.calls("RemoveImage") == []


async def test_request_with_a_group_field_is_still_checked(serve, runtime, store) -> None:
    """A deprecated group (wire type 3) the runtime would skip must not open a way around a pin."""
    request = remove_request("nginx") + b"\x1b\x1c"  # field 3: an empty group
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx"]}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(REMOVE)(request, timeout=5)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert runtime.calls("RemoveImage") == []


@pytest.mark.parametrize(("image_id_", "tags", "name", "sent"), [
    (image_id(1), ["a:1", "a:2"], "a:1", image_id(1)),  # containerd removes every name anyway: by ID
    ("1" * 64, ["a:1"], "a:1", "1" * 64),  # CRI-O, the image's only tag: by ID
    ("1" * 64, ["a:1", "a:2"], "a:1", "a:1"),  # CRI-O untags one tag of several: the name stays
    ("1" * 64, ["a:1", "a:2"], f"a@{D_APP}", "1" * 64),  # a digest names the whole image
    ("1" * 64, ["a:1", "a:2"], "1" * 12, "1" * 64),  # CRI-O deletes the image a shortened ID names: by ID
    ("1" * 64, ["docker.io/library/111:latest", "a:2"], "111", "111"),  # a tag that looks like one stays a tag
    (image_id(1), ["a:1", "a:2"], "0" * 12, image_id(1)),  # containerd: by ID as always
])
def test_removal_names_the_checked_image_as_the_runtime_would_remove_it(image_id_, tags, name, sent) -> None:
    request = remove_request(name, runtime_handler="kata") + UNKNOWN_FIELD
    out = removal_request(request, api_pb2.RemoveImageRequest.FromString(request),
                          api_pb2.Image(id=image_id_, repo_tags=tags))
    assert out == (request if sent == name else remove_request(sent, runtime_handler="kata") + UNKNOWN_FIELD)
