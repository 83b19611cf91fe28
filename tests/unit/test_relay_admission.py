"""Who makes room at server.max_connections (shim/relay/admission.py), and each
connection's peer read at accept. The process-level test, with an attacker running as
another uid against a kubelet-like client, is tests/e2e/test_relay_abuse.py
(test_another_uid_cannot_lock_kubelet_out).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from shim.relay.admission import Admission, Peer
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim

ROOT = Peer(0, 1, True)
NOBODY = Peer(65534, 2, False)
DAEMON = Peer(1, 3, False)


@dataclass(eq=False)
class Conn:
    peer: Peer
    idle: bool = False
    name: str = field(default="")


def admitted(a: Admission, conn: Conn, preface: bool = True) -> Conn | None:
    """Admit ``conn``; returns the connection closed to make room (None: none)."""
    ok, victim, _ = a.room_for(conn)
    assert ok
    if victim is not None:
        a.remove(victim)
    a.add(conn)
    if preface:
        a.preface_received(conn)
    return victim


def test_untrusted_clients_share_half_and_make_room_among_themselves() -> None:
    a = Admission(max_connections=8, max_connections_per_uid=8)
    kubelet = Conn(ROOT, idle=True)
    assert admitted(a, kubelet) is None
    attacker = [Conn(NOBODY) for _ in range(4)]
    for c in attacker:
        assert admitted(a, c) is None
    assert a.untrusted == 4  # their half of 8
    more = Conn(NOBODY)
    assert admitted(a, more) is attacker[0]  # its own oldest (busy or not) makes room
    other = Conn(DAEMON)
    assert admitted(a, other) is attacker[1]  # the uid holding the most makes room
    assert kubelet in a.order and a.untrusted == 4


def test_a_trusted_connection_is_never_closed_for_an_untrusted_one_and_gets_room_from_the_biggest() -> None:
    a = Admission(max_connections=4, max_connections_per_uid=4)
    kubelet = [Conn(ROOT, idle=True), Conn(ROOT, idle=True)]
    for c in kubelet:
        admitted(a, c)
    nobody = [Conn(NOBODY), Conn(NOBODY)]
    for c in nobody:
        admitted(a, c)
    assert admitted(a, Conn(DAEMON)) in nobody  # untrusted share full: the biggest untrusted uid gives
    assert all(c in a.order for c in kubelet)
    new_root = Conn(ROOT)
    victim = admitted(a, new_root)  # at the cap: an untrusted one makes room
    assert victim is not None and not victim.peer.trusted
    assert all(c in a.order for c in kubelet)


def test_per_uid_limit_and_silent_connections_go_first() -> None:
    a = Admission(max_connections=100, max_connections_per_uid=3)
    busy = Conn(NOBODY)
    idle = Conn(NOBODY, idle=True)
    admitted(a, busy)
    admitted(a, idle)
    silent = Conn(NOBODY)
    admitted(a, silent, preface=False)
    assert admitted(a, Conn(NOBODY)) is silent  # no preface first
    assert admitted(a, Conn(NOBODY)) is idle  # then one with no call in flight
    assert admitted(a, Conn(NOBODY)) is busy  # then the oldest
    assert a.uids() == {"65534": 3}


def test_only_trusted_connections_at_the_cap_a_silent_or_idle_one_makes_room_else_refused() -> None:
    a = Admission(max_connections=2, max_connections_per_uid=2)
    busy, idle = Conn(ROOT), Conn(ROOT, idle=True)
    admitted(a, busy)
    admitted(a, idle)
    assert a.room_for(Conn(NOBODY)) == (False, None, "server.max_connections")
    assert admitted(a, Conn(ROOT)) is idle
    ok, victim, _ = a.room_for(Conn(ROOT))
    assert (ok, victim) == (False, None)  # every connection is trusted and busy


async def test_each_connection_knows_its_peer(runtime: FakeRuntime) -> None:
    """SO_PEERCRED at accept: this process's uid and pid; root is trusted by default."""
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        reader, writer = await asyncio.open_unix_connection(shim.path)
        for _ in range(100):
            if shim.server.relay.connections:
                break
            await asyncio.sleep(0.01)
        [conn] = shim.server.relay.connections
        assert conn.peer == Peer(os.getuid(), os.getpid(), os.getuid() == 0)
        assert conn.core.trusted is conn.peer.trusted
        writer.close()
