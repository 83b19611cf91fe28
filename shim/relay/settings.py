"""SETTINGS of both peers, as far as the shim acts on them.

Frames of the runtime's SETTINGS reach the client rewritten (``runtime_settings``):
HEADER_TABLE_SIZE at most ``MAX_TABLE_SIZE`` (the shim keeps a copy of the client's
table toward the runtime), MAX_HEADER_LIST_SIZE at most the shim's,
MAX_CONCURRENT_STREAMS the lower of the shim's and the runtime's. The client's SETTINGS
go to the runtime as they are. Client SETTINGS are checked (``client_values``) and take
effect on receipt for what the shim sends itself (window and frame size); only
increases wait for the runtime's ACK (``acked_by_runtime``), since gRPC clients check
DATA against the settings they know acknowledged.
"""

from __future__ import annotations

from collections import deque

from . import http2
from .http2 import H2Error

# The largest HPACK table the client may use toward the runtime: the shim mirrors it
# (hpack_decoder.py), so it is bounded here (4096 is HTTP/2's default).
MAX_TABLE_SIZE = 4096


class PeerSettings:
    __slots__ = (
        "_max_concurrent_streams",
        "_max_header_list",
        "client_initial_window",
        "client_max_frame",
        "max_frame_in",
        "max_streams",
        "client_tables",
        "runtime_initial_window",
        "runtime_table",
        "unacked",
    )

    def __init__(self, max_concurrent_streams: int, max_header_list_bytes: int) -> None:
        self._max_concurrent_streams = max_concurrent_streams  # server.max_concurrent_streams
        self._max_header_list = max_header_list_bytes  # server.max_header_list_bytes
        self.max_frame_in = http2.DEFAULT_MAX_FRAME  # what the client may send (advertised by the runtime)
        self.runtime_initial_window = http2.DEFAULT_WINDOW  # the client's initial send window per stream
        self.client_initial_window = http2.DEFAULT_WINDOW  # the shim's initial send window per stream
        self.client_max_frame = http2.DEFAULT_MAX_FRAME  # the largest frame the shim may send the client
        self.max_streams = max_concurrent_streams  # lowered by the runtime's MAX_CONCURRENT_STREAMS
        self.unacked: deque[dict[int, int]] = deque()  # client SETTINGS the runtime has not acknowledged
        self.runtime_table = http2.DEFAULT_TABLE_SIZE  # the runtime's HPACK decoder table, as it advertised
        self.client_tables: deque[int] = deque()  # table sizes sent to the client, not yet acknowledged

    def runtime_settings(self, raw: bytes) -> tuple[bytes, int]:
        """The runtime's SETTINGS frame as the client gets it, and how much the client's
        initial stream window changed (the shim's receive windows change with it)."""
        payload = raw[9:]
        values = http2.settings_payload(payload)
        delta = 0
        if http2.SETTINGS_MAX_FRAME_SIZE in values:
            self.max_frame_in = max(http2.DEFAULT_MAX_FRAME,
                                    min(values[http2.SETTINGS_MAX_FRAME_SIZE], http2.MAX_FRAME_LIMIT))
        if http2.SETTINGS_INITIAL_WINDOW_SIZE in values:
            new = values[http2.SETTINGS_INITIAL_WINDOW_SIZE]
            delta = new - self.runtime_initial_window
            self.runtime_initial_window = new
        if http2.SETTINGS_MAX_CONCURRENT_STREAMS in values:  # in force until the runtime changes it again
            self.max_streams = min(self._max_concurrent_streams, values[http2.SETTINGS_MAX_CONCURRENT_STREAMS])
        self.runtime_table = values.get(http2.SETTINGS_HEADER_TABLE_SIZE, self.runtime_table)
        table = min(self.runtime_table, MAX_TABLE_SIZE)
        self.client_tables.append(table)
        payload = http2.with_table_size(payload, table, self._max_header_list)
        return http2.frame(http2.SETTINGS, 0, 0, payload + http2.setting(http2.SETTINGS_MAX_CONCURRENT_STREAMS,
                                                                 self.max_streams)), delta

    @staticmethod
    def client_values(payload: bytes, length: int) -> dict[int, int]:
        """A client SETTINGS payload (length a multiple of 6), checked."""
        values: dict[int, int] = {}
        for k in range(0, length, 6):
            key = payload[k] << 8 | payload[k + 1]
            value = int.from_bytes(payload[k + 2:k + 6], "big")
            if key == http2.SETTINGS_ENABLE_PUSH and value > 1:
                raise H2Error(f"SETTINGS_ENABLE_PUSH {value}")
            if key == http2.SETTINGS_INITIAL_WINDOW_SIZE and value > http2.MAX_WINDOW:
                raise H2Error(f"SETTINGS_INITIAL_WINDOW_SIZE {value}", http2.FLOW_CONTROL_ERROR)
            if key == http2.SETTINGS_MAX_FRAME_SIZE and not http2.DEFAULT_MAX_FRAME <= value <= http2.MAX_FRAME_LIMIT:
                raise H2Error(f"SETTINGS_MAX_FRAME_SIZE {value}")
            values[key] = value
        return values

    def apply_client(self, values: dict[int, int], increases: bool) -> int | None:
        """Client ``values`` in force for what the shim sends (only decreases unless ``increases``).
        Returns how much the shim's stream send windows change, or None if they do not."""
        delta = None
        window = values.get(http2.SETTINGS_INITIAL_WINDOW_SIZE)
        if window is not None and (increases or window < self.client_initial_window):
            delta = window - self.client_initial_window
            self.client_initial_window = window
        frame_size = values.get(http2.SETTINGS_MAX_FRAME_SIZE)
        if frame_size is not None and (increases or frame_size < self.client_max_frame):
            self.client_max_frame = frame_size
        return delta
