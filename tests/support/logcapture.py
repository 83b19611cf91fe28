"""Keeping the log records a shim logger emits, for tests that read what it said."""

from __future__ import annotations

import logging


class Lines(logging.Handler):
    """A handler that keeps every record it is given (``records``)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
