"""The shim in front of CRI-O v1.34: every image-path answer is the one CRI-O gives directly.

Each check makes the same call against CRI-O and through the shim (both engines) and
compares what a client sees: status code, details, trailing metadata and response bytes.
The only normalization is ImageFsInfo's timestamp (the time of each call).

What CRI-O answers differently from containerd, and the shim passes on as it is:
- image IDs are the bare 64 hex (containerd: ``sha256:<hex>``); ``sha256:<hex>`` is not
  a name CRI-O resolves (ImageStatus: no image), a bare ID prefix is;
- PullImage answers ``repo@sha256:<manifest digest>``, not the image ID;
- RemoveImage by a tag removes only that tag while the image has other names;
- a pull of a missing image is UNKNOWN ("manifest unknown"), not NOT_FOUND.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support import cri
from tests.support.crio import Crio
from tests.support.fixtures import ShimFactory
from tests.support.proxy import CountingProxy
from tests.support.registry import RegistryWithProxy
from tests.support.shim import ShimProcess

pytestmark = pytest.mark.crio

ENGINES = {"relay": {"server": {"admin_socket": ""}},
           "grpc": {"server": {"admin_socket": "", "engine": "grpc"}}}


@pytest.fixture(scope="module")
def shims(crio: Crio, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ShimProcess]]:
    factory = ShimFactory(lambda: str(crio.socket), tmp_path_factory.mktemp("crio-shims"))
    try:
        yield {name: factory(config) for name, config in ENGINES.items()}
    finally:
        problems = factory.close()
    assert not problems, problems


@pytest.fixture(params=list(ENGINES))
def shim(request: pytest.FixtureRequest, shims: dict[str, ShimProcess]) -> ShimProcess:
    s = shims[request.param]
    assert s.running, f"the {request.param} shim died:\n{s.log_tail()}"
    return s


def outcome(res: cri.CallResult) -> tuple[str, str | None, bytes | None, cri.Metadata]:
    return res.code.name, res.details, res.response, res.trailing_metadata


def same_call(shim: ShimProcess, crio: Crio, method: str, request: bytes,
              timeout: float = 30) -> cri.CallResult:
    """CRI-O directly, then through the shim: identical outcomes. Returns CRI-O's."""
    direct = cri.call(crio.socket, method, request, timeout)
    via = cri.call(shim.socket, method, request, timeout)
    assert outcome(via) == outcome(direct), f"{method}: shim and CRI-O differ"
    return direct


def without_timestamps(response: bytes) -> bytes:
    msg = api_pb2.ImageFsInfoResponse.FromString(response)
    for usage in (*msg.image_filesystems, *msg.container_filesystems):
        usage.timestamp = 0
    return msg.SerializeToString()


def pull(socket: object, ref: str) -> cri.CallResult:
    return cri.call(str(socket), "PullImage", cri.pull_image_request(ref), 60)


def test_version_and_status(shim: ShimProcess, crio: Crio) -> None:
    direct = same_call(shim, crio, "Version", cri.version_request())
    version = cri.decode_version_response(direct.unwrap())
    assert (version["runtime_name"], version["runtime_version"]) == ("cri-o", "1.34.0")
    assert b"RuntimeReady" in same_call(shim, crio, "Status", b"").unwrap()


