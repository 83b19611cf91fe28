"""Who is connected, and who makes room at ``server.max_connections``.

Each connection's peer is read at accept (SO_PEERCRED: uid and pid of the process that
connected). Peers whose uid is in ``server.trusted_uids`` (root by default: kubelet) are
trusted; any other local process that can open the socket is not. The rules, so that no
untrusted client can turn the connection cap against kubelet:

- Untrusted peers together hold at most ``UNTRUSTED_SHARE`` of ``max_connections`` (the
  rest is kubelet's reserved room), and one untrusted uid at most
  ``max_connections_per_uid``.
- A trusted connection is never closed to make room for an untrusted one.
- When there is no room, a connection of the untrusted uid holding the most connections
  is closed (the peer itself, when it is at its own limit): its oldest that has not sent
  the HTTP/2 preface, else its oldest with no call in flight, else its oldest (calls in
  flight or not: a busy-looking connection costs an attacker nothing).
- With only trusted connections at the cap, one with no preface, else an idle one, makes
  room (GOAWAY: a gRPC client reconnects without a failed call); if all are busy the new
  connection is refused.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable
from typing import Any, Protocol

from ..cri.peer import Peer
from .memory import UNTRUSTED_SHARE

_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_of(transport: Any, trusted_uids: Iterable[int]) -> Peer:
    """The process at the other end of a unix socket connection, from SO_PEERCRED."""
    sock = transport.get_extra_info("socket")
    try:
        pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except (OSError, AttributeError, struct.error):
        return Peer()
    return Peer(uid, pid, uid in trusted_uids)


class Conn(Protocol):
    peer: Peer

    @property
    def idle(self) -> bool: ...


class Admission:
    """The open connections, by peer, and the choice of which one makes room."""

    def __init__(self, max_connections: int, max_connections_per_uid: int) -> None:
        self.max_connections = max_connections
        self.max_per_uid = max_connections_per_uid
        self.untrusted_limit = max(1, int(max_connections * UNTRUSTED_SHARE))
        self.order: dict[Conn, None] = {}  # oldest first
        self.no_preface: dict[Conn, None] = {}
        self.by_uid: dict[int, dict[Conn, None]] = {}  # untrusted connections only
        self.untrusted = 0

    def __len__(self) -> int:
        return len(self.order)

    def room_for(self, conn: Conn) -> tuple[bool, Conn | None, str]:
        """(admit, connection to close first, why). Does not change anything."""
        peer = conn.peer
        if not peer.trusted:
            mine = self.by_uid.get(peer.uid, {})
            if len(mine) >= self.max_per_uid:
                return True, self._pick(mine), "server.max_connections_per_uid"
            if self.untrusted >= self.untrusted_limit or len(self.order) >= self.max_connections:
                if not self.untrusted:  # every connection is trusted: none makes room for this one
                    return False, None, "server.max_connections"
                return True, self._pick(self._most()), "untrusted share of server.max_connections"
            return True, None, ""
        if len(self.order) < self.max_connections:
            return True, None, ""
        if self.untrusted:
            return True, self._pick(self._most()), "server.max_connections (trusted client)"
        victim = next(iter(self.no_preface), None) or next((c for c in self.order if c.idle), None)
        return victim is not None, victim, "server.max_connections"

    def _most(self) -> dict[Conn, None]:
        return max(self.by_uid.values(), key=len)

    def _pick(self, conns: dict[Conn, None]) -> Conn:
        return (next((c for c in conns if c in self.no_preface), None)
                or next((c for c in conns if c.idle), None) or next(iter(conns)))

    def add(self, conn: Conn) -> None:
        self.order[conn] = None
        self.no_preface[conn] = None
        if not conn.peer.trusted:
            self.by_uid.setdefault(conn.peer.uid, {})[conn] = None
            self.untrusted += 1

    def preface_received(self, conn: Conn) -> None:
        self.no_preface.pop(conn, None)

    def remove(self, conn: Conn) -> None:
        if conn not in self.order:
            return
        del self.order[conn]
        if not conn.peer.trusted:
            mine = self.by_uid[conn.peer.uid]
            del mine[conn]
            if not mine:
                del self.by_uid[conn.peer.uid]
            self.untrusted -= 1
        self.no_preface.pop(conn, None)

    def uids(self) -> dict[str, int]:
        """Untrusted connections by uid (for `cri-shim status`)."""
        return {str(uid): len(c) for uid, c in self.by_uid.items()}
