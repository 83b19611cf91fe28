"""What intercepted calls may hold in memory, over all connections (README "Limits").

- ``Pool``: a process-wide bound shared by every connection. Two of them: bytes of
  intercepted requests (``server.max_request_buffer_bytes``: the decoded header list and
  the body, and the message again after decompression) and intercepted calls at once
  (``server.max_intercepted_calls``; a patched answer, patched.py, counts as a call too,
  from its request until nothing of its answer is held: sent, or the call ended by a reset,
  the runtime's or the client's or the shim's). A request holds its share from its first frame
  until its handler ends (or it is refused, reset, or its connection closes). Clients
  whose uid is in ``server.trusted_uids`` (kubelet runs as root) may use all of a pool;
  the others together at most ``UNTRUSTED_SHARE`` of it, so another local user cannot
  take the room kubelet's calls need.
- Request size per method (``server.max_request_bytes``): the gRPC message prefix
  declares the length, so a request over its method's limit is refused before its body
  is buffered, RESOURCE_EXHAUSTED as grpc-go answers "received message larger than max".
"""

from __future__ import annotations

from collections.abc import Mapping

from .streams import LocalStream

UNTRUSTED_SHARE = 0.5  # of each pool, for every client outside server.trusted_uids together
HEADER_FIELD_OVERHEAD = 32  # bytes counted per header field besides name and value (as RFC 7541 4.1)


class Pool:
    """A process-wide count (bytes or calls) with a limit; untrusted clients get a share."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.untrusted = 0  # the part of ``used`` that clients outside server.trusted_uids hold

    @property
    def untrusted_limit(self) -> int:
        return int(self.limit * UNTRUSTED_SHARE)

    def take(self, n: int, trusted: bool) -> bool:
        """Count ``n`` more, unless that passes the limit (the untrusted share for them)."""
        if self.used + n > self.limit or (not trusted and self.untrusted + n > self.untrusted_limit):
            return False
        self.used += n
        if not trusted:
            self.untrusted += n
        return True

    def give(self, n: int, trusted: bool) -> None:
        self.used -= n
        if not trusted:
            self.untrusted -= n


class Budget:
    """What one connection's intercepted requests hold in the process-wide pools."""

    __slots__ = ("calls", "request_buffer")

    def __init__(self, request_buffer: Pool, calls: Pool) -> None:
        self.request_buffer, self.calls = request_buffer, calls

    def admit(self, headers: list[tuple[bytes, bytes]], trusted: bool) -> str:
        """Count a new intercepted call and its header list, or say why not."""
        refusal = self.admit_call(trusted)
        if refusal:
            return refusal
        if not self.request_buffer.take(header_bytes(headers), trusted):
            self.calls.give(1, trusted)
            return self.full(trusted)
        return ""

    def admit_call(self, trusted: bool) -> str:
        """Count a new call the shim holds something for (an intercepted call, a patched answer),
        or say why not."""
        calls = self.calls
        if calls.take(1, trusted):
            return ""
        whose = "" if trusted else " by clients outside server.trusted_uids"
        n = calls.limit if trusted else calls.untrusted_limit
        return f"cri-shim: more than {n} intercepted calls at once{whose} (server.max_intercepted_calls); retry"

    def full(self, trusted: bool) -> str:
        """Why a request does not fit in the request buffer."""
        buf = self.request_buffer
        if trusted:
            return (f"cri-shim: intercepted requests hold more than server.max_request_buffer_bytes "
                    f"({buf.limit} bytes); retry")
        return (f"cri-shim: intercepted requests of clients outside server.trusted_uids hold more than their share "
                f"of server.max_request_buffer_bytes ({buf.untrusted_limit} bytes); retry")

    def charge(self, s: LocalStream, n: int) -> bool:
        """Count ``n`` more bytes of ``s``'s request, if they fit."""
        if not self.request_buffer.take(n, s.trusted):
            return False
        s.budgeted += n
        return True

    def release(self, s: LocalStream) -> None:
        """What ``s`` holds is free."""
        if s.budgeted:
            self.request_buffer.give(s.budgeted, s.trusted)
            s.budgeted = 0
        if s.counted:
            self.calls.give(1, s.trusted)
            s.counted = False


def body_too_large(so_far: bytearray, body: bytes, limit: int, key: str) -> str:
    """Why ``body`` (a DATA payload after ``so_far`` of a request) makes it too large, or "".
    The gRPC message prefix declares the length: checked before the message is buffered."""
    have = len(so_far)
    if have < 5 <= have + len(body):
        declared = int.from_bytes((bytes(so_far) + body[:5 - have])[1:5], "big")
        if declared > limit:
            return too_large(declared, limit, key)
    if have + len(body) > limit + 5:
        return too_large(have + len(body) - 5, limit, key)
    return ""


def method_name(path: str) -> str:
    """The method part of a ``:path`` (``.../PullImage`` -> ``PullImage``), as grpc-go splits it."""
    return path[path.rfind("/") + 1:]


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    return sum(len(n) + len(v) + HEADER_FIELD_OVERHEAD for n, v in headers)


def request_limit(limits: Mapping[str, int], default: int, path: str) -> tuple[int, str]:
    """Bytes a request message of ``path``'s method may have (before and after
    decompression), and the key that sets it."""
    name = method_name(path)
    if limits.get(name, default) < default:
        return limits[name], f"server.max_request_bytes.{name}"
    return default, "server.max_message_bytes"  # no entry, or the entry is server.max_message_bytes


def too_large(size: int, limit: int, key: str) -> str:
    """The refusal of a request over its method's limit: grpc-go's words, and the key."""
    return f"cri-shim: received message larger than max ({size} vs. {limit}) ({key})"
