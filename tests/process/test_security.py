"""Security properties of the shim as a process (both engines), in front of a scripted runtime.

* The socket is 0660 (or the configured mode) and owned by the configured group.
* No TCP or UDP socket at all unless ``metrics.address`` is set; then exactly one,
  listening on that address (read from /proc/net/* for the shim's own socket inodes).
* No credential (password, auth, identity token, registry token) in the log at debug
  level, text or JSON, whatever happens to the pull, nor in the metrics.
* Pulls with different credentials never share a result: each credential group
  reaches the runtime, and each caller gets its own group's answer.
"""

from __future__ import annotations

import asyncio
import base64
import grp
import hashlib
import os
import stat
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_runtime import FakeRuntime
from tests.support.fixtures import shim_factory  # noqa: F401  (fixture)
from tests.support.registry import free_port

PULL = "/runtime.v1.ImageService/PullImage"
VERSION = "/runtime.v1.RuntimeService/Version"


@pytest.fixture
def runtime(runtime: FakeRuntime) -> FakeRuntime:
    """the runtime fixture (tests/support/fake_fixtures.py), answering Version."""
    runtime.unary[VERSION] = b"v"
    return runtime


def config(engine: str, **sections) -> dict:
    return {"server": {"engine": engine, "admin_socket": "", **sections.pop("server", {})}, **sections}


# --------------------------------------------------------------------------- the socket


