"""The shim as a process in front of Debian's containerd 1.6 (and, for the checks that hold
for every runtime, CRI-O v1.34: the ``crio`` cases): every answer is the one the runtime
gives directly.

Each check makes the same call against containerd and through the shim and compares
the outcome: response bytes, status code, details and trailing metadata.  The core
checks run against both passthrough engines (the default HTTP/2 frame relay and the
grpc.aio proxy, ``server.engine: grpc``).

Where containerd itself is not deterministic the comparison says so and normalizes
exactly that: ``Status(verbose)`` serializes its ``info`` map and ``ListImages`` its
images in Go map order (two direct calls differ too), and ``ImageFsInfo`` stamps each
answer with the time of the call.

What CRI-O answers differently from containerd, and the shim passes on as it is:
image IDs are the bare 64 hex (``sha256:<hex>`` is no name to CRI-O, a bare ID prefix is);
PullImage answers ``repo@sha256:<manifest digest>``; a pull of a missing image is UNKNOWN
("manifest unknown"), not NOT_FOUND; its ListImages order is stable. (CRI-O's own:
tests/crio/test_crio_passthrough.py.)

Not covered here: 16 MiB messages (containerd can't be made to answer that big; the
unit tests cover it against the fake runtime) and the contents of a real event
stream (containerd 1.6 has no GetContainerEvents; also covered in tests/unit).
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support import cri
from tests.support.containerd import Containerd
from tests.support.fixtures import CRIO, CriRuntime, ShimFactory, runtime_named
from tests.support.proxy import CountingProxy
from tests.support.registry import RegistryWithProxy
from tests.support.shim import ShimProcess
from tests.support.wait import wait_for_blocking as wait_for

# (marked e2e by the folder, the CRI-O cases crio: tests/conftest.py)


def settings(**server: object) -> dict[str, object]:
    """Shim config with these ``server`` keys and no admin socket (its default path is
    one per machine: test shims would fight over it)."""
    return {"server": {"admin_socket": "", **server}}


# containerd's images API is let through for test_request_metadata_reaches_the_runtime
IMAGES_API = "containerd.services.images.v1.Images"
ENGINES: dict[str, dict[str, object]] = {"relay": settings(allowed_services=[IMAGES_API]),
                                         "grpc": settings(engine="grpc", allowed_services=[IMAGES_API])}


# --------------------------------------------------------------------------- fixtures


class ShimSets:
    """One shim per engine in front of each session runtime, started on first use and kept
    for the whole module."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.factories: dict[str, ShimFactory] = {}
        self.sets: dict[str, dict[str, ShimProcess]] = {}

    def get(self, name: str, socket: str | os.PathLike[str]) -> dict[str, ShimProcess]:
        if name not in self.sets:
            factory = self.factories[name] = ShimFactory(lambda: str(socket), self.log_dir / name)
            self.sets[name] = {engine: factory(config) for engine, config in ENGINES.items()}
        return self.sets[name]

    def close(self) -> None:
        problems = [p for f in self.factories.values() for p in f.close()]
        assert not problems, problems
        for running in self.sets.values():
            for s in running.values():
                assert_clean_log(s)


@pytest.fixture(scope="module")
def shim_sets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimSets]:
    sets = ShimSets(tmp_path_factory.mktemp("shims"))
    yield sets
    sets.close()


@pytest.fixture
def shims(shim_sets: ShimSets, containerd: Containerd) -> dict[str, ShimProcess]:
    """One shim per engine in front of the session containerd, for the whole module."""
    return shim_sets.get("containerd-1.6", containerd.socket)


@pytest.fixture(params=list(ENGINES))
def shim(request: pytest.FixtureRequest, shims: dict[str, ShimProcess]) -> ShimProcess:
    """The shared shim of each engine in turn (default engine first)."""
    s = shims[request.param]
    assert s.running, f"the {request.param} shim died:\n{s.log_tail()}"
    return s


