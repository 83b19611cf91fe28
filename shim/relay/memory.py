"""What intercepted calls may hold in memory, over all connections (README "Limits").

- ``Pool``: a process-wide bound shared by every connection. Two of them: bytes of
  intercepted requests (``server.max_request_buffer_bytes``: the decoded header list and
  the body, and the message again after decompression) and intercepted calls at once
  (``server.max_intercepted_calls``). A request holds its share from its first frame
  until its handler ends (or it is refused, reset, or its connection closes). Clients
  whose uid is in ``server.trusted_uids`` (kubelet runs as root) may use all of a pool;
  the others together at most ``UNTRUSTED_SHARE`` of it, so another local user cannot
  take the room kubelet's calls need.
- Request size per method (``server.max_request_bytes``): the gRPC message prefix
  declares the length, so a request over its method's limit is refused before its body
  is buffered, RESOURCE_EXHAUSTED as grpc-go answers "received message larger than max".
"""

from __future__ import annotations

from typing import Mapping

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
