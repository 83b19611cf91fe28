"""A PinnedImageSet kept present in CRI-O by the shim.

Three images declared (one already in CRI-O, one by tag and one by digest missing): the
shim pulls exactly the two missing ones, all three end up in CRI-O, ListImages and
ImageStatus through the shim show them pinned, and RemoveImage of any of them (by tag or
by CRI-O's bare ID) is refused naming the set.
"""

from __future__ import annotations


import grpc
import pytest

from tests.support import cri
from tests.support.crio import Crio
from tests.support.image_fleet import metric, pinned_set
from tests.support.proxy import CountingProxy
from tests.support.registry import free_port
from tests.support.wait import wait_for_blocking as wait_for

pytestmark = pytest.mark.crio


def test_pinned_image_set_present_and_pinned(crio: Crio, make_image, proxy: CountingProxy, shim_factory,
                                             tmp_path) -> None:
    have, by_tag, by_digest = make_image(), make_image(), make_image()
    assert cri.call(crio.socket, "PullImage", cri.pull_image_request(have.ref), 60).ok
    proxy.reset()
    sets = tmp_path / "sets"
    sets.mkdir()
    (sets / "release.yaml").write_text(pinned_set("release", [have.ref, by_tag.ref, by_digest.digest_ref]))
    port = free_port()
    shim = shim_factory({"server": {"admin_socket": ""}, "image_sets": {"dir": str(sets)},
                         "metrics": {"address": f"127.0.0.1:{port}"}})

    wait_for(lambda: metric(port, "cri_shim_image_set_images", {"set": "release", "state": "present"}) == 3,
             60, "3 images present")
    pulled = {r.image for r in proxy.records() if r.kind == "manifest"}
    assert pulled == {(by_tag.repository, by_tag.tag), (by_digest.repository, by_digest.manifest_digest)}
    assert metric(port, "cri_shim_pull_requests_total", {"priority": "background"}) == 2

    ids = [i.image_id.removeprefix("sha256:") for i in (have, by_tag, by_digest)]
    direct = {i.id: i.pinned for i in cri.decode_list_images_response(
        cri.call(crio.socket, "ListImages", cri.list_images_request()).unwrap())}
    via = {i.id: i.pinned for i in cri.decode_list_images_response(
        cri.call(shim.socket, "ListImages", cri.list_images_request()).unwrap())}
    assert [direct[i] for i in ids] == [False] * 3
    assert [via[i] for i in ids] == [True] * 3
    status = cri.decode_image_status_response(
        cri.call(shim.socket, "ImageStatus", cri.image_status_request(by_digest.digest_ref)).unwrap())
    assert status is not None and status.pinned

    for name in (have.ref, ids[1], by_digest.digest_ref):
        res = cri.call(shim.socket, "RemoveImage", cri.remove_image_request(name))
        assert res.code is grpc.StatusCode.FAILED_PRECONDITION and "image set 'release'" in res.details, res
    assert all(cri.decode_image_status_response(
        cri.call(crio.socket, "ImageStatus", cri.image_status_request(i)).unwrap()) is not None for i in ids)
