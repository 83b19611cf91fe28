"""Pinned images end to end: the shim as a process in front of real containerd.

A pinned image survives RemoveImage by tag, by digest and by ID, by a shortened ID and by
``""`` (which containerd resolves to its only image), and ``crictl rmi``;
ListImages/ImageStatus and ``crictl images --pinned`` show it pinned; an unpinned
image is removable; a reload (SIGHUP or a change of the config file) that unpins
makes it removable, and a bad new config keeps the pins in force.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from tests.support import cri
from tests.support.containerd import Containerd
from tests.support.crictl import Crictl
from tests.support.fixtures import CRIO, RUNTIMES, CriRuntime
from tests.support.oci import PushedImage
from tests.support.other_uid import NOBODY, require_root, run_as, shared_dir
from tests.support.shim import new_shim
from tests.support.wait import wait_for_blocking as wait_for

# (marked e2e by the folder, the CRI-O cases crio: tests/conftest.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pull(runtime: Containerd | CriRuntime, img: PushedImage) -> None:
    res = cri.call(runtime.socket, "PullImage", cri.pull_image_request(img.ref), timeout=60)
    assert res.ok, res


def present(runtime: Containerd | CriRuntime, name: str) -> bool:
    """Asked of the runtime itself, not through the shim."""
    return present_at(runtime.socket, name)


def present_at(socket_path: str | Path, name: str) -> bool:
    res = cri.call(socket_path, "ImageStatus", cri.image_status_request(name))
    return cri.decode_image_status_response(res.unwrap()) is not None


def remove(shim, name: str) -> cri.CallResult:
    return cri.call(shim.socket, "RemoveImage", cri.remove_image_request(name))


def listed(shim) -> dict[str, bool]:
    res = cri.call(shim.socket, "ListImages", cri.list_images_request())
    return {i.id: i.pinned for i in cri.decode_list_images_response(res.unwrap())}


def crictl_pinned(crictl: Crictl) -> dict[str, bool]:
    out = crictl.images("--pinned", "-o", "json")
    assert out.returncode == 0, out.stderr
    return {i["id"]: bool(i.get("pinned")) for i in json.loads(out.stdout)["images"]}


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture(params=["relay", "grpc"])
def engine(request) -> str:
    return request.param


def test_pinned_image_survives_remove_by_tag_digest_and_id(containerd, make_image, shim_factory, engine) -> None:
    img, other = make_image(), make_image()
    pull(containerd, img)
    pull(containerd, other)
    port = free_port()
    shim = shim_factory({"server": {"engine": engine}, "pins": {"images": [img.ref]},
                         "metrics": {"address": f"127.0.0.1:{port}"}})

    for name in (img.ref, img.digest_ref, img.image_id):
        res = remove(shim, name)
        assert res.code is grpc.StatusCode.FAILED_PRECONDITION, (name, res)
        assert res.details.startswith("cri-shim: ") and name in res.details
        assert f"pins.images entry '{img.ref}'" in res.details
        assert present(containerd, img.ref)
    assert metric(port, "cri_shim_remove_denied_total") == 3

    status = cri.decode_image_status_response(
        cri.call(shim.socket, "ImageStatus", cri.image_status_request(img.image_id)).unwrap())
    assert status is not None and status.pinned
    assert listed(shim)[img.image_id] is True
    assert listed(shim)[other.image_id] is False

    # without the shim containerd reports neither as pinned, and still removes on request
    direct = {i.id: i.pinned for i in cri.decode_list_images_response(
        cri.call(containerd.socket, "ListImages", cri.list_images_request()).unwrap())}
    assert direct[img.image_id] is False

    assert remove(shim, other.ref).ok
    assert not present(containerd, other.ref)


@pytest.mark.parametrize("cri_runtime", ["containerd-1.6", CRIO], indirect=True)
def test_crictl_rmi_and_images_pinned(cri_runtime: CriRuntime, make_image, shim_factory, crictl_factory,
                                      engine) -> None:
    img, other = make_image(), make_image()
    shim = shim_factory({"server": {"engine": engine}, "pins": {"images": [f"{img.repo_ref}:*"]}},  # a glob
                        upstream=cri_runtime.socket)
    crictl = crictl_factory(shim.socket)
    for i in (img, other):
        out = crictl.pull(i.ref)
        assert out.returncode == 0, out.stderr

    img_id, other_id = cri_runtime.image_id(img), cri_runtime.image_id(other)
    pinned = crictl_pinned(crictl)
    assert pinned[img_id] is True and pinned[other_id] is False
    assert crictl_pinned(crictl_factory(cri_runtime.socket))[img_id] is False  # the runtime alone: not pinned

    short_id = img.image_id.removeprefix("sha256:")[:13]  # the ID `crictl images` shows
    for name in (img.ref, short_id) if cri_runtime.is_crio else (img.ref,):
        out = crictl.rmi(name)
        assert out.returncode != 0, (name, out)
        assert "FailedPrecondition" in out.stderr and "is pinned by pins.images entry" in out.stderr, out.stderr
    assert present(cri_runtime, img.ref)

    out = crictl.rmi(other.ref)
    assert out.returncode == 0, out.stderr
    assert not present(cri_runtime, other.ref)


def test_reload_unpins_and_bad_config_keeps_pins(containerd, make_image, shim_factory) -> None:
    a, b = make_image(), make_image()
    pull(containerd, a)
    pull(containerd, b)
    shim = shim_factory({"pins": {"images": [a.digest_ref, b.ref]}})
    assert remove(shim, a.ref).code is grpc.StatusCode.FAILED_PRECONDITION

    # a bad new config: rejected with a log line naming the key, old pins stay
    shim.write_config({"pins": {"images": [a.digest_ref, "Not:A:Ref"]}})
    shim.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "config reload rejected" in shim.log_text())
    assert "pins.images[1]" in shim.log_text()
    assert remove(shim, a.ref).code is grpc.StatusCode.FAILED_PRECONDITION
    assert remove(shim, b.ref).code is grpc.StatusCode.FAILED_PRECONDITION

    # SIGHUP with a config that unpins a
    shim.write_config({"pins": {"images": [b.ref]}})
    shim.send_signal(signal.SIGHUP)
    assert wait_for(lambda: listed(shim)[a.image_id] is False)
    assert remove(shim, a.ref).ok
    assert not present(containerd, a.ref)
    assert remove(shim, b.image_id).code is grpc.StatusCode.FAILED_PRECONDITION

    # no signal: the shim notices the file changed
    shim.write_config({"pins": {"images": []}})
    assert wait_for(lambda: listed(shim)[b.image_id] is False)
    assert remove(shim, b.image_id).ok
    assert not present(containerd, b.ref)


def test_mark_only_marks_and_removes(containerd, make_image, shim_factory) -> None:
    img = make_image()
    pull(containerd, img)
    shim = shim_factory({"pins": {"images": [img.ref], "mode": "mark-only"}})
    assert listed(shim)[img.image_id] is True
    assert remove(shim, img.ref).ok
    assert not present(containerd, img.ref)
    assert "removing a pinned image" in shim.log_text()


@pytest.mark.parametrize("cri_runtime", RUNTIMES, indirect=True)
def test_unknown_image_answered_as_the_runtime_answers(cri_runtime: CriRuntime, shim_factory) -> None:
    """The shim answers a RemoveImage of a name the runtime does not know itself (never sending it on):
    the same answer the runtime gives, for a tag, a digest reference and an ID."""
    shim = shim_factory({"pins": {"images": ["registry.k8s.io/pause:*"]}}, upstream=cri_runtime.socket)
    for name in ("example.invalid/nothing:here", "example.invalid/nothing@sha256:" + "40" * 32, "sha256:" + "41" * 32):
        via_shim = remove(shim, name)
        direct = cri.call(cri_runtime.socket, "RemoveImage", cri.remove_image_request(name))
        assert (via_shim.code, via_shim.details, via_shim.response) == (direct.code, direct.details, direct.response)
        assert via_shim.ok and via_shim.response == b""


RACE_TRIALS = 100
RACE_BUDGET_SECONDS = 240.0  # the whole race test; each trial takes well under a second


@pytest.mark.parametrize("cri_runtime", RUNTIMES, indirect=True)
def test_remove_racing_a_direct_pull_never_removes_the_pinned_image(cri_runtime: CriRuntime, make_image,
                                                                   shim_factory, engine) -> None:
    """RemoveImage of a pinned name in a loop through the shim while the name is pulled straight from
    the runtime: the removes that find nothing are answered without reaching the runtime, so the pull
    that lands between one's lookup and its removal is never removed."""
    img = make_image()
    shim = shim_factory({"server": {"engine": engine}, "pins": {"images": [img.ref]}}, upstream=cri_runtime.socket)
    removed = straddled = 0
    deadline = time.monotonic() + RACE_BUDGET_SECONDS
    with grpc.insecure_channel(cri.target(shim.socket)) as channel:
        remove_call = channel.unary_unary(cri.method_path("RemoveImage"))
        request = cri.remove_image_request(img.ref)
        for trial in range(RACE_TRIALS):
            assert time.monotonic() < deadline, f"{trial} trials in {RACE_BUDGET_SECONDS:g} s"
            assert cri.call(cri_runtime.socket, "RemoveImage", request).ok  # straight to the runtime: absent
            assert not present(cri_runtime, img.ref)
            pulled = threading.Event()
            answers: list[grpc.StatusCode] = []

            def remove_in_a_loop() -> None:
                after = 0
                while after < 3 and time.monotonic() < deadline:  # a few more once the pull has landed
                    try:
                        remove_call(request, timeout=10)
                        answers.append(grpc.StatusCode.OK)
                    except grpc.RpcError as e:
                        answers.append(e.code())  # type: ignore[attr-defined]
                    after += pulled.is_set()

            remover = threading.Thread(target=remove_in_a_loop, name=f"remove-{trial}")
            remover.start()
            try:
                pull(cri_runtime, img)
            finally:
                pulled.set()
                remover.join(timeout=30)
            assert not remover.is_alive()
            assert set(answers) <= {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION}, answers
            straddled += answers[0] is grpc.StatusCode.OK and grpc.StatusCode.FAILED_PRECONDITION in answers
            removed += not present(cri_runtime, img.ref)
    assert removed == 0, f"{removed} of {RACE_TRIALS} pulls removed"
    assert straddled >= RACE_TRIALS // 2, f"only {straddled} trials had a remove before and after the pull landed"


