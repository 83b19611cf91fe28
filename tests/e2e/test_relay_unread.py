"""Answers nobody reads (issue 25): a client that sends calls and does not read the answers
must not make the *runtime* hold them either. The shim as a process (``python -m shim serve``,
default config) in front of a private containerd 1.6 and 2.x, whose RSS is measured with the
shim's, while an honest client calls ``Version`` every 50 ms (helpers from test_relay_abuse.py).

- ``test_answers_nobody_reads_stay_bounded_in_the_runtime_and_the_shim``: 200,000 Version calls
  on one connection whose answers are never read (a few seconds each: the shim sends it away);
- ``test_a_client_that_pauses_then_reads_gets_every_answer``.

Each test prints its numbers (run with ``-s``).
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_relay_abuse import LATENCY_BOUND_S, RSS_BOUND_MIB, VERSION, Honest, RssPeak, _shim, rss_mib
from tests.support import containerd2, cri
from tests.support.containerd import Containerd
from tests.support.h2raw import (SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, RawH2,
                                 frame, unary_calls)
from tests.support.shim import start_shim

pytestmark = pytest.mark.e2e

# The shim stops reading such a client while its answers wait, and relays at most
# server.max_concurrent_streams calls at once per connection (advertised to the client as
# SETTINGS_MAX_CONCURRENT_STREAMS; more is refused with REFUSED_STREAM, which clients retry, and a
# client that keeps opening streams over it is sent away with GOAWAY ENHANCE_YOUR_CALM). Two such
# clients: one reads nothing; one reads its socket but grants no flow-control window (the runtime
# then holds the answers itself, and the shim must keep reading the client for its WINDOW_UPDATE).
# Measured on main @ 48be281 with containerd 1.6.20 (reads-nothing client, 60 s budget): direct,
# 200,000 calls written, containerd +728 MiB (767 MiB still 60 s after the close); through the
# shim, 99,000 calls written before the shim closed the connection (write_stall_seconds),
# containerd +328 MiB, shim +8 MiB, an honest Version call took up to 2.8 s.

UNREAD_CALLS = 200_000        # Version calls the never-reading client tries to send
UNREAD_SECONDS = 60.0         # its time budget (the socket blocks once the shim stops reading it)
RUNTIME_RSS_BOUND_MIB = 128   # the runtime's RSS growth allowed meanwhile
IDLE_MARGIN_MIB = 24          # "back to idle": within this of the RSS before the attack
IDLE_WAIT_S = 60.0            # how long the runtime (Go: memory returns lazily) may take to get there


class Drain(threading.Thread):
    """Reads and drops what a connection receives until it is closed."""

    def __init__(self, c: RawH2) -> None:
        super().__init__(daemon=True)
        self.sock = c.sock
        self.bytes = 0

    def run(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                return
            if not chunk:
                return
            self.bytes += len(chunk)


def never_read(path: str, calls: int = UNREAD_CALLS, seconds: float = UNREAD_SECONDS,
               window: bool = True) -> tuple[RawH2, int]:
    """Version calls as fast as the socket takes them, for up to ``seconds``; no answer is read:
    with ``window``, the socket is not read either; without, it is read (and dropped) but the
    client's flow-control window for answers is 0. Returns the connection (still open) and how
    many calls were written whole."""
    c = RawH2(path)
    if not window:
        c.send(frame(SETTINGS, 0, 0, SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + bytes(4)))
        Drain(c).start()
    batch, sent, sid = 1000, 0, 1
    end = time.monotonic() + seconds
    while sent < calls and time.monotonic() < end:
        n = min(batch, calls - sent)
        some = unary_calls(VERSION, cri.version_request(), sid, n)
        if not c.send(some, timeout=max(0.05, end - time.monotonic())):
            break  # blocked until the end of the budget (or closed): what is written is written
        sent, sid = sent + n, sid + 2 * n
    return c, sent


@pytest.fixture(params=["containerd-1.6", "containerd-2"])
def runtime_process(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """(CRI endpoint, pid) of a private runtime: its RSS is this test's alone."""
    if request.param == "containerd-1.6":
        factory = request.getfixturevalue("containerd_factory")
        c = factory()
        yield c.endpoint, c.pid
        return
    c2 = containerd2.Containerd2(containerd2.require(), tmp_path / "c2", {})
    c2.start()
    try:
        yield c2.endpoint, c2.pid
    finally:
        c2.stop()


