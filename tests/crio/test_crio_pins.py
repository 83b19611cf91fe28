"""Pinned images with CRI-O behind the shim.

A pin by tag, by digest, by bare ID and by ``sha256:`` ID each mark the image pinned in
ListImages and ImageStatus (CRI-O itself reports it unpinned) and make RemoveImage by
tag, digest, bare ID and ID prefix fail with FAILED_PRECONDITION, leaving the image in
CRI-O. CRI-O's own ``pinned_images`` only marks: it does not refuse RemoveImage, and the
shim keeps that answer as it is unless one of its own pins matches too.
"""

from __future__ import annotations

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support import cri
from tests.support.crio import Crio
from tests.support.oci import PushedImage

pytestmark = pytest.mark.crio


def bare(img: PushedImage) -> str:
    return img.image_id.removeprefix("sha256:")


def pull(socket: object, img: PushedImage) -> None:
    res = cri.call(str(socket), "PullImage", cri.pull_image_request(img.ref), 60)
    assert res.ok, res


def status(socket: object, name: str) -> cri.ImageInfo | None:
    return cri.decode_image_status_response(cri.call(str(socket), "ImageStatus", cri.image_status_request(name)).unwrap())


def listed(socket: object) -> dict[str, bool]:
    res = cri.call(str(socket), "ListImages", cri.list_images_request())
    return {i.id: i.pinned for i in cri.decode_list_images_response(res.unwrap())}


def remove(socket: object, name: str) -> cri.CallResult:
    return cri.call(str(socket), "RemoveImage", cri.remove_image_request(name))


@pytest.mark.parametrize("engine", ["relay", "grpc"])
@pytest.mark.parametrize("by", ["tag", "digest", "bare-id", "sha256-id"])
def test_pinned_image_is_marked_and_not_removed(crio: Crio, make_image, shim_factory, by: str, engine: str) -> None:
    img, other = make_image(), make_image()
    pull(crio.socket, img)
    pull(crio.socket, other)
    pattern = {"tag": img.ref, "digest": img.digest_ref, "bare-id": bare(img), "sha256-id": img.image_id}[by]
    shim = shim_factory({"server": {"admin_socket": "", "engine": engine}, "pins": {"images": [pattern]}})

    assert listed(crio.socket)[bare(img)] is False  # CRI-O alone: not pinned
    via = listed(shim.socket)
    assert (via[bare(img)], via[bare(other)]) == (True, False)
    for name in (img.ref, img.digest_ref, bare(img)):
        info = status(shim.socket, name)
        assert info is not None and info.pinned, name

    for name in (img.ref, img.digest_ref, bare(img), bare(img)[:12]):
        res = remove(shim.socket, name)
        assert res.code is grpc.StatusCode.FAILED_PRECONDITION, (name, res)
        assert res.details.startswith("cri-shim: ") and f"id {bare(img)}" in res.details
        assert f"pins.images entry '{pattern}'" in res.details
    info = status(crio.socket, img.ref)
    assert info is not None and info.repo_tags == [img.ref]  # every name still there

    assert remove(shim.socket, other.ref).ok
    assert status(crio.socket, other.ref) is None


def test_sha256_id_that_crio_does_not_resolve_removes_nothing(crio: Crio, make_image, shim_factory) -> None:
    """``sha256:<hex>`` is no name to CRI-O: the lookup finds nothing, the call goes on,
    and CRI-O answers OK without removing anything, so a pin is never bypassed this way."""
    img = make_image()
    pull(crio.socket, img)
    shim = shim_factory({"server": {"admin_socket": ""}, "pins": {"images": [img.ref]}})
    direct = remove(crio.socket, img.image_id)
    via = remove(shim.socket, img.image_id)
    assert (via.code, via.details, via.response) == (direct.code, direct.details, direct.response)
    assert via.ok and status(crio.socket, img.ref) is not None


def test_crio_pinned_images_only_mark(crio_factory, make_image, shim_factory) -> None:
    """CRI-O's own ``pinned_images`` marks images pinned (kubelet's GC skips them) but
    RemoveImage still removes them. The shim passes both on; its own pins refuse."""
    ours, theirs = make_image(), make_image()
    runtime = crio_factory(pinned_images=[theirs.ref, ours.ref])
    pull(runtime.socket, ours)
    pull(runtime.socket, theirs)
    assert listed(runtime.socket)[bare(theirs)] is True  # pinned by CRI-O itself

    shim = shim_factory({"server": {"admin_socket": ""}, "pins": {"images": [ours.ref]}}, upstream=runtime.socket)
    via = listed(shim.socket)
    assert (via[bare(ours)], via[bare(theirs)]) == (True, True)
    assert remove(shim.socket, ours.ref).code is grpc.StatusCode.FAILED_PRECONDITION
    assert remove(shim.socket, theirs.ref).ok  # CRI-O's pin does not stop a removal
    assert status(runtime.socket, theirs.ref) is None
    assert status(runtime.socket, ours.ref) is not None


def test_stream_images_with_pins_is_crio_s_own_answer(crio: Crio, shim_factory) -> None:
    """CRI-O v1.34 has no StreamImages: with pins the shim intercepts it and still hands on
    CRI-O's UNIMPLEMENTED, as it is."""
    shim = shim_factory({"server": {"admin_socket": ""}, "pins": {"images": ["registry.example/any:*"]}})

    def stream(socket: object) -> tuple[list[bytes], grpc.StatusCode, str]:
        with grpc.insecure_channel(cri.target(str(socket))) as ch:
            it = ch.unary_stream("/runtime.v1.ImageService/StreamImages")(b"", timeout=10)
            got: list[bytes] = []
            try:
                got.extend(it)
            except grpc.RpcError as e:
                return got, e.code(), e.details()  # type: ignore[attr-defined]
            return got, it.code(), it.details()  # type: ignore[attr-defined]

    direct = stream(crio.socket)
    assert direct[:2] == ([], grpc.StatusCode.UNIMPLEMENTED), direct
    assert stream(shim.socket) == direct


def test_stream_images_with_pins_leaves_the_connection_whole(crio: Crio, shim_factory) -> None:
    """CRI-O sometimes answers the StreamImages the shim intercepts before it reads the shim's
    cancel (the first call on a connection, whose header block the runtime must see: about one
    in fifty); its trailers changed its HPACK table. The client must still decode every later
    answer on that connection (shim/relay/carried.py)."""
    shim = shim_factory({"server": {"admin_socket": ""}, "pins": {"images": ["registry.example/any:*"]}})
    for i in range(150):
        with grpc.insecure_channel(cri.target(str(shim.socket))) as ch:  # a fresh connection each time
            it = ch.unary_stream("/runtime.v1.ImageService/StreamImages")(b"", timeout=10)
            try:
                list(it)
                code = it.code()  # type: ignore[attr-defined]
            except grpc.RpcError as e:
                code = e.code()  # type: ignore[attr-defined]
            assert code is grpc.StatusCode.UNIMPLEMENTED, (i, code)
            version = ch.unary_unary("/runtime.v1.RuntimeService/Version")
            for _ in range(2):
                assert api_pb2.VersionResponse.FromString(version(b"", timeout=10)).runtime_name == "cri-o", i