def remove_all_unpinned_then(socket_path: str, first: list[str], names: list[str]) -> dict:
    """(Runs as any uid.) RemoveImage, through the shim, of each of ``first``, of every image it then
    lists unpinned (by ID), then of each of ``names``; the answers as [code, details, response hex]. (grpc.aio: the
    synchronous channel imports a module the other uid cannot read.)"""
    async def run() -> dict:
        async with grpc.aio.insecure_channel(cri.target(socket_path)) as ch:
            async def answer(method: str, request: bytes) -> list:
                try:
                    response = await ch.unary_unary(cri.method_path(method))(request, timeout=30)
                except grpc.aio.AioRpcError as e:
                    return [e.code().name, e.details(), ""]
                return ["OK", "", response.hex()]

            before = [await answer("RemoveImage", cri.remove_image_request(n)) for n in first]
            listed = await answer("ListImages", cri.list_images_request())
            images = cri.decode_list_images_response(bytes.fromhex(listed[2]))
            unpinned = [await answer("RemoveImage", cri.remove_image_request(i.id)) for i in images if not i.pinned]
            named = [await answer("RemoveImage", cri.remove_image_request(n)) for n in names]
            return {"before": before, "unpinned": unpinned, "named": named}

    return asyncio.run(run())


@pytest.mark.parametrize("ctd_socket", ["containerd-1.6", "containerd-2.x"], indirect=True)
def test_empty_name_and_shortened_ids_never_remove_the_pinned_image(ctd_socket, make_image, tmp_path,
                                                                    engine) -> None:
    """issue 44: containerd (1.6 and 2.x) resolves a name that is no reference by its short-ID index,
    where "" is a prefix of every ID: "ambiguous" while it holds two images, *the* image once it holds
    one. A client of another uid removes the unpinned images (allowed), then asks for "" and for
    shortened IDs of the pinned one: 0 pinned images removed; "" is answered as a missing image."""
    require_root()
    pinned, a, b = make_image(), make_image(), make_image()
    for img in (pinned, a, b):
        assert cri.call(ctd_socket, "PullImage", cri.pull_image_request(img.ref), timeout=60).ok
    hex_ = pinned.image_id.removeprefix("sha256:")
    names = ["", hex_[:12], f"sha256:{hex_[:12]}", hex_[:1]]
    settings = {"server": {"engine": engine, "socket_group": str(NOBODY)}, "pins": {"images": [pinned.ref]}}
    with shared_dir() as d:  # uid 65534 reaches the socket through its group
        shim = new_shim(ctd_socket, tmp_path / "shim", settings, listen_path=d / "shim.sock").start()
        try:
            got = run_as(NOBODY, remove_all_unpinned_then, shim.path, [""], names, timeout=60)
        finally:
            shim.stop()

    missing = cri.call(ctd_socket, "RemoveImage", cri.remove_image_request("example.invalid/nothing:here"))
    assert missing.ok
    as_missing = ["OK", "", (missing.response or b"").hex()]
    assert got["before"] == [as_missing], got  # "" among three images (containerd: "ambiguous")
    assert [code for code, _, _ in got["unpinned"]] == ["OK", "OK"], got  # both were still there
    empty, short, short_sha, one_digit = got["named"]
    assert empty == as_missing, got  # "" beside the pinned image alone
    for code, details, _ in (short, short_sha, one_digit):
        assert code == "FAILED_PRECONDITION" and pinned.image_id in details, got
    assert not present_at(ctd_socket, a.ref) and not present_at(ctd_socket, b.ref)
    assert present_at(ctd_socket, pinned.ref)  # 0 pinned images removed
    # what the shim kept from happening: the runtime itself removes its only image for ""
    assert cri.call(ctd_socket, "RemoveImage", cri.remove_image_request("")).ok
    assert not present_at(ctd_socket, pinned.ref)