@pytest.fixture(params=["containerd-1.6", CRIO])
def runtime(request: pytest.FixtureRequest) -> CriRuntime:
    """The session containerd, then the session CRI-O."""
    return runtime_named(request, request.param)


@pytest.fixture(params=list(ENGINES))
def runtime_shim(request: pytest.FixtureRequest, shim_sets: ShimSets, runtime: CriRuntime) -> ShimProcess:
    """The shared shim of each engine in turn, in front of ``runtime``."""
    s = shim_sets.get(runtime.name, runtime.socket)[request.param]
    assert s.running, f"the {request.param} shim in front of {runtime.name} died:\n{s.log_tail()}"
    return s


@pytest.fixture
def relay_shim(shims: dict[str, ShimProcess]) -> ShimProcess:
    """The shared shim with the default engine."""
    assert shims["relay"].running, shims["relay"].log_tail()
    return shims["relay"]


# --------------------------------------------------------------------------- helpers


def assert_clean_log(shim: ShimProcess) -> None:
    """No traceback and no error line in the shim's log."""
    bad = [line for line in shim.log_text().splitlines() if "Traceback" in line or "level=error" in line]
    assert not bad, f"{shim.log_path}:\n" + "\n".join(bad[:10])


def outcome(res: cri.CallResult) -> tuple[str, str | None, bytes | None, cri.Metadata]:
    """Everything a CRI client can see of a unary call."""
    return res.code.name, res.details, res.response, res.trailing_metadata


