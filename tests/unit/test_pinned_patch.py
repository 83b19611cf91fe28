"""The pinned flag set in the runtime's response bytes means what decoding the response,
setting ``pinned`` on every image a pin protects and encoding it again would: for random
Image messages, with unknown fields (which must reach the client), images already pinned,
and images no pin protects (whose bytes stay the runtime's own)."""

from __future__ import annotations

from google.protobuf import unknown_fields
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.cri import protowire as wire
from shim.images.mark_pinned import mark_images, mark_status
from shim.images.pin_set import PinSet
from shim.proto.runtime.v1 import api_pb2

PATTERNS = ("registry.k8s.io/pause:*", "docker.io/library/nginx:1.25", "quay.io/team/*")
PINS = PinSet.build(PATTERNS)
HEX = "0123456789abcdef"

names = st.sampled_from(["registry.k8s.io/pause:3.9", "registry.k8s.io/pause:3.10", "docker.io/library/nginx:1.25",
                         "docker.io/library/nginx:1.26", "quay.io/team/app:v1", "quay.io/other/app:v1",
                         "ghcr.io/x/y:latest", "registry.k8s.io/coredns:v1.11"])
digests = st.builds(lambda repo, d: f"{repo}@sha256:{d}",
                    st.sampled_from(["registry.k8s.io/pause", "quay.io/team/app", "ghcr.io/x/y"]),
                    st.text(HEX, min_size=64, max_size=64))
# unknown fields (numbers the proto does not use), every wire type a runtime could send
unknown = st.lists(st.one_of(
    st.builds(wire.varint_field, st.integers(100, 2000), st.integers(0, 2**63)),
    st.builds(wire.len_field, st.integers(100, 2000), st.binary(max_size=20)),
    st.builds(lambda n, b: wire.varint(n << 3 | wire.I32) + b, st.integers(100, 2000), st.binary(min_size=4, max_size=4)),
    st.builds(lambda n, b: wire.varint(n << 3 | wire.I64) + b, st.integers(100, 2000), st.binary(min_size=8, max_size=8)),
), max_size=3)


@st.composite
def images(draw: st.DrawFn) -> bytes:
    """One Image message's bytes: known fields (pinned or not) and unknown ones, in a random order."""
    img = api_pb2.Image(id="sha256:" + draw(st.text(HEX, min_size=64, max_size=64)),
                        repo_tags=draw(st.lists(names, max_size=3)), repo_digests=draw(st.lists(digests, max_size=2)),
                        size=draw(st.integers(0, 2**40)), username=draw(st.sampled_from(["", "root", "65532"])),
                        pinned=draw(st.booleans()))
    if draw(st.booleans()):
        img.spec.image = "ignored"
        img.spec.annotations["a"] = "b"
    # pinned written out as the runtime may: false explicitly, more than once (the last one counts)
    explicit = [wire.varint_field(8, v) for v in draw(st.lists(st.sampled_from([0, 1, 2]), max_size=2))]
    parts = _fields(img.SerializeToString()) + explicit + draw(unknown)
    return b"".join(draw(st.permutations(parts)))


def _fields(data: bytes) -> list[bytes]:
    return [data[start:end] for _, _, start, _, end in wire.fields(data)]


def expected_image(raw: bytes) -> api_pb2.Image:
    img = api_pb2.Image.FromString(raw)
    if PINS.match_image(img.id, img.repo_tags, img.repo_digests) is not None:
        img.pinned = True
    return img


def assert_same_unknown(a: api_pb2.Image, b: api_pb2.Image) -> None:
    def listed(m: api_pb2.Image) -> list[tuple[int, int, object]]:
        return [(f.field_number, f.wire_type, f.data) for f in unknown_fields.UnknownFieldSet(m)]
    assert listed(a) == listed(b)


@settings(max_examples=300, deadline=None)
@given(image=images(), response_unknown=unknown, has_image=st.booleans())
def test_image_status_patch_is_decode_set_encode(image: bytes, response_unknown: list[bytes], has_image: bool) -> None:
    data = (wire.len_field(1, image) if has_image else b"") + b"".join(response_unknown)
    out = mark_status(PINS, data)
    got = api_pb2.ImageStatusResponse.FromString(out)
    if not has_image:
        assert out == data and not got.HasField("image")
        return
    want = expected_image(image)
    assert got.image == want
    assert_same_unknown(got.image, want)
    assert [f.data for f in unknown_fields.UnknownFieldSet(got)] == \
        [f.data for f in unknown_fields.UnknownFieldSet(api_pb2.ImageStatusResponse.FromString(data))]
    if want.pinned == api_pb2.Image.FromString(image).pinned:
        assert out == data  # nothing to change: the runtime's bytes as they are


@settings(max_examples=200, deadline=None)
@given(listed=st.lists(images(), max_size=6), response_unknown=unknown, stream=st.booleans())
def test_image_list_patch_is_decode_set_encode(listed: list[bytes], response_unknown: list[bytes],
                                               stream: bool) -> None:
    cls = api_pb2.StreamImagesResponse if stream else api_pb2.ListImagesResponse
    data = b"".join(wire.len_field(1, i) for i in listed) + b"".join(response_unknown)
    out = mark_images(PINS, data, cls)
    got = cls.FromString(out)
    want = [expected_image(i) for i in listed]
    assert list(got.images) == want
    for g, w in zip(got.images, want):
        assert_same_unknown(g, w)
    unchanged = [i for i, w in zip(listed, want) if w.pinned == api_pb2.Image.FromString(i).pinned]
    for i in unchanged:  # an image the shim does not mark reaches the client byte for byte
        assert wire.len_field(1, i) in out


def test_no_pins_no_change() -> None:
    data = wire.len_field(1, api_pb2.Image(id="sha256:" + "1" * 64, repo_tags=["registry.k8s.io/pause:3.9"])
                          .SerializeToString())
    assert mark_status(PinSet.build(()), data) == data
    assert mark_images(PinSet.build(()), data, api_pb2.ListImagesResponse) == data


def test_image_given_twice_is_merged_as_a_parser_merges_it() -> None:
    """Two occurrences of ImageStatusResponse.image are one image to a parser: a tag in the
    second counts for the pin as much as one in the first."""
    first = api_pb2.Image(id="sha256:" + "2" * 64).SerializeToString()
    second = api_pb2.Image(repo_tags=["registry.k8s.io/pause:3.9"]).SerializeToString()
    data = wire.len_field(1, first) + wire.len_field(1, second)
    got = api_pb2.ImageStatusResponse.FromString(mark_status(PINS, data))
    assert got.image.pinned and got.image.id == "sha256:" + "2" * 64


def test_unparseable_response_passes_on_untouched() -> None:
    data = wire.len_field(1, wire.string_field(2, "registry.k8s.io/pause:3.9"))[:-2]  # truncated
    assert mark_status(PINS, data) == data
    assert mark_images(PINS, data, api_pb2.ListImagesResponse) == data