@pytest.mark.parametrize("cri_runtime", [CRIO], indirect=True)
def test_empty_name_and_a_shortened_id_on_crio(cri_runtime: CriRuntime, make_image, registry, shim_factory,
                                               engine) -> None:
    """CRI-O answers RemoveImage("") with an error and removes nothing; the shim (with pins) answers it as
    a missing image without asking. A shortened ID of an unpinned image with two tags goes on as the full
    ID: the whole image is removed, as CRI-O itself removes it for the prefix; of the pinned one: refused."""
    pinned, two_tags = make_image(), make_image()
    second = registry.push(two_tags.image, two_tags.repository, "v2")
    for img in (pinned, two_tags, second):
        pull(cri_runtime, img)
    shim = shim_factory({"server": {"engine": engine}, "pins": {"images": [pinned.ref]}}, upstream=cri_runtime.socket)

    direct = cri.call(cri_runtime.socket, "RemoveImage", cri.remove_image_request(""))
    assert not direct.ok and "no image specified" in (direct.details or ""), direct
    via = remove(shim, "")
    assert via.ok and via.response == b"", via

    short = cri_runtime.image_id(two_tags)[:12]
    assert remove(shim, short).ok
    assert not present(cri_runtime, two_tags.ref) and not present(cri_runtime, second.ref)
    refused = remove(shim, cri_runtime.image_id(pinned)[:12])
    assert refused.code is grpc.StatusCode.FAILED_PRECONDITION, refused
    assert present(cri_runtime, pinned.ref)