async def _back_to(pid: int, idle: float, within: float) -> float:
    """The process's RSS once it is within IDLE_MARGIN_MIB of ``idle``, or after ``within`` seconds."""
    end = time.monotonic() + within
    while True:
        now = rss_mib(pid)
        if now <= idle + IDLE_MARGIN_MIB or time.monotonic() > end:
            return now
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("client", ["reads-nothing", "grants-no-window"])
async def test_answers_nobody_reads_stay_bounded_in_the_runtime_and_the_shim(
        client: str, runtime_process: tuple[str, int], tmp_path: Path) -> None:
    endpoint, runtime_pid = runtime_process
    shim = await start_shim(endpoint, tmp_path / "shim")
    try:
        for _ in range(20):
            assert (await cri.acall(shim.path, "Version", cri.version_request(), timeout=10)).ok
        idle = {"runtime": rss_mib(runtime_pid), "shim": rss_mib(shim.pid)}
        peaks = {"runtime": RssPeak(runtime_pid), "shim": RssPeak(shim.pid)}
        honest = Honest(shim.path)
        for p in peaks.values():
            p.start()
        honest.start()
        try:
            conn, sent = await asyncio.to_thread(never_read, shim.path, window=client == "reads-nothing")
            await asyncio.sleep(2.0)  # the runtime answers what it got meanwhile
        finally:
            await honest.stop()
            growth = {k: p.stop() - idle[k] for k, p in peaks.items()}
        conn.close()
        after = {"runtime": await _back_to(runtime_pid, idle["runtime"], IDLE_WAIT_S),
                 "shim": await _back_to(shim.pid, idle["shim"], IDLE_WAIT_S)}
        lat = sorted(honest.latencies) or [0.0]
        print(f"\n  {client} client: {sent} Version calls written; runtime RSS {idle['runtime']:.0f} MiB idle, "
              f"+{growth['runtime']:.0f} MiB peak, {after['runtime']:.0f} MiB after; shim RSS {idle['shim']:.0f} MiB "
              f"idle, +{growth['shim']:.0f} MiB peak, {after['shim']:.0f} MiB after; honest Version: {len(lat)} calls, "
              f"{len(honest.failures)} failed, p50 {statistics.median(lat) * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms")
        assert shim.proc.poll() is None, shim.logs()[-3000:]
        assert not honest.failures, f"{len(honest.failures)} honest calls failed, first: {honest.failures[:3]}"
        assert lat[-1] <= LATENCY_BOUND_S, f"an honest Version call took {lat[-1]:.2f} s"
        assert growth["runtime"] < RUNTIME_RSS_BOUND_MIB, f"the runtime's RSS grew {growth['runtime']:.0f} MiB"
        assert growth["shim"] < RSS_BOUND_MIB, f"the shim's RSS grew {growth['shim']:.0f} MiB"
        for k in after:
            assert after[k] <= idle[k] + IDLE_MARGIN_MIB, f"{k} RSS {after[k]:.0f} MiB, idle was {idle[k]:.0f} MiB"
    finally:
        await shim.astop()


STATUS = "/runtime.v1.RuntimeService/Status"
STATUS_VERBOSE = b"\x08\x01"  # StatusRequest{verbose: true}: containerd answers about 3 KiB


async def test_a_client_that_pauses_then_reads_gets_every_answer(containerd: Containerd, tmp_path: Path) -> None:
    """As many verbose Status calls as the shim advertises it takes at once, sent without
    reading (about 300 KiB of answers: more than the socket and the shim's write buffer
    hold); a pause of a few seconds; then every answer is read, and the next calls go as usual."""
    shim = await _shim(containerd, tmp_path)
    try:
        c = RawH2(shim.path, timeout=10)
        c.open_windows()
        settings, _ = await asyncio.to_thread(c.read_until, lambda f: f.type == SETTINGS and not f.flags & 1, 10)
        assert settings is not None
        n = settings.settings[SETTINGS_MAX_CONCURRENT_STREAMS]  # the shim's advertised limit
        assert n == 100
        assert await asyncio.to_thread(c.send, unary_calls(STATUS, STATUS_VERBOSE, 1, n), 10)
        await asyncio.sleep(3.0)  # the pause
        t0 = time.monotonic()
        first = await asyncio.to_thread(c.read_answers, n)
        took = time.monotonic() - t0
        assert sorted(first) == list(range(1, 2 * n, 2))
        assert {status for _, status in first.values()} == {b"0"}, first
        assert min(size for size, _ in first.values()) > 1000  # whole verbose answers
        assert await asyncio.to_thread(c.send, unary_calls(STATUS, STATUS_VERBOSE, 2 * n + 1, n), 10)
        second = await asyncio.to_thread(c.read_answers, n)
        assert {status for _, status in second.values()} == {b"0"} and len(second) == n
        c.close()
        print(f"\n  pausing client: {n} verbose Status answers ({sum(s for s, _ in first.values()) >> 10} KiB) "
              f"read in {took * 1000:.0f} ms after a 3 s pause; {n} more answered after")
    finally:
        await shim.astop()