def test_image_lifecycle(shim: ShimProcess, crio: Crio, make_image, proxy: CountingProxy) -> None:
    img = make_image()
    bare_id = img.image_id.removeprefix("sha256:")
    pulled = pull(shim.socket, img.ref)
    assert pulled.ok, pulled
    assert cri.decode_pull_image_response(pulled.unwrap()) == img.digest_ref  # containerd: the image ID
    assert proxy.stats().blob_requests_for(img.repository, img.tag) == 2  # config + layer, once
    assert pull(crio.socket, img.ref).response == pulled.response
    assert pull(shim.socket, img.ref).response == pulled.response

    for name in (img.ref, img.digest_ref, bare_id, bare_id[:12]):
        for verbose in (False, True):
            direct = same_call(shim, crio, "ImageStatus", cri.image_status_request(name, verbose))
            info = cri.decode_image_status_response(direct.unwrap())
            assert info is not None and info.id == bare_id, name
            assert info.repo_tags == [img.ref] and info.repo_digests == [img.digest_ref]
    # "sha256:<hex>" is not an ID to CRI-O: no such image, directly and through the shim
    direct = same_call(shim, crio, "ImageStatus", cri.image_status_request(img.image_id))
    assert cri.decode_image_status_response(direct.unwrap()) is None

    for request in (cri.list_images_request(), cri.list_images_request(img.ref)):
        direct = same_call(shim, crio, "ListImages", request)
        assert bare_id in {i.id for i in cri.decode_list_images_response(direct.unwrap())}

    direct = cri.call(crio.socket, "ImageFsInfo", b"", 10)
    via = cri.call(shim.socket, "ImageFsInfo", b"", 10)
    assert direct.ok and via.ok, (direct, via)
    assert without_timestamps(via.unwrap()) == without_timestamps(direct.unwrap())
    mount = api_pb2.ImageFsInfoResponse.FromString(via.unwrap()).image_filesystems[0].fs_id.mountpoint
    assert mount.startswith(str(crio.root))

    removed = cri.call(shim.socket, "RemoveImage", cri.remove_image_request(img.ref), 10)
    assert removed.ok and removed.response == b"", removed
    direct = same_call(shim, crio, "ImageStatus", cri.image_status_request(img.ref))
    assert cri.decode_image_status_response(direct.unwrap()) is None
    same_call(shim, crio, "RemoveImage", cri.remove_image_request(img.ref))  # gone: OK both ways


def test_remove_by_tag_keeps_the_other_names(shim: ShimProcess, crio: Crio, make_image,
                                             registry: RegistryWithProxy) -> None:
    """CRI-O untags: the image stays while it has another name (containerd removes it)."""
    img = make_image()
    twin = registry.push(img.image, img.repository + "-twin", "v2")  # the same image, another name
    assert pull(shim.socket, img.ref).ok and pull(shim.socket, twin.ref).ok
    assert cri.call(shim.socket, "RemoveImage", cri.remove_image_request(twin.ref), 10).ok
    info = cri.decode_image_status_response(
        same_call(shim, crio, "ImageStatus", cri.image_status_request(img.ref)).unwrap())
    assert info is not None and info.repo_tags == [img.ref]
    assert cri.call(shim.socket, "RemoveImage", cri.remove_image_request(img.image_id.removeprefix("sha256:")),
                    10).ok  # by ID: the whole image
    assert cri.decode_image_status_response(
        same_call(shim, crio, "ImageStatus", cri.image_status_request(img.ref)).unwrap()) is None


@pytest.mark.parametrize("case", ["pull-missing-tag", "pull-missing-repo", "pull-bad-reference",
                                  "status-absent", "remove-absent", "remove-sha256-id", "list-undecodable"])
def test_errors(shim: ShimProcess, crio: Crio, registry: RegistryWithProxy, make_image, case: str) -> None:
    def missing_tag() -> str:
        return make_image(tag="present").ref.rsplit(":", 1)[0] + ":absent"

    method, request, code = {
        "pull-missing-tag": lambda: ("PullImage", cri.pull_image_request(missing_tag()), "UNKNOWN"),
        "pull-missing-repo": lambda: ("PullImage", cri.pull_image_request(f"{registry.host}/e2e/never-pushed:v1"),
                                      "UNKNOWN"),
        "pull-bad-reference": lambda: ("PullImage", cri.pull_image_request("garbage!!!"), "UNKNOWN"),
        "status-absent": lambda: ("ImageStatus", cri.image_status_request(missing_tag()), "OK"),
        "remove-absent": lambda: ("RemoveImage", cri.remove_image_request(missing_tag()), "OK"),
        "remove-sha256-id": lambda: ("RemoveImage", cri.remove_image_request("sha256:" + "ab" * 32), "OK"),
        "list-undecodable": lambda: ("ListImages", b"\x0a\x7f", "INTERNAL"),
    }[case]()
    direct = same_call(shim, crio, method, request)
    assert direct.code.name == code, direct
    if case.startswith("pull-missing"):
        assert "manifest unknown" in (direct.details or "")


def test_unknown_method(shim: ShimProcess, crio: Crio) -> None:
    direct = same_call(shim, crio, "/runtime.v1.ImageService/NoSuchMethod", b"\x0a\x03abc")
    assert direct.code == grpc.StatusCode.UNIMPLEMENTED