def same_call(
    shim: ShimProcess, runtime: Containerd | CriRuntime, method: str, request: bytes, timeout: float = 10,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> tuple[cri.CallResult, cri.CallResult]:
    """Call the runtime directly, then through the shim; assert identical outcomes."""
    direct = cri.call(runtime.socket, method, request, timeout, metadata=metadata)
    via = cri.call(shim.socket, method, request, timeout, metadata=metadata)
    assert outcome(via) == outcome(direct), f"{method}: shim and runtime differ"
    return direct, via


def stream_call(socket_path: str | os.PathLike[str], method: str, request: bytes,
                timeout: float = 5) -> tuple[list[bytes], str, str | None]:
    """A raw server-streaming call: (messages, status code name, details)."""
    with grpc.insecure_channel(cri.target(socket_path)) as channel:
        it = channel.unary_stream(cri.method_path(method))(request, timeout=timeout)
        messages: list[bytes] = []
        try:
            for m in it:
                messages.append(m)
        except grpc.RpcError as e:
            return messages, e.code().name, e.details()  # type: ignore[attr-defined]
        return messages, it.code().name, it.details()  # type: ignore[attr-defined]


def repeated_entries(response: bytes, number: int = 1) -> list[bytes]:
    """The raw entries of repeated message field ``number``, sorted; asserts nothing else is there."""
    fields = cri.decode(response)
    assert set(fields) <= {number}, fields.keys()
    return sorted(fields.get(number, []))  # type: ignore[arg-type]


def status_info(response: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """StatusResponse: (status field bytes, sorted info map entries)."""
    fields = cri.decode(response)
    entries = []
    for e in fields.get(2, []):
        kv = cri.decode(e)  # type: ignore[arg-type]
        entries.append((kv.get(1, [b""])[0], kv.get(2, [b""])[0]))
    return b"".join(fields.get(1, [])), sorted(entries)  # type: ignore[arg-type]


def without_timestamps(response: bytes) -> bytes:
    """ImageFsInfoResponse with every FilesystemUsage.timestamp cleared."""
    msg = api_pb2.ImageFsInfoResponse.FromString(response)
    for usage in (*msg.image_filesystems, *msg.container_filesystems):
        usage.timestamp = 0
    return msg.SerializeToString()


def pull(socket_path: str | os.PathLike[str], ref: str, timeout: float = 60) -> cri.CallResult:
    return cri.call(socket_path, "PullImage", cri.pull_image_request(ref), timeout)


# --------------------------------------------------------------------------- runtime service


def test_version_identical(runtime_shim: ShimProcess, runtime: CriRuntime) -> None:
    shim = runtime_shim
    direct, _ = same_call(shim, runtime, "Version", cri.version_request())
    version = cri.decode_version_response(direct.unwrap())
    assert version["runtime_name"] == runtime.runtime_name
    if runtime.is_crio:
        assert version["runtime_version"] == "1.34.0"
        return
    # The older CRI version containerd 1.6 still serves: the shim answers as containerd 2.x does.
    v1alpha2 = "/runtime.v1alpha2.RuntimeService/Version"
    assert cri.call(runtime.socket, v1alpha2, cri.version_request(), 10).ok
    via = cri.call(shim.socket, v1alpha2, cri.version_request(), 10)
    assert via.error_tuple() == (grpc.StatusCode.UNIMPLEMENTED, "unknown service runtime.v1alpha2.RuntimeService")


def test_status_identical(runtime_shim: ShimProcess, runtime: CriRuntime) -> None:
    shim, containerd = runtime_shim, runtime
    direct, _ = same_call(shim, runtime, "Status", b"")
    assert b"RuntimeReady" in direct.unwrap()
    if runtime.is_crio:
        return
    # verbose: containerd writes the info map in Go's random map order (two direct
    # calls differ in byte order too), so entries are compared as a set.
    verbose = cri.field_varint(1, 1)
    direct = cri.call(containerd.socket, "Status", verbose, 10)
    via = cri.call(shim.socket, "Status", verbose, 10)
    assert direct.ok and via.ok, (direct, via)
    assert status_info(via.unwrap()) == status_info(direct.unwrap())
    assert {k for k, _ in status_info(direct.unwrap())[1]} >= {b"config", b"golang"}


@pytest.mark.parametrize("method, request_bytes", [
    ("ListContainers", b""),
    ("ListPodSandbox", b""),
    ("ListContainerStats", b""),
    ("ListPodSandboxStats", b""),
    ("RuntimeConfig", b""),  # containerd 1.6: UNIMPLEMENTED
    ("ContainerStatus", cri.field_bytes(1, "no-such-container")),  # NOT_FOUND
    ("PodSandboxStatus", cri.field_bytes(1, "no-such-sandbox")),  # NOT_FOUND
    ("StopPodSandbox", cri.field_bytes(1, "no-such-sandbox")),  # NOT_FOUND
])
def test_runtime_calls_identical(shim: ShimProcess, containerd: Containerd, method: str, request_bytes: bytes) -> None:
    direct, _ = same_call(shim, containerd, method, request_bytes)
    expected = {"RuntimeConfig": "UNIMPLEMENTED", "ContainerStatus": "NOT_FOUND",
                "PodSandboxStatus": "NOT_FOUND", "StopPodSandbox": "NOT_FOUND"}.get(method, "OK")
    assert direct.code.name == expected, direct


# --------------------------------------------------------------------------- image service


def test_image_lifecycle_identical(
    runtime_shim: ShimProcess, runtime: CriRuntime, make_image, proxy: CountingProxy
) -> None:
    shim, containerd = runtime_shim, runtime
    img = make_image()
    image_id = runtime.image_id(img)  # CRI-O: the bare hex
    # Pull through the shim: the real download happens via the shim.
    pulled = pull(shim.socket, img.ref)
    assert pulled.ok, pulled
    assert cri.decode_pull_image_response(pulled.response) == runtime.pulled_ref(img)  # CRI-O: repo@digest
    assert proxy.stats().blob_requests_for(img.repository, img.tag) == 2  # config + layer, once
    # The same pull directly (image present now) answers the same bytes.
    assert pull(containerd.socket, img.ref).response == pulled.response
    # ...and the same pull through the shim again: also identical.
    assert pull(shim.socket, img.ref).response == pulled.response

    names = (img.ref, img.digest_ref, image_id, image_id[:12]) if runtime.is_crio else (img.ref, img.digest_ref, image_id)
    for ref in names:
        for verbose in (False, True):
            direct, _ = same_call(shim, containerd, "ImageStatus", cri.image_status_request(ref, verbose))
            info = cri.decode_image_status_response(direct.unwrap())
            assert info is not None and info.id == image_id, ref
            if runtime.is_crio:
                assert info.repo_tags == [img.ref] and info.repo_digests == [img.digest_ref]
    if runtime.is_crio:  # "sha256:<hex>" is not an ID to CRI-O: no such image, directly and through the shim
        direct, _ = same_call(shim, containerd, "ImageStatus", cri.image_status_request(img.image_id))
        assert cri.decode_image_status_response(direct.unwrap()) is None

    # containerd lists images in Go map order (two direct calls differ once there are
    # several): the same Image messages, byte for byte, in any order. (CRI-O: in order.)
    for request in (cri.list_images_request(), cri.list_images_request(img.ref)):
        if runtime.is_crio:
            direct, _ = same_call(shim, containerd, "ListImages", request)
        else:
            direct = cri.call(containerd.socket, "ListImages", request, 10)
            via = cri.call(shim.socket, "ListImages", request, 10)
            assert direct.ok and via.ok, (direct, via)
            assert repeated_entries(via.unwrap()) == repeated_entries(direct.unwrap())
        assert image_id in {i.id for i in cri.decode_list_images_response(direct.unwrap())}

    # ImageFsInfo carries the time of the call; everything else must match.
    direct = cri.call(containerd.socket, "ImageFsInfo", b"", 10)
    via = cri.call(shim.socket, "ImageFsInfo", b"", 10)
    assert direct.ok and via.ok, (direct, via)
    assert without_timestamps(via.unwrap()) == without_timestamps(direct.unwrap())
    mount = api_pb2.ImageFsInfoResponse.FromString(via.unwrap()).image_filesystems[0].fs_id.mountpoint
    assert mount
    if runtime.is_crio:
        assert mount.startswith(str(runtime.instance.root))

    # RemoveImage through the shim removes it for everyone.
    removed = cri.call(shim.socket, "RemoveImage", cri.remove_image_request(img.ref), 10)
    assert removed.ok and removed.response == b"", removed
    direct, _ = same_call(shim, containerd, "ImageStatus", cri.image_status_request(img.ref))
    assert cri.decode_image_status_response(direct.unwrap()) is None
    # Removing what is gone: containerd says OK; so does the shim.
    same_call(shim, containerd, "RemoveImage", cri.remove_image_request(img.ref))


#: case -> the runtime's own code, per runtime (a case is run for the runtimes it names)
ERROR_CODES: dict[str, dict[str, str]] = {
    "pull-missing-tag": {"containerd-1.6": "NOT_FOUND", "crio": "UNKNOWN"},
    "pull-missing-repo": {"containerd-1.6": "NOT_FOUND", "crio": "UNKNOWN"},
    "pull-bad-reference": {"containerd-1.6": "UNKNOWN", "crio": "UNKNOWN"},
    "status-undecodable": {"containerd-1.6": "INTERNAL"},
    "remove-undecodable": {"containerd-1.6": "INTERNAL"},
    "remove-bad-reference": {"containerd-1.6": "OK"},
    "list-undecodable": {"containerd-1.6": "INTERNAL", "crio": "INTERNAL"},
    "status-absent": {"containerd-1.6": "OK", "crio": "OK"},
    "remove-absent": {"crio": "OK"},
    "remove-sha256-id": {"crio": "OK"},
}


@pytest.mark.parametrize("runtime, case", [
    pytest.param(rt, case, marks=[pytest.mark.crio] if rt == "crio" else [], id=f"{case}-{rt}")
    for case, codes in ERROR_CODES.items() for rt in codes
], indirect=["runtime"])
def test_runtime_errors_identical(
    runtime_shim: ShimProcess, runtime: CriRuntime, registry: RegistryWithProxy, make_image, case: str
) -> None:
    shim = runtime_shim

    def missing_tag() -> str:  # a repository that exists, a tag that doesn't
        return make_image(tag="present").ref.rsplit(":", 1)[0] + ":absent"

    method, request = {
        "pull-missing-tag": lambda: ("PullImage", cri.pull_image_request(missing_tag())),
        "pull-missing-repo": lambda: ("PullImage", cri.pull_image_request(f"{registry.host}/e2e/never-pushed:v1")),
        "pull-bad-reference": lambda: ("PullImage", cri.pull_image_request("garbage!!!")),
        "status-undecodable": lambda: ("ImageStatus", b"\xff\xff\xff"),
        "remove-undecodable": lambda: ("RemoveImage", b"\x0a\x05\x0a"),
        "remove-bad-reference": lambda: ("RemoveImage", cri.remove_image_request("garbage!!!")),
        "list-undecodable": lambda: ("ListImages", b"\x0a\x7f"),
        "status-absent": lambda: ("ImageStatus", cri.image_status_request(missing_tag())),
        "remove-absent": lambda: ("RemoveImage", cri.remove_image_request(missing_tag())),
        "remove-sha256-id": lambda: ("RemoveImage", cri.remove_image_request("sha256:" + "ab" * 32)),
    }[case]()
    direct, _ = same_call(shim, runtime, method, request, timeout=30)
    assert direct.code.name == ERROR_CODES[case][runtime.name], direct
    if case.startswith("pull-missing"):
        assert ("manifest unknown" if runtime.is_crio else "not found") in (direct.details or "")


@pytest.mark.parametrize("request_bytes, containerd_code", [
    (b"\xff\xff", "INTERNAL"),  # undecodable
    (cri.pull_image_request(""), "UNKNOWN"),  # no image
])
def test_malformed_pull_is_refused_by_the_shim(
    shim: ShimProcess, containerd: Containerd, request_bytes: bytes, containerd_code: str
) -> None:
    """PullImage is decoded by the shim (scheduler key), so a request it cannot use is
    refused by the shim itself: INVALID_ARGUMENT with a ``cri-shim:`` message, where
    containerd answers INTERNAL/UNKNOWN.  Documented difference, by design."""
    direct = cri.call(containerd.socket, "PullImage", request_bytes, 10)
    via = cri.call(shim.socket, "PullImage", request_bytes, 10)
    assert direct.code.name == containerd_code, direct
    assert via.code == grpc.StatusCode.INVALID_ARGUMENT, via
    assert (via.details or "").startswith("cri-shim: ") and "PullImageRequest" in via.details


# --------------------------------------------------------------------------- unknown methods, streams


@pytest.mark.parametrize("method", [
    "/runtime.v1.ImageService/NoSuchMethod",
    "/runtime.v1.RuntimeService/NoSuchMethod",
])
def test_unknown_method_identical(runtime_shim: ShimProcess, runtime: CriRuntime, method: str) -> None:
    direct, _ = same_call(runtime_shim, runtime, method, b"\x0a\x03abc")
    assert direct.code == grpc.StatusCode.UNIMPLEMENTED, direct


def test_server_streaming_method_identical(shim: ShimProcess, containerd: Containerd) -> None:
    method = "/runtime.v1.RuntimeService/GetContainerEvents"
    direct = stream_call(containerd.socket, method, b"")
    via = stream_call(shim.socket, method, b"")
    assert via == direct
    assert direct[:2] == ([], "UNIMPLEMENTED"), direct


def test_request_metadata_reaches_the_runtime(shim: ShimProcess, containerd: Containerd, make_image) -> None:
    """containerd's own API (same socket) scopes every call by the namespace in the
    request metadata: through the shim it must see the metadata exactly as directly."""
    img = make_image()
    assert pull(containerd.socket, img.ref).ok
    images = f"/{IMAGES_API}/List"
    request = cri.field_bytes(1, f"name=={img.ref}")  # ListImagesRequest.filters
    found, _ = same_call(shim, containerd, images, request, metadata=(("containerd-namespace", "k8s.io"),))
    assert found.ok and img.manifest_digest.encode() in found.unwrap(), found
    other, _ = same_call(shim, containerd, images, request, metadata=(("containerd-namespace", "elsewhere"),))
    assert other.ok and other.response == b"", other
    refused, _ = same_call(shim, containerd, images, request)
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "namespace" in (refused.details or "")


# --------------------------------------------------------------------------- deadlines, cancellation


def _assert_download_stops(proxy: CountingProxy) -> None:
    """Assert the registry download stops: no blob GET in flight, no byte more for 0.5 s."""
    wait_for(lambda: proxy.stats().inflight_blob_gets == 0, 5, "blob download stops after the pull ended")
    before = proxy.stats().blob_bytes
    time.sleep(0.5)
    assert proxy.stats().blob_bytes == before


@pytest.mark.parametrize("where", ["direct", *ENGINES])
def test_pull_deadline_cancels_the_download(
    shims: dict[str, ShimProcess], containerd: Containerd, make_image, proxy: CountingProxy, where: str
) -> None:
    """A PullImage with a 1.5 s deadline against a throttled registry (the layer needs
    ~12 s) fails DEADLINE_EXCEEDED, directly and through the shim, and containerd
    stops downloading."""
    target = containerd.socket if where == "direct" else shims[where].socket
    img = make_image(filler_bytes=3_000_000)
    with proxy.throttled(250_000):
        t0 = time.monotonic()
        res = pull(target, img.ref, timeout=1.5)
        elapsed = time.monotonic() - t0
        assert res.code == grpc.StatusCode.DEADLINE_EXCEEDED, res
        assert elapsed < 3, elapsed
        assert proxy.stats().blob_requests_for(img.repository, img.tag) >= 1, "the download never started"
        _assert_download_stops(proxy)
    assert proxy.stats().blob_bytes < img.image.size / 2
    assert cri.decode_image_status_response(
        cri.call(containerd.socket, "ImageStatus", cri.image_status_request(img.ref), 10).unwrap()) is None


def test_cancelled_pull_cancels_the_download(shim: ShimProcess, containerd: Containerd, make_image,
                                             proxy: CountingProxy) -> None:
    """A client giving up on a pull (no deadline) through the shim stops containerd's download."""
    img = make_image(filler_bytes=3_000_000)
    with proxy.throttled(250_000), grpc.insecure_channel(cri.target(shim.socket)) as channel:
        future = channel.unary_unary(cri.method_path("PullImage")).future(cri.pull_image_request(img.ref))
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=10)
        time.sleep(0.3)
        assert future.cancel()
        _assert_download_stops(proxy)
    assert proxy.stats().blob_bytes < img.image.size / 2
    assert cri.decode_image_status_response(
        cri.call(containerd.socket, "ImageStatus", cri.image_status_request(img.ref), 10).unwrap()) is None


# --------------------------------------------------------------------------- runtime away and back


def _version(channel: grpc.Channel, timeout: float = 2) -> grpc.StatusCode:
    try:
        channel.unary_unary(cri.method_path("Version"))(cri.version_request(), timeout=timeout)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK


@pytest.mark.parametrize("engine", list(ENGINES))
def test_shim_started_before_containerd(engine: str, containerd_factory, shim_factory, make_image) -> None:
    ctd = containerd_factory(start=False)
    shim = shim_factory(ENGINES[engine], upstream=ctd.socket)
    with grpc.insecure_channel(cri.target(shim.socket)) as kubelet:  # one long-lived channel, like kubelet
        for _ in range(3):
            t0 = time.monotonic()
            res = cri.call(shim.socket, "Version", cri.version_request(), timeout=5)
            assert res.code == grpc.StatusCode.UNAVAILABLE, res
            assert time.monotonic() - t0 < 1.0, "UNAVAILABLE must come at once, not at the deadline"
            assert _version(kubelet) == grpc.StatusCode.UNAVAILABLE
        ctd.start()
        t0 = time.monotonic()
        wait_for(lambda: _version(kubelet) == grpc.StatusCode.OK, 5, "shim serves once containerd is up")
        took = time.monotonic() - t0
    # An intercepted call right away works too (the shim's own channel to containerd).
    img = make_image()
    assert cri.decode_pull_image_response(pull(shim.socket, img.ref).unwrap()) == img.image_id
    print(f"{engine}: served {took:.2f}s after containerd was ready")
    assert_clean_log(shim)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_containerd_restarted_under_the_shim(engine: str, containerd_factory, shim_factory, make_image) -> None:
    ctd = containerd_factory()
    shim = shim_factory(ENGINES[engine], upstream=ctd.socket)
    img = make_image()
    assert pull(shim.socket, img.ref).ok
    with grpc.insecure_channel(cri.target(shim.socket)) as kubelet:
        assert _version(kubelet) == grpc.StatusCode.OK
        for how in ("stop", "kill"):
            getattr(ctd, how)()
            t0 = time.monotonic()
            assert _version(kubelet, timeout=5) == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t0 < 1.0
            ctd.start()
            t0 = time.monotonic()
            wait_for(lambda: _version(kubelet) == grpc.StatusCode.OK, 5, f"shim serves after containerd {how}")
            took = time.monotonic() - t0
            print(f"{engine}: served {took:.2f}s after containerd restart ({how})")
            status = cri.call(shim.socket, "ImageStatus", cri.image_status_request(img.ref), 10)
            assert cri.decode_image_status_response(status.unwrap()).id == img.image_id
            fresh = make_image()  # an intercepted call right away works too
            assert cri.decode_pull_image_response(pull(shim.socket, fresh.ref).unwrap()) == fresh.image_id
    assert shim.running
    assert_clean_log(shim)


# --------------------------------------------------------------------------- the socket


def test_socket_mode_is_0660(relay_shim: ShimProcess, shims: dict[str, ShimProcess]) -> None:
    for s in shims.values():
        assert stat.S_IMODE(os.stat(s.socket).st_mode) == 0o660, s.socket
        assert stat.S_ISSOCK(os.stat(s.socket).st_mode)


def test_socket_mode_is_configurable(shim_factory) -> None:
    shim = shim_factory(settings(socket_mode="0600"))
    assert stat.S_IMODE(os.stat(shim.socket).st_mode) == 0o600


def test_stale_socket_is_replaced(shim_factory, containerd: Containerd) -> None:
    shim = shim_factory(settings(), start=False)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(shim.socket))  # bound, never listening, then closed: what a crash leaves
    stale.close()
    assert stat.S_ISSOCK(os.lstat(shim.socket).st_mode)
    shim.start()
    assert stat.S_IMODE(os.stat(shim.socket).st_mode) == 0o660
    same_call(shim, containerd, "Version", cri.version_request())
    assert "replaced stale socket" in shim.log_text()


def test_live_socket_and_non_socket_are_not_taken_over(shim_factory, tmp_path: Path) -> None:
    first = shim_factory(settings())
    second = ShimProcess(tmp_path / "second", upstream=first.upstream, socket_path=first.socket, config=settings())
    second.start(wait=False)  # (the socket accepts at once: it is the first shim's)
    assert second.wait(10) == 1
    assert re.search(r"another process.* is already serving on " + re.escape(str(first.socket)), second.log_text())
    assert cri.call(first.socket, "Version", cri.version_request(), 5).ok, "the first shim must keep serving"

    third = shim_factory(settings(), start=False)
    third.socket.write_text("not a socket")
    with pytest.raises(RuntimeError, match="exited with 1"):
        third.start(timeout=10)
    assert "is not a socket" in third.log_text()
    assert third.socket.read_text() == "not a socket"
