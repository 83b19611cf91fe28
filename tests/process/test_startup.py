"""Starting the shim process: a stale socket from a crash is replaced, a live one is
refused with a clear message, a bad config names the key (no traceback), and under
systemd READY=1 is sent only once the socket accepts calls."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
from pathlib import Path

import grpc
import pytest

from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import socket_accepts, start_shim
from tests.support.slow_pulls import VERSION


@pytest.fixture
def runtime(runtime: FakeRuntime) -> FakeRuntime:
    """the runtime fixture (tests/support/fake_fixtures.py), answering Version."""
    runtime.unary[VERSION] = b"\x0a\x050.1.0"
    return runtime


def _stale_socket(path: str) -> None:
    """What a killed shim leaves behind: a socket file nobody listens on."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()


async def test_stale_socket_from_a_crash_is_replaced(runtime: FakeRuntime, tmp_path, short_tmp: Path) -> None:
    path = str(short_tmp / "shim.sock")
    _stale_socket(path)
    assert os.path.exists(path) and not socket_accepts(path)
    shim = await start_shim(runtime.endpoint, tmp_path, listen_path=path)
    try:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"\x0a\x050.1.0"
        assert "replaced stale socket" in shim.logs()
    finally:
        assert await shim.astop() == 0
    assert not os.path.exists(path)


async def test_killed_shim_restarts_on_same_path(runtime: FakeRuntime, tmp_path, short_tmp: Path) -> None:
    path = str(short_tmp / "shim.sock")
    first = await start_shim(runtime.endpoint, tmp_path / "1", listen_path=path)
    first.send(signal.SIGKILL)
    await first.await_exit(5)
    await first.astop()
    assert os.path.exists(path)  # nobody cleaned up
    second = await start_shim(runtime.endpoint, tmp_path / "2", listen_path=path)
    try:
        async with grpc.aio.insecure_channel(second.endpoint) as ch:
            assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"\x0a\x050.1.0"
    finally:
        assert await second.astop() == 0


async def test_live_socket_is_refused_with_a_clear_message(runtime: FakeRuntime, tmp_path, short_tmp: Path) -> None:
    path = str(short_tmp / "shim.sock")
    first = await start_shim(runtime.endpoint, tmp_path / "1", listen_path=path)
    try:
        second = await start_shim(runtime.endpoint, tmp_path / "2", listen_path=path, wait=False)
        assert await second.await_exit(20) == 1
        out = second.logs()
        assert f"cri-shim: cannot start: another process (pid {first.pid}, " in out
        assert path in out and "Traceback" not in out
        # the first shim is untouched and still serving
        async with grpc.aio.insecure_channel(first.endpoint) as ch:
            assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"\x0a\x050.1.0"
    finally:
        assert await first.astop() == 0


async def test_listen_path_that_is_not_a_socket_is_refused(runtime: FakeRuntime, tmp_path, short_tmp: Path) -> None:
    path = str(short_tmp / "shim.sock")
    with open(path, "w") as f:
        f.write("precious")
    shim = await start_shim(runtime.endpoint, tmp_path, listen_path=path, wait=False)
    assert await shim.await_exit(20) == 1
    assert "exists and is not a socket" in shim.logs() and "Traceback" not in shim.logs()
    with open(path) as f:
        assert f.read() == "precious"


@pytest.mark.parametrize("text, key", [
    ("pulls:\n  max_parallel: -1\n", "pulls.max_parallel"),
    ("server:\n  shutdown_grace_seconds: soon\n", "server.shutdown_grace_seconds"),
    ("pulls:\n  max_paralel: 3\n", "pulls.max_paralel"),
    ("runtime_handlers:\n  rules:\n    - namespaces: [x]\n", "runtime_handlers.rules[0].handler"),
])
async def test_bad_config_at_start_names_the_key(runtime: FakeRuntime, tmp_path, text: str, key: str) -> None:
    shim = await start_shim(runtime.endpoint, tmp_path, text, wait=False)
    assert await shim.await_exit(20) == 2
    out = shim.logs()
    assert f"cri-shim: bad config {shim.config_path}: {key}:" in out
    assert "Traceback" not in out
    assert not os.path.exists(shim.path)


