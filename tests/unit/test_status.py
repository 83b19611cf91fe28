"""`cri-shim status`: the admin socket and what it shows a person or a script."""

from __future__ import annotations

import asyncio
import io
import json
import os
import stat

import grpc
import pytest

from shim import cli
from shim.proto.runtime.v1 import api_pb2
from shim.process.status_render import print_status
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim

PULL = "/runtime.v1.ImageService/PullImage"


def pull_request(image: str) -> bytes:
    return api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)).SerializeToString()


@pytest.fixture
def admin_socket(short_tmp) -> str:
    return str(short_tmp / "admin.sock")


async def status(path: str, as_json: bool) -> tuple[int, str]:
    out = io.StringIO()
    code = await asyncio.to_thread(print_status, path, as_json, out)
    return code, out.getvalue()


async def test_status_shows_queue_in_flight_waiters_and_upstream(engine: str,
                                                                 runtime: FakeRuntime, admin_socket: str) -> None:
    gate = asyncio.Event()

    async def slow(request: bytes, context) -> bytes:
        await gate.wait()
        return api_pb2.PullImageResponse(image_ref="sha256:" + "3" * 64).SerializeToString()

    runtime.unary[PULL] = slow
    settings = {"pulls": {"max_parallel": 1}, "server": {"admin_socket": admin_socket}}
    async with running_shim(runtime.endpoint, settings, engine=engine) as shim:
        assert stat.S_IMODE(os.stat(admin_socket).st_mode) == 0o600
        shim.app.status_sources["image_sets"] = lambda: {"sets": [{"name": "base", "images": 3, "present": 2}]}
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            calls = [asyncio.ensure_future(pull(pull_request("web:1"), timeout=10)) for _ in range(3)]
            while not runtime.calls("PullImage"):
                await asyncio.sleep(0.01)
            calls.append(asyncio.ensure_future(pull(pull_request("db:2"), timeout=10)))
            while shim.app.scheduler.queued != 1 or shim.app.scheduler.snapshot()["in_flight"][0]["waiters"] != 3:
                await asyncio.sleep(0.01)

            code, text = await status(admin_socket, as_json=True)
            assert code == 0
            doc = json.loads(text)
            assert doc["upstream"] == {"target": runtime.endpoint, "state": "ready"}
            assert doc["pulls"]["max_parallel"] == 1
            [running] = doc["pulls"]["in_flight"]
            [queued] = doc["pulls"]["queued"]
            # the normalized name the pulls are collapsed under
            assert (running["image"], running["waiters"]) == ("docker.io/library/web:1", 3)
            assert (queued["image"], queued["waiters"]) == ("docker.io/library/db:2", 1)
            assert "running_seconds" in running and "running_seconds" not in queued
            assert doc["image_sets"] == {"sets": [{"name": "base", "images": 3, "present": 2}]}
            assert doc["tracing"] == {"exporter": "off"}

            code, text = await status(admin_socket, as_json=False)
            assert code == 0
            lines = text.splitlines()
            assert any("upstream" in ln and runtime.endpoint in ln and "ready" in ln for ln in lines)
            assert any("1 running, 1 queued" in ln and "max_parallel 1" in ln for ln in lines)
            assert any("running" in ln and "web:1" in ln and "3 waiting" in ln for ln in lines)
            assert any("queued" in ln and "db:2" in ln and "1 waiting" in ln for ln in lines)
            assert any("name=base" in ln and "present=2" in ln for ln in lines)

            gate.set()
            await asyncio.gather(*calls)
        doc = json.loads((await status(admin_socket, as_json=True))[1])
        assert doc["pulls"]["in_flight"] == [] and doc["pulls"]["queued"] == []
    assert not os.path.exists(admin_socket)


async def test_a_failing_status_source_does_not_hide_the_rest(engine: str,
                                                              runtime: FakeRuntime, admin_socket: str) -> None:
    def broken() -> dict:
        raise RuntimeError("boom")

    async with running_shim(runtime.endpoint, {"server": {"admin_socket": admin_socket}}, engine=engine) as shim:
        shim.app.status_sources["image_sets"] = broken
        code, text = await status(admin_socket, as_json=True)
    doc = json.loads(text)
    assert code == 0
    assert doc["image_sets"] == {"error": "status source failed: RuntimeError"}
    assert doc["upstream"]["state"] in ("ready", "idle", "connecting")


