"""PING policy: which client PINGs go to the runtime and how many the shim answers itself.

A client's PING goes to the runtime only if the runtime has sent HEADERS or DATA since
the last PING it got (``runtime_spoke``); otherwise the shim answers it (gRPC servers
count such a PING as a strike and close the connection after two, also when the data
that made the client PING came from the shim). The PINGs the shim answers with no
HEADERS or DATA sent to the client since the previous one (``client_got_data``) are
limited to a burst of LOCAL_PINGS_BURST and LOCAL_PINGS_PER_SECOND after it (a token
bucket): beyond, GOAWAY ENHANCE_YOUR_CALM, as a gRPC server does with "too_many_pings"
(a gRPC client's BDP PINGs follow data and never count).
"""

from __future__ import annotations

from collections.abc import Callable

from . import http2
from .bucket import TokenBucket
from .http2 import H2Error

# PINGs the shim answers itself: a burst, then a rate (containerd allows far fewer: a
# few per five minutes without data in between, then GOAWAY too_many_pings).
LOCAL_PINGS_BURST = 100
LOCAL_PINGS_PER_SECOND = 10.0


class PingPolicy:
    __slots__ = ("_bucket", "client_got_data", "runtime_spoke")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.runtime_spoke = True  # the runtime sent HEADERS or DATA since the last PING it got
        self.client_got_data = False  # HEADERS or DATA went to the client since its last PING
        self._bucket = TokenBucket(LOCAL_PINGS_BURST, LOCAL_PINGS_PER_SECOND, clock)

    def answer_here(self, relay: bool) -> bool:
        """A client PING (not an ACK): True if the shim answers it, False if it goes to the runtime.
        Raises H2Error (ENHANCE_YOUR_CALM) when the client PINGs too often."""
        if relay and self.runtime_spoke:
            self.runtime_spoke = False
            return False
        if self.client_got_data:  # a PING after data (a BDP probe of gRPC clients) is free
            self.client_got_data = False
        elif not self._bucket.take():
            raise H2Error(f"too many PINGs: more than {LOCAL_PINGS_BURST} at once or "
                          f"{LOCAL_PINGS_PER_SECOND:g} a second", http2.ENHANCE_YOUR_CALM)
        return True
