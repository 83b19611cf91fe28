"""The relay's view of ``server.*`` (shim/config.py ``ServerConfig``): no defaults of its own.

Every bound the relay enforces is read from the ServerConfig it was given, under the
config's own key names; this module adds only the process-wide pools those keys size
(memory.py), shared by every connection of one listener, and the per-method request
limits as a mapping. Build it with ``Limits.of(server)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import ServerConfig
from .memory import Pool


@dataclass(frozen=True)
class Limits:
    server: ServerConfig
    request_buffer: Pool  # bytes of intercepted requests, all connections (server.max_request_buffer_bytes)
    calls: Pool  # intercepted calls at once, all connections (server.max_intercepted_calls)
    max_request_bytes: Mapping[str, int]  # method name -> bytes (server.max_request_bytes)

    @classmethod
    def of(cls, server: ServerConfig, request_buffer: Pool | None = None, calls: Pool | None = None) -> Limits:
        """The limits of ``server``; pass pools to share them (e.g. between tests' connections)."""
        return cls(server,
                   request_buffer if request_buffer is not None else Pool(server.max_request_buffer_bytes),
                   calls if calls is not None else Pool(server.max_intercepted_calls),
                   dict(server.max_request_bytes))
