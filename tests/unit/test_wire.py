from hypothesis import given
from hypothesis import strategies as st

from shim.cri import protowire as wire
from shim.proto.runtime.v1 import api_pb2


def test_append_handler_keeps_every_other_byte() -> None:
    req = api_pb2.PullImageRequest()
    req.image.image = "127.0.0.1:5000/app:1"
    req.image.annotations["a"] = "b"
    req.auth.username = "u"
    req.sandbox_config.metadata.uid = "pod-uid"
    raw = req.SerializeToString() + wire.string_field(999, "unknown to us")
    out = wire.append_to_submessage(raw, 1, wire.string_field(19, "kata"))
    parsed = api_pb2.PullImageRequest.FromString(out)
    assert parsed.image.runtime_handler == "kata"
    assert parsed.image.image == "127.0.0.1:5000/app:1"
    # everything after the ImageSpec is the client's bytes unchanged
    image_len = len(wire.len_field(1, req.image.SerializeToString()))
    assert out.endswith(raw[image_len:])


def test_append_creates_missing_submessage() -> None:
    out = wire.append_to_submessage(b"", 1, wire.string_field(19, "h"))
    assert api_pb2.PullImageRequest.FromString(out).image.runtime_handler == "h"


@given(st.binary(max_size=64))
def test_fields_never_crashes_on_garbage(data: bytes) -> None:
    try:
        list(wire.fields(data))
    except wire.WireError:
        pass
