"""What the sans-IO core tells its adapter (connection.py) to do: ``RelayCore.take_events()``."""

from __future__ import annotations

from dataclasses import dataclass

from .streams import LocalStream


@dataclass(frozen=True)
class PrefaceReceived:
    """A valid client preface: time to connect to the runtime."""


@dataclass(frozen=True)
class Request:
    """A complete intercepted request: run its handler (``stream.handler``, routed once at its HEADERS)."""

    stream: LocalStream


@dataclass(frozen=True)
class Cancelled:
    """The client reset an intercepted stream whose handler may be running."""

    sid: int


@dataclass(frozen=True)
class WindowOpened:
    """Flow-control room grew: local senders may go on."""


@dataclass(frozen=True)
class StreamRefused:
    """A new stream was over the streams allowed at once (``limit``): refused, never relayed."""

    limit: int


@dataclass(frozen=True)
class ConnectionClosed:
    """The connection ends: write what is pending, then close both sides."""

    reason: str
    code: int


Event = PrefaceReceived | Request | Cancelled | WindowOpened | StreamRefused | ConnectionClosed
