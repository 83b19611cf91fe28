"""/metrics cannot be turned against the shim: it is served on the event loop (no thread per
connection), with a connection cap that a scraper still gets through and a timeout that
closes half-sent requests."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from tests.support.fake_runtime import FakeRuntime
from tests.support.prom import free_port, scrape
from tests.support.shim import shim_process

HALF_SENT = 1000


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def half_sent(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the blank line that ends the head never comes
    return s


def closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def test_half_sent_requests_cost_no_threads_and_are_closed(runtime: FakeRuntime, tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    timeout = 2.0
    settings = {"server": {"admin_socket": ""},
                "metrics": {"address": address, "max_connections": 16, "timeout_seconds": timeout}}
    async with shim_process(runtime.endpoint, tmp_path, settings) as shim:
        await scrape(address)
        idle = threads(shim.pid)
        socks = []
        try:
            for _ in range(HALF_SENT):
                socks.append(half_sent(address))
            await asyncio.sleep(0.5)
            assert threads(shim.pid) <= idle + 1  # before: one thread per connection (1,009)
            t = time.monotonic()
            text = (await scrape(address)).text  # gets in: the oldest half-sent connection makes room
            took = time.monotonic() - t
            assert "cri_shim_pulls_in_flight" in text and took < 5, took
            deadline = time.monotonic() + timeout + 15  # generous: the machine is loaded
            while not all(closed_by_peer(s) for s in socks[-10:]) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert all(closed_by_peer(s) for s in socks), "half-sent requests still open after the timeout"
            assert threads(shim.pid) <= idle + 1 and shim.proc.poll() is None
        finally:
            for s in socks:
                s.close()


