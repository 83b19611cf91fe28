"""Every spelling of a CRI method that the runtime routes is enforced through the shim, and
the shim serves CRI only (tests/support/routing_table.py has the table and what it asserts).

containerd 1.6 (Debian's, grpc-go 1.4x) routes ``runtime.v1.ImageService/RemoveImage``
without the leading ``/`` and serves runtime.v1alpha2; containerd 2.4 (grpc-go 1.83) answers
both UNIMPLEMENTED; CRI-O v1.34 (grpc-go 1.72) routes a path without the leading ``/`` and
has no runtime.v1alpha2 (the ``crio`` cases). ``ctr`` pointed at the shim's socket is
refused: containerd's own API (namespaces, images, content, ...) does not pass by default.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.support import cri, h2raw, routing_table
from tests.support.containerd import Containerd
from tests.support.fixtures import CRIO, CriRuntime, runtime_named

# (marked e2e by the folder, the CRI-O cases crio: tests/conftest.py)


@pytest.fixture(params=["containerd-1.6", "containerd-2", CRIO])
def runtime(request: pytest.FixtureRequest) -> CriRuntime:
    return runtime_named(request, request.param)


@pytest.fixture
def runtime_socket(runtime: CriRuntime) -> str:
    return str(runtime.socket)


@pytest.mark.parametrize("engine", ["relay", "grpc"])
def test_remove_pinned_image_under_every_spelling(runtime_socket, make_image, shim_factory, engine) -> None:
    routing_table.remove_pinned_table(runtime_socket, shim_factory, make_image, engine)


@pytest.mark.parametrize("engine", ["relay", "grpc"])
def test_pull_under_every_spelling_goes_through_the_scheduler(runtime_socket, make_image, shim_factory,
                                                              engine) -> None:
    routing_table.pull_table(runtime_socket, shim_factory, make_image, engine)


@pytest.mark.parametrize("engine", ["relay", "grpc"])
def test_removal_by_one_tag_leaves_what_the_runtime_leaves(runtime: CriRuntime, make_image, registry, shim_factory,
                                                           engine) -> None:
    left = routing_table.assert_removal_by_tag_as_the_runtime_does(
        str(runtime.socket), shim_factory, make_image, registry, engine)
    assert left == (["v2"] if runtime.is_crio else [])  # CRI-O untags only; containerd removes every tag


@pytest.mark.parametrize("engine", ["relay", "grpc"])
def test_ctr_images_rm_through_the_shim_is_refused(containerd: Containerd, make_image, shim_factory,
                                                   engine) -> None:
    img = make_image()
    assert routing_table.pull(containerd.socket, img).ok
    shim = shim_factory({"server": {"admin_socket": "", "engine": engine}})
    out = subprocess.run(["ctr", "--address", str(shim.socket), "-n", "k8s.io", "images", "rm", img.ref],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, out
    assert "is not a CRI service" in out.stderr and "server.allowed_services" in out.stderr, out.stderr
    assert routing_table.present(containerd.socket, img)
    # CRI itself is served on the same socket
    assert cri.call(shim.socket, "ImageStatus", cri.image_status_request(img.ref), 10).ok


@pytest.mark.parametrize("header", [(b"x-trace-bin", b"!!not base64!!"), (b"grpc-timeout", b"5x")],
                         ids=["bad-bin", "bad-timeout"])
def test_malformed_headers_answered_as_current_grpc_go_answers_them(runtime_socket, shim_factory, header) -> None:
    """A call the shim answers itself (PullImage) with a header grpc-go cannot parse gets INTERNAL
    "malformed ...", as containerd 2.4 answers it (measured: containerd 1.6 ignores a bad -bin value
    and serves the call, and resets the stream on a bad grpc-timeout)."""
    body = h2raw.grpc_message(cri.pull_image_request("registry.invalid/x:1"))

    def answer(path: str) -> list[tuple[int, int, dict[bytes, bytes] | bytes]]:
        with h2raw.RawH2(path) as c:
            c.send(h2raw.headers(1, h2raw.request_block("/runtime.v1.ImageService/PullImage", [header]),
                                 end_stream=False) + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, 1, body))
            _, frames = c.read_until(lambda f: f.stream_id == 1 and (f.flags & h2raw.END_STREAM
                                                                       or f.type == h2raw.RST_STREAM), timeout=10)
            return [(f.type, f.flags, c.decode_headers(f) if f.type == h2raw.HEADERS else f.payload)
                    for f in frames if f.stream_id == 1]

    shim = shim_factory({"server": {"admin_socket": ""}}, upstream=runtime_socket)
    direct, via = answer(runtime_socket), answer(str(shim.socket))
    print(f"\n{header}: direct {direct}\n  via {via}")
    status = via[-1][2]
    assert isinstance(status, dict) and status[b"grpc-status"] == b"13" and status[b"grpc-message"].startswith(b"malformed ")
