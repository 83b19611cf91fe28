"""While pins exist, ImageStatus, ListImages and StreamImages are intercepted (the grpc
engine; the relay engine: StreamImages): a request that does not parse is refused with
INVALID_ARGUMENT naming the request type, like PullImage and RemoveImage, instead of
being sent on to the runtime. The relay engine relays ImageStatus and ListImages and
rewrites only their answer (shim/relay/patched.py): the runtime gets the request as it
is and judges it (containerd answers with its own error)."""

from __future__ import annotations

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_images import SVC, FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim

TRUNCATED = b"\x0a\x05\x0a\x03ng"  # ImageSpec (field 1) says 5 bytes, 4 follow


@pytest.mark.parametrize("method, message", [("ImageStatus", "ImageStatusRequest"),
                                             ("ListImages", "ListImagesRequest"),
                                             ("StreamImages", "StreamImagesRequest")])
async def test_malformed_request_is_refused_before_the_runtime(tmp_path, engine: str, method: str,
                                                               message: str) -> None:
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    FakeImageStore([StoredImage(image_id(1), ["docker.io/library/nginx:latest"])]).install(rt)
    try:
        async with running_shim(rt.endpoint, {"pins": {"images": ["nginx"]}}, engine=engine) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                if engine == "relay" and method != "StreamImages":
                    try:  # the fake runtime fails ImageStatus on it, answers ListImages whatever the filter
                        await ch.unary_unary(SVC + method)(TRUNCATED, timeout=5)
                    except grpc.aio.AioRpcError as err:
                        assert "cri-shim" not in (err.details() or "")
                    assert [r.request for r in rt.received] == [TRUNCATED]  # the runtime judged it
                    rt.received.clear()
                    ok = api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="nginx")).SerializeToString()
                    raw = await ch.unary_unary(SVC + "ImageStatus")(ok, timeout=5)
                    assert api_pb2.ImageStatusResponse.FromString(raw).image.pinned
                    return
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    if method == "StreamImages":
                        async for _ in ch.unary_stream(SVC + method)(TRUNCATED, timeout=5):
                            pass
                    else:
                        await ch.unary_unary(SVC + method)(TRUNCATED, timeout=5)
                assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith(f"cri-shim: malformed {message}: ")
                assert rt.received == []
                # a good request still goes through, marked
                ok = api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="nginx")).SerializeToString()
                raw = await ch.unary_unary(SVC + "ImageStatus")(ok, timeout=5)
                assert api_pb2.ImageStatusResponse.FromString(raw).image.pinned
    finally:
        await rt.stop()
