"""Image IDs in either form: containerd reports ``sha256:<hex>``, CRI-O the bare 64 hex.

A pin written either way protects the image whichever way the runtime reports its ID:
marked pinned in ListImages/ImageStatus, RemoveImage by bare ID refused. The scripted
runtime here answers like CRI-O does (bare IDs; ``sha256:<hex>`` is not a name it knows).
"""

from __future__ import annotations

import grpc
import pytest

from shim import reference
from shim.images.pin_set import PinSet, image_names
from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_images import SVC, FakeImageStore, StoredImage
from tests.support.inproc import running_shim

HEX_A = "5d" * 32
HEX_B = "e7" * 32
TAG_A = "quay.io/org/app:v1"
TAG_B = "quay.io/org/other:v1"


@pytest.mark.parametrize(("s", "expected"), [
    (HEX_A, f"sha256:{HEX_A}"),
    (f"sha256:{HEX_A}", f"sha256:{HEX_A}"),
    (HEX_A[:12], None),  # an ID prefix is not an ID (and is a valid Docker Hub name)
    (f"sha256:{HEX_A[:12]}", None),
    (HEX_A.upper(), None),  # runtimes write IDs in lowercase
    (f"sha512:{'5d' * 64}", None),
    ("nginx", None),
    ("", None),
])
def test_normalize_image_id(s: str, expected: str | None) -> None:
    assert reference.normalize_image_id(s) == expected
    if expected is not None:
        assert reference.normalize(s) == expected


@pytest.mark.parametrize("pattern", [HEX_A, f"sha256:{HEX_A}"])
@pytest.mark.parametrize("reported", [HEX_A, f"sha256:{HEX_A}"])
def test_id_pin_matches_either_form(pattern: str, reported: str) -> None:
    pins = PinSet.build([pattern])
    assert pins.match_image(reported, [TAG_A], []) == f"sha256:{HEX_A}"
    assert pins.match(image_names(reported, [TAG_A], [])) == f"sha256:{HEX_A}"
    assert pins.match_image(HEX_B, [TAG_B], []) is None
    assert pins.match(image_names(HEX_B, [TAG_B], [])) is None


def crio_store() -> FakeImageStore:
    return FakeImageStore([StoredImage(HEX_A, [TAG_A], [f"quay.io/org/app@sha256:{'a1' * 32}"]),
                           StoredImage(HEX_B, [TAG_B], [])])


async def listed(ch: grpc.aio.Channel) -> dict[str, bool]:
    raw = await ch.unary_unary(SVC + "ListImages")(b"", timeout=5)
    return {img.id: img.pinned for img in api_pb2.ListImagesResponse.FromString(raw).images}


@pytest.mark.parametrize("pattern", [HEX_A, f"sha256:{HEX_A}"])
async def test_id_pin_against_a_runtime_reporting_bare_ids(runtime, engine, pattern) -> None:
    store = crio_store()
    store.install(runtime)
    async with running_shim(runtime.endpoint, {"pins": {"images": [pattern]}}, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert await listed(ch) == {HEX_A: True, HEX_B: False}
            status = await ch.unary_unary(SVC + "ImageStatus")(
                api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=TAG_A)).SerializeToString(), timeout=5)
            assert api_pb2.ImageStatusResponse.FromString(status).image.pinned
            for name in (HEX_A, TAG_A):  # kubelet's image GC sends the ID as the runtime reported it
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary(SVC + "RemoveImage")(
                        api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=name)).SerializeToString(), timeout=5)
                assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert f"id {HEX_A}" in e.value.details() and repr(pattern) in e.value.details()
            await ch.unary_unary(SVC + "RemoveImage")(
                api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=HEX_B)).SerializeToString(), timeout=5)
    assert runtime.calls("RemoveImage") and [i.id for i in store.images] == [HEX_A]


@pytest.mark.parametrize("pattern", [f"sha256:{HEX_A[:12]}", f"sha256:{HEX_A[:63]}"])
def test_shortened_id_pin_is_refused_naming_the_key(pattern: str) -> None:
    """``sha256:<short hex>`` would be a tag of docker.io/library/sha256 and pin nothing."""
    from shim.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as e:
        from_dict({"pins": {"images": [HEX_A, pattern]}})
    assert e.value.key == "pins.images[1]" and "all 64 hex digits" in str(e.value)
