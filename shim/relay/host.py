"""What a client connection needs from the listener that accepted it: ``Host``.

connection.py depends on this protocol, not on listener.py; listener.Relay implements
it (and creates the connections), so the dependency runs one way: listener ->
connection -> host.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ..cri.call import Handler
from ..cri.deadline import Deadline
from ..cri.peer import Peer
from ..cri.routing import Intercept, Patch, Refusal
from ..errors import Metadata
from .admission import Conn
from .limits import Limits

FD_ERRNOS = (errno.EMFILE, errno.ENFILE)  # out of file descriptors, not "runtime not reachable"
Send = Callable[[bytes], Awaitable[None]]


class Warning_(Protocol):
    """A warning logged at a bounded rate (listener._RateLimited)."""

    def __call__(self, **fields: Any) -> None: ...


class Host(Protocol):
    @property
    def limits(self) -> Limits:
        """server.* and the process-wide pools, shared by every connection."""

    @property
    def upstream_path(self) -> str:
        """The runtime's unix socket."""

    def route(self, path: str) -> Intercept[Handler] | Patch[Handler] | Refusal | None:
        """The routing decision for a ``:path`` (shim/cri/routing.py)."""

    async def serve(self, method: str, handler: Handler, request: bytes, metadata: Metadata, deadline: Deadline,
                    send: Send, sent_as: str = "", *, peer: Peer) -> None:
        """Run an intercepted call's handler for ``peer``; ``send`` each response message."""

    # connection bookkeeping (admission.py)
    def admit(self, conn: Conn) -> bool: ...
    def preface_received(self, conn: Conn) -> None: ...
    def forget(self, conn: Conn) -> None: ...

    # runtime reachability, as this connection found it
    def upstream_reachable(self) -> None: ...
    def upstream_unreachable(self, err: Exception | None) -> None: ...
    def watch_for_upstream(self) -> None: ...
    def out_of_fds(self, err: OSError, where: str) -> None: ...

    # what a client did, logged at a bounded rate
    @property
    def protocol_error(self) -> Warning_: ...
    @property
    def stream_refused(self) -> Warning_: ...
    @property
    def stream_stalled(self) -> Warning_: ...
    @property
    def answer_overdue(self) -> Warning_: ...
