"""Which calls the shim answers, relays or refuses: one decision for both engines.

Every ``:path`` is first put in the form the runtime routes it by (``methods.canonical``),
then:

- a method in the interception table is answered by its handler, or, for an entry that is a
  ``Patch``, relayed with the runtime's response messages rewritten (the relay engine;
  the grpc engine answers it by the entry's handler);
- ``runtime.v1alpha2`` is refused with UNIMPLEMENTED, as containerd 2.x answers it (the
  shim does not check pins or the pull cap on it, so it must not reach containerd 1.6/1.7);
- CRI (``runtime.v1.*``, any method) and ``grpc.health.v1.Health`` are relayed;
- any other service (containerd's own API, introspection, ...) is refused with
  PERMISSION_DENIED unless ``server.allowed_services`` lets it through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Mapping, TypeVar

import grpc

from .methods import CRI_PACKAGE, canonical, service_of

H = TypeVar("H")

HEALTH_SERVICE = "grpc.health.v1.Health"
V1ALPHA2_PACKAGE = "runtime.v1alpha2"
ALLOWED_SERVICES_KEY = "server.allowed_services"
_QUOTE_MAX = 120  # characters of a client's :path quoted in a refusal
# Decisions remembered per :path as the client spelled it (every call routes once, and a
# connection calls the same few methods): paths up to this many characters, this many of
# them, so what clients send can make the memo hold at most about 128 KiB.
MEMO_PATH_MAX = 256
MEMO_ENTRIES = 512


@dataclass(frozen=True)
class Refusal:
    """Answer the call with this status at once; the runtime never sees it."""

    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class Intercept(Generic[H]):
    """Answer the call with ``handler``; ``method`` is the canonical method name."""

    method: str
    handler: H


@dataclass(frozen=True)
class Patch(Generic[H]):
    """Relay the call; rewrite each response message with ``rewrite`` (gRPC message bytes
    without the 5-byte prefix -> the bytes the client gets). ``handler`` answers it on an
    engine that cannot rewrite frames (the grpc engine), as an ``Intercept`` would."""

    method: str
    handler: H
    rewrite: Callable[[bytes], bytes]


def _quote(path: str) -> str:
    return repr(path[:_QUOTE_MAX] + ("..." if len(path) > _QUOTE_MAX else ""))


def _in_package(service: str, package: str) -> bool:
    return service.startswith(package + ".")


def check_allowed_services(entries: Iterable[str]) -> tuple[str, ...]:
    """Validate ``server.allowed_services``: full service names, or ``<prefix>.*``. Raises ValueError."""
    out = []
    for entry in entries:
        name = entry[:-2] if entry.endswith(".*") else entry
        if not name or "/" in name or "*" in name or any(c.isspace() for c in name):
            raise ValueError(f"{entry[:80]!r} is not a service name (e.g. containerd.services.version.v1.Version) "
                             "or a prefix ending in .* (e.g. containerd.services.*)")
        if V1ALPHA2_PACKAGE == name or _in_package(name, V1ALPHA2_PACKAGE) or _in_package(V1ALPHA2_PACKAGE, name):
            raise ValueError(f"{entry!r} would let {V1ALPHA2_PACKAGE} through, where the shim checks neither pins "
                             "nor the pull cap")
        out.append(entry)
    return tuple(out)


class Router(Generic[H]):
    """The routing decision for a ``:path``: Intercept, Patch, Refusal, or None (relay it as it is)."""

    def __init__(self, table: Mapping[str, H | Patch[H]] | None = None, allowed_services: Iterable[str] = ()) -> None:
        self.table: Mapping[str, H | Patch[H]] = dict(table or {})
        self.generation = 0  # bumped on every change: an engine caching decisions drops them
        self._memo: dict[str, Intercept[H] | Patch[H] | Refusal | None] = {}  # path -> decision, for this generation
        self.set_allowed_services(allowed_services)

    def set_table(self, table: Mapping[str, H | Patch[H]]) -> None:
        self.table = dict(table)
        self.generation += 1
        self._memo = {}

    def set_allowed_services(self, entries: Iterable[str]) -> None:
        entries = tuple(entries)
        self.generation += 1
        self._memo = {}
        self._exact = frozenset(e for e in entries if not e.endswith(".*"))
        self._prefixes = tuple(e[:-1] for e in entries if e.endswith(".*"))  # keep the dot

    def allowed(self, service: str) -> bool:
        return (_in_package(service, CRI_PACKAGE) or service == HEALTH_SERVICE or service in self._exact
                or service.startswith(self._prefixes))

    def route(self, path: str) -> Intercept[H] | Patch[H] | Refusal | None:
        memo = self._memo
        try:
            return memo[path]
        except KeyError:
            pass
        decision = self._decide(path)
        if len(path) <= MEMO_PATH_MAX:
            if len(memo) >= MEMO_ENTRIES:
                memo.clear()
            memo[path] = decision
        return decision

    def remembered(self) -> list[str]:
        """The paths whose decision is kept (at most MEMO_ENTRIES, each at most MEMO_PATH_MAX long)."""
        return list(self._memo)

    def _decide(self, path: str) -> Intercept[H] | Patch[H] | Refusal | None:
        method = canonical(path)
        if method is None:  # grpc-go's own answer
            return Refusal(grpc.StatusCode.UNIMPLEMENTED, f"malformed method name: {_quote(path)}")
        handler = self.table.get(method)
        if isinstance(handler, Patch):
            return handler
        if handler is not None:
            return Intercept(method, handler)
        service = service_of(method)
        if _in_package(service, V1ALPHA2_PACKAGE):
            return Refusal(grpc.StatusCode.UNIMPLEMENTED, f"unknown service {service}")
        if self.allowed(service):
            return None
        return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                       f"cri-shim: {_quote(service)} is not a CRI service; this socket serves runtime.v1 and "
                       f"{HEALTH_SERVICE} only (add the service to {ALLOWED_SERVICES_KEY} to let it through)")