async def test_unusable_listen_directory_is_a_message_not_a_traceback(runtime: FakeRuntime, tmp_path) -> None:
    shim = await start_shim(runtime.endpoint, tmp_path, listen_path="/proc/cri-shim-test/shim.sock", wait=False)
    assert await shim.await_exit(20) == 1
    assert "cri-shim: cannot start:" in shim.logs() and "Traceback" not in shim.logs()


async def test_metrics_port_in_use_is_a_message_not_a_traceback(runtime: FakeRuntime, tmp_path) -> None:
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    try:
        shim = await start_shim(runtime.endpoint, tmp_path, {"metrics": {"address": f"127.0.0.1:{port}"}},
                                wait=False)
        assert await shim.await_exit(20) == 1
    finally:
        held.close()
    out = shim.logs()
    assert f"cri-shim: cannot start: metrics.address 127.0.0.1:{port}:" in out and "Traceback" not in out
    assert not os.path.exists(shim.path)  # the listen socket it had bound is cleaned up


async def test_systemd_notifications(runtime: FakeRuntime, tmp_path, short_tmp: Path) -> None:
    notify_path = str(short_tmp / "notify.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(notify_path)
    sink.setblocking(False)
    loop = asyncio.get_running_loop()

    async def next_message() -> str:
        return (await asyncio.wait_for(loop.sock_recv(sink, 4096), 20)).decode()

    try:
        shim = await start_shim(runtime.endpoint, tmp_path, env={"NOTIFY_SOCKET": notify_path}, wait=False)
        ready = await next_message()
        assert "READY=1" in ready.splitlines()
        assert socket_accepts(shim.path)  # READY only once kubelet can connect
        shim.reload()
        assert "RELOADING=1" in (await next_message()).splitlines()
        assert "READY=1" in (await next_message()).splitlines()
        shim.terminate()
        assert "STOPPING=1" in (await next_message()).splitlines()
        assert await shim.await_exit(15) == 0
    finally:
        sink.close()
        await shim.astop()


async def test_socket_mode_and_group(runtime: FakeRuntime, tmp_path) -> None:
    import grp

    group = grp.getgrgid(os.getgid() if os.getgid() != 0 else 1)  # 'daemon' (gid 1) when we are root
    shim = await start_shim(runtime.endpoint, tmp_path,
                            {"server": {"socket_mode": "0640", "socket_group": group.gr_name}})
    try:
        st = os.stat(shim.path)
        assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == group.gr_gid
    finally:
        assert await shim.astop() == 0


async def test_unknown_socket_group_is_refused(runtime: FakeRuntime, tmp_path) -> None:
    shim = await start_shim(runtime.endpoint, tmp_path, {"server": {"socket_group": "no-such-group-xyz"}},
                            wait=False)
    assert await shim.await_exit(20) == 2  # a bad config value (check-config refuses it too)
    assert "server.socket_group: no such group 'no-such-group-xyz'" in shim.logs()
    assert not os.path.exists(shim.path)


@pytest.mark.parametrize("engine", ["relay", "grpc"])
async def test_connect_and_close_probes_leave_no_error(runtime: FakeRuntime, tmp_path, engine: str) -> None:
    """Health checks and a second shim's live-socket probe connect and hang up at once."""
    shim = await start_shim(runtime.endpoint, tmp_path, {"server": {"engine": engine}})
    try:
        for _ in range(40):
            assert socket_accepts(shim.path)
            await asyncio.sleep(0.005)
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"\x0a\x050.1.0"
    finally:
        assert await shim.astop() == 0
    assert "Traceback" not in shim.logs() and "Fatal error" not in shim.logs(), shim.logs()
