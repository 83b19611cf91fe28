"""CRI v1 method table: full gRPC method path -> call cardinality.

The table is derived at import time from the service descriptors of our own
``proto/runtime/v1/api.proto`` (via the generated ``api_pb2``), so the list of
methods lives in exactly one place. Method paths have the gRPC wire form
``/runtime.v1.RuntimeService/Version``.
"""

from __future__ import annotations

import enum
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor

from shim.proto.runtime.v1 import api_pb2

__all__ = ["Cardinality", "KNOWN_METHODS", "cardinality", "method_path"]


class Cardinality(enum.Enum):
    """How many messages flow each way in one call."""

    UNARY = "unary"
    SERVER_STREAM = "server_stream"
    CLIENT_STREAM = "client_stream"
    BIDI_STREAM = "bidi_stream"

    @classmethod
    def of(cls, method: MethodDescriptor) -> "Cardinality":
        """Cardinality of a protobuf method descriptor."""
        match (method.client_streaming, method.server_streaming):
            case (False, False):
                return cls.UNARY
            case (False, True):
                return cls.SERVER_STREAM
            case (True, False):
                return cls.CLIENT_STREAM
            case _:
                return cls.BIDI_STREAM


def method_path(method: MethodDescriptor) -> str:
    """gRPC path of a method: ``/<package>.<Service>/<Method>``."""
    return f"/{method.containing_service.full_name}/{method.name}"


def _build(file: FileDescriptor) -> dict[str, Cardinality]:
    table: dict[str, Cardinality] = {}
    for service in file.services_by_name.values():
        for method in service.methods:
            table[method_path(method)] = Cardinality.of(method)
    return table


KNOWN_METHODS: dict[str, Cardinality] = _build(api_pb2.DESCRIPTOR)
"""Every rpc declared in our runtime.v1 proto. Treat as read-only."""


def cardinality(method: str) -> Cardinality | None:
    """Cardinality of a CRI method path, or ``None`` if the method is unknown.

    Callers should proxy unknown methods as bidirectional streams, which is
    correct for any cardinality.
    """
    return KNOWN_METHODS.get(method)