@pytest.mark.parametrize("server, mode, group", [
    ({}, 0o660, os.getgid()),
    ({"socket_group": "daemon"}, 0o660, grp.getgrnam("daemon").gr_gid),
    ({"socket_group": grp.getgrnam("daemon").gr_gid, "socket_mode": "0600"}, 0o600, grp.getgrnam("daemon").gr_gid),
])
def test_socket_mode_and_group(runtime, shim_factory, engine: str, server: dict, mode: int, group: int) -> None:
    shim = shim_factory(config(engine, server=server), upstream=runtime.path)
    st = os.stat(shim.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == mode
    assert st.st_gid == group


def test_socket_appears_with_its_mode_and_group(runtime, shim_factory, engine: str) -> None:
    """The socket is never reachable under its path before it has its mode and group: it is
    bound under a hidden name, set up, then linked to its path. Watched from before the start,
    as fast as the test can stat, until the shim accepts."""
    gid = grp.getgrnam("daemon").gr_gid
    shim = shim_factory(config(engine, server={"socket_group": "daemon", "socket_mode": "0600"}),
                        upstream=runtime.path, start=False)
    seen: list[os.stat_result] = []
    stop = threading.Event()

    def watch() -> None:  # until stopped, and at least one look at the socket (the GIL may starve it)
        deadline = time.monotonic() + 30
        while not (stop.is_set() and seen) and time.monotonic() < deadline:
            try:
                seen.append(os.stat(shim.socket))
            except FileNotFoundError:
                continue
            if len(seen) > 2000:
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        shim.start()
    finally:
        stop.set()
        watcher.join()
    assert seen, "the socket was never seen"
    wrong = [(oct(stat.S_IMODE(st.st_mode)), st.st_gid) for st in seen
             if stat.S_IMODE(st.st_mode) != 0o600 or st.st_gid != gid]
    assert not wrong, f"{len(wrong)} of {len(seen)} looks at the socket found it without its mode/group: {wrong[:3]}"
    assert not [p for p in shim.socket.parent.iterdir() if p.name.startswith(".")], "the staging name is left"


# --------------------------------------------------------------------------- network listeners


def inet_sockets(pid: int) -> list[tuple[str, str, str]]:
    """(file, local address, state) of every TCP/UDP socket the process has open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for name in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                found.append((name, local_address(cols[1]), cols[3]))
    return found


def local_address(hex_addr: str) -> str:
    addr, port = hex_addr.split(":")
    if len(addr) == 8:
        host = ".".join(str(b) for b in bytes.fromhex(addr)[::-1])
    else:
        host = bytes.fromhex(addr).hex()  # IPv6: raw, only compared for presence
    return f"{host}:{int(port, 16)}"


LISTEN = "0A"


async def traffic(endpoint: str) -> None:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"v"
        await ch.unary_unary(PULL)(api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="reg/a:1"))
                                   .SerializeToString(), timeout=5)


async def test_no_network_socket_unless_metrics_address(runtime, shim_factory, engine: str) -> None:
    runtime.unary[PULL] = b""
    shim = shim_factory(config(engine), upstream=runtime.path)
    await traffic(shim.endpoint)
    assert inet_sockets(shim.pid) == []

    port = free_port()
    shim = shim_factory(config(engine, metrics={"address": f"127.0.0.1:{port}"}), upstream=runtime.path)
    await traffic(shim.endpoint)
    assert inet_sockets(shim.pid) == [("tcp", f"127.0.0.1:{port}", LISTEN)]
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
    assert b"cri_shim_pull_requests_total" in body
    print(f"\n[{engine}] inet sockets without metrics.address: none; with it: {inet_sockets(shim.pid)}")


# --------------------------------------------------------------------------- credentials

SECRETS = {
    "password": "pw-Zq81-secret",
    "auth": base64.b64encode(b"carol:auth-Xk22-secret").decode(),
    "identity_token": "idtok-Mn45-secret",
    "registry_token": "regtok-Pq67-secret",
}


def needles() -> list[str]:
    """Every form a secret could take in a log line."""
    out = []
    for v in SECRETS.values():
        out += [v, v[:10], base64.b64encode(v.encode()).decode()[:12], repr(v.encode())[2:12]]
    out += ["auth-Xk22-secret", "carol:auth"]  # the decoded auth
    return out


def pull_with(image: str, **auth: str) -> bytes:
    req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image),
                                   auth=api_pb2.AuthConfig(username="carol", **auth))
    return req.SerializeToString()


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_credentials_never_logged(runtime, shim_factory, engine: str, fmt: str) -> None:
    gate = asyncio.Event()

    async def pull(request: bytes, context) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        if "denied" in image:
            await context.abort(grpc.StatusCode.UNKNOWN, "pull access denied, authorization failed")
        if "slow" in image:
            await gate.wait()
        return api_pb2.PullImageResponse(image_ref=f"sha256:{'a' * 64}").SerializeToString()
    runtime.unary[PULL] = pull
    port = free_port()
    shim = shim_factory(config(engine, metrics={"address": f"127.0.0.1:{port}"}, log={"format": fmt},
                               pulls={"max_parallel": 1}), upstream=runtime.path, log_level="debug")
    async with grpc.aio.insecure_channel(shim.endpoint) as ch:
        call = ch.unary_unary(PULL)
        for field, secret in SECRETS.items():
            await call(pull_with(f"reg/ok-{field}:1", **{field: secret}), timeout=5)  # success
            with pytest.raises(grpc.aio.AioRpcError):  # the runtime refuses it
                await call(pull_with(f"reg/denied-{field}:1", **{field: secret}), timeout=5)
            slow = [call(pull_with("reg/slow:1", **{field: secret}), timeout=5) for _ in range(3)]  # collapsed
            queued = call(pull_with(f"reg/queued-{field}:1", **{field: secret}), timeout=0.2)  # times out queued
            tasks = [asyncio.ensure_future(c) for c in slow]
            with pytest.raises(grpc.aio.AioRpcError):
                await queued
            tasks[0].cancel()  # one caller gives up
            gate.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            gate.clear()
            with pytest.raises(grpc.aio.AioRpcError) as e:  # a malformed request carrying the secret
                await call(pull_with("reg/x:1", **{field: secret}) + b"\x0a\x01\xff", timeout=5)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert secret not in e.value.details()
    metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
    shim.stop()
    log = shim.log_text()
    assert "level=debug" in log or '"level": "debug"' in log  # debug lines were written
    assert "reg/ok-password:1" in log or "reg/slow:1" in log  # and they are about these pulls
    leaked = [n for n in needles() if n in log or n.encode() in metrics]
    print(f"\n[{engine}/{fmt}] {len(log.splitlines())} log lines at debug, {len(metrics)} bytes of metrics: "
          f"{len(leaked)} credential strings found")
    assert leaked == []


class EchoAuth:
    """A runtime that holds pulls until released and answers with a hash of the credentials it got."""

    def __init__(self) -> None:
        self.auths: list[bytes] = []
        self.release = asyncio.Event()

    async def __call__(self, request: bytes, context) -> bytes:
        req = api_pb2.PullImageRequest.FromString(request)
        raw = req.auth.SerializeToString(deterministic=True)
        self.auths.append(raw)
        await self.release.wait()
        return api_pb2.PullImageResponse(image_ref=f"{req.image.image}@{hashlib.sha256(raw).hexdigest()}") \
            .SerializeToString()


GROUPS = [
    {},
    {"username": "alice", "password": "one"},
    {"username": "alice", "password": "two"},
    {"username": "bob", "password": "one"},
    {"auth": base64.b64encode(b"alice:one").decode()},
    {"identity_token": "tok-a"},
    {"identity_token": "tok-b"},
    {"registry_token": "tok-a"},
    {"username": "alice", "password": "one", "server_address": "other.example.com"},
]


async def test_different_credentials_never_share_a_pull(runtime, shim_factory, engine: str) -> None:
    echo = EchoAuth()
    runtime.unary[PULL] = echo
    shim = shim_factory(config(engine, pulls={"max_parallel": 0}), upstream=runtime.path, log_level="info")
    async with grpc.aio.insecure_channel(shim.endpoint) as ch:
        call = ch.unary_unary(PULL)
        requests = [api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="reg/app:1"),
                                             auth=api_pb2.AuthConfig(**g)) for g in GROUPS for _ in range(3)]
        tasks = [asyncio.ensure_future(call(r.SerializeToString(), timeout=10)) for r in requests]
        for _ in range(200):
            if len(echo.auths) == len(GROUPS):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # nothing more arrives
        echo.release.set()
        responses = await asyncio.gather(*tasks)
    # every credential group reached the runtime, once, with its own credentials
    assert sorted(echo.auths) == sorted(api_pb2.AuthConfig(**g).SerializeToString(deterministic=True) for g in GROUPS)
    for r, raw in zip(requests, responses):  # every caller got the answer to its own group's pull
        mine = hashlib.sha256(r.auth.SerializeToString(deterministic=True)).hexdigest()
        assert api_pb2.PullImageResponse.FromString(raw).image_ref == f"reg/app:1@{mine}"
