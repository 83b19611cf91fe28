"""The shim in front of CRI-O v1.34, what is CRI-O's own: RemoveImage by a tag removes only
that tag while the image has other names (containerd removes the image), and the shim passes
that on as it is (same call against CRI-O and through the shim, both engines: status code,
details, trailing metadata and response bytes).

The checks that hold for every runtime (Version, Status, the image lifecycle, errors, unknown
methods) are runtime-parametrized in tests/e2e/test_passthrough_e2e.py; their CRI-O cases
are marked ``crio`` too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import cri
from tests.support.crio import Crio
from tests.support.fixtures import ShimFactory
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


def pull(socket: object, ref: str) -> cri.CallResult:
    return cri.call(str(socket), "PullImage", cri.pull_image_request(ref), 60)


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