async def test_status_shows_pulls_by_class_and_uid(runtime: FakeRuntime, admin_socket: str) -> None:
    """Relay engine, this process's uid outside server.trusted_uids: 1 of its 3 pulls runs."""
    gate = asyncio.Event()

    async def slow(request: bytes, context) -> bytes:
        await gate.wait()
        return api_pb2.PullImageResponse(image_ref="sha256:" + "3" * 64).SerializeToString()

    runtime.unary[PULL] = slow
    uid = os.getuid()
    settings = {"server": {"admin_socket": admin_socket, "trusted_uids": [uid + 1]}}
    async with running_shim(runtime.endpoint, settings, engine="relay") as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            calls = [asyncio.ensure_future(ch.unary_unary(PULL)(pull_request(f"app{i}:1"), timeout=10))
                     for i in range(3)]
            while shim.app.scheduler.queued != 2:
                await asyncio.sleep(0.01)
            doc = json.loads((await status(admin_socket, as_json=True))[1])
            text = (await status(admin_socket, as_json=False))[1]
            gate.set()
            await asyncio.gather(*calls)
    assert doc["pulls"]["running"] == {"trusted": 0, "untrusted": 1, "background": 0, "released": 0,
                                       "untrusted_by_uid": {str(uid): 1}}
    assert [(q["priority"], q["uid"]) for q in doc["pulls"]["queued"]] == [("untrusted", uid)] * 2
    assert f"untrusted 1 (of 2; by uid {{'{uid}': 1}})" in text
    assert f"[untrusted uid {uid}]" in text


async def test_status_when_the_shim_is_not_there(admin_socket: str, capsys) -> None:
    assert await asyncio.to_thread(cli.main, ["status", "--admin-socket", admin_socket]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cri-shim: no admin socket at " + admin_socket)
    assert "server.admin_socket" in err


async def test_status_through_the_cli(engine: str, runtime: FakeRuntime, admin_socket: str, capsys) -> None:
    async with running_shim(runtime.endpoint, {"server": {"admin_socket": admin_socket}}, engine=engine):
        assert await asyncio.to_thread(cli.main, ["status", "--admin-socket", admin_socket, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pid"] == os.getpid() and doc["pulls"] == {"max_parallel": 4, "dedup": True, "queued": [],
                                                          "in_flight": [], "progress_interval_seconds": 1.0,
                                                          "stall_timeout_seconds": 0.0,
                                                          "stall_min_bytes_per_second": 65536,
                                                          "slots": {"max_parallel": 4, "hard_bound": 8,
                                                                    "untrusted_slots": 2, "per_uid_slots": 1,
                                                                    "background_slots": 2, "critical_slots": 0},
                                                          "running": {"trusted": 0, "untrusted": 0, "background": 0,
                                                                      "released": 0, "untrusted_by_uid": {}}}


async def test_admin_socket_answers_only_get_status(engine: str, runtime: FakeRuntime, admin_socket: str) -> None:
    async def ask(raw: bytes) -> bytes:
        reader, writer = await asyncio.open_unix_connection(admin_socket)
        writer.write(raw)
        await writer.drain()
        data = await reader.read()
        writer.close()
        return data

    async with running_shim(runtime.endpoint, {"server": {"admin_socket": admin_socket}}, engine=engine):
        assert (await ask(b"GET /nope HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404 ")
        assert (await ask(b"POST /status HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405 ")
        assert (await ask(b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        assert (await ask(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 200 ")


async def test_stale_admin_socket_is_replaced_and_a_busy_one_left_alone(engine: str, runtime: FakeRuntime,
                                                                         admin_socket: str) -> None:
    import socket

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(admin_socket)
    stale.close()  # a socket file nobody listens on, as a crash leaves it
    async with running_shim(runtime.endpoint, {"server": {"admin_socket": admin_socket}}, engine=engine):
        assert (await status(admin_socket, as_json=True))[0] == 0
        # A second shim configured with the same admin socket still serves CRI; status stays with the first.
        second_shim = running_shim(runtime.endpoint, {"server": {"admin_socket": admin_socket}}, engine=engine)
        async with second_shim as second, grpc.aio.insecure_channel(second.endpoint) as ch:
            await ch.unary_unary("/runtime.v1.RuntimeService/Version")(b"", timeout=5)
        # The second did not take over or remove the first's socket.
        assert (await status(admin_socket, as_json=True))[0] == 0


async def test_status_finds_the_admin_socket_in_the_config(runtime: FakeRuntime, admin_socket: str,
                                                           tmp_path, capsys) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"server:\n  admin_socket: {admin_socket}\n")
    async with running_shim(runtime.endpoint, {"server": {"admin_socket": admin_socket}}):
        assert await asyncio.to_thread(cli.main, ["status", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pid"] == os.getpid()
    config.write_text("server:\n  admin_socket: ''\n")
    assert await asyncio.to_thread(cli.main, ["status", "--config", str(config)]) == 1
    assert "server.admin_socket is empty" in capsys.readouterr().err
