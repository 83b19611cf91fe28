"""Who is calling: the local process at the other end of a client connection.

The relay reads it at accept (SO_PEERCRED, shim/relay/admission.py) and every call on that
connection carries it (``Call.peer``). A peer whose uid is in ``server.trusted_uids`` (root
by default: kubelet) is trusted; any other local process that can open the socket is not.
Trust decides a peer's share of the relay's bounds and of the pull slots (shim/pulls/slots.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    uid: int = -1  # -1: unknown (then untrusted)
    pid: int = 0
    trusted: bool = False


# The grpc engine cannot read a caller's credentials (grpc.aio names a unix peer "unix:", with no
# uid): there every caller counts as trusted, as every caller did before peers were told apart.
UNIDENTIFIED = Peer(trusted=True)
