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

__all__ = ["CRI_PACKAGE", "Cardinality", "KNOWN_METHODS", "canonical", "cardinality", "cri_method", "method_path",
           "service_of"]


class Cardinality(enum.Enum):
    """How many messages flow each way in one call."""

    UNARY = "unary"
    SERVER_STREAM = "server_stream"
    CLIENT_STREAM = "client_stream"
    BIDI_STREAM = "bidi_stream"

    @classmethod
    def of(cls, method: MethodDescriptor) -> Cardinality:
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


def cri_method(service: str, name: str) -> str:
    """The path of a method of our CRI proto, e.g. ``cri_method("ImageService", "PullImage")``.

    KeyError if the proto has no such method: every method name the shim uses is checked here.
    """
    return method_path(api_pb2.DESCRIPTOR.services_by_name[service].methods_by_name[name])


def canonical(path: str) -> str | None:
    """The method a gRPC server written in Go routes ``path`` to, as ``/<service>/<method>``.

    grpc-go's ``Server.handleStream`` takes ``:path`` as it is (no unescaping), drops one
    leading ``/`` and splits what is left at its LAST ``/`` into service and method. Up to
    grpc-go 1.80 (containerd 1.6/1.7, CRI-O) the leading ``/`` is optional; 1.81 and later
    (containerd 2.4) answer UNIMPLEMENTED "malformed method name" without it. So
    ``runtime.v1.ImageService/RemoveImage`` may reach RemoveImage too: every check keyed
    on a method name compares this form. ``None``: no runtime routes ``path`` anywhere
    (no ``/`` left after the leading one).
    """
    rest = path[1:] if path.startswith("/") else path
    service, sep, name = rest.rpartition("/")
    return f"/{service}/{name}" if sep else None


def service_of(method: str) -> str:
    """The service of a method in canonical form.

    ``/runtime.v1.ImageService/PullImage`` -> ``runtime.v1.ImageService``.
    """
    return method[1:].rpartition("/")[0]


def _build(file: FileDescriptor) -> dict[str, Cardinality]:
    table: dict[str, Cardinality] = {}
    for service in file.services_by_name.values():
        for method in service.methods:
            table[method_path(method)] = Cardinality.of(method)
    return table


CRI_PACKAGE: str = api_pb2.DESCRIPTOR.package
"""``runtime.v1``: the protobuf package of the CRI services."""

KNOWN_METHODS: dict[str, Cardinality] = _build(api_pb2.DESCRIPTOR)
"""Every rpc declared in our runtime.v1 proto. Treat as read-only."""


def cardinality(method: str) -> Cardinality | None:
    """Cardinality of a CRI method path, or ``None`` if the method is unknown.

    Callers should proxy unknown methods as bidirectional streams, which is
    correct for any cardinality.
    """
    routed = canonical(method)
    return KNOWN_METHODS.get(routed) if routed is not None else None


# Every CRI method the shim answers or calls itself: each path defined here once, from the proto.
PULL_IMAGE = cri_method("ImageService", "PullImage")
IMAGE_STATUS = cri_method("ImageService", "ImageStatus")
LIST_IMAGES = cri_method("ImageService", "ListImages")
STREAM_IMAGES = cri_method("ImageService", "StreamImages")
REMOVE_IMAGE = cri_method("ImageService", "RemoveImage")
IMAGE_FS_INFO = cri_method("ImageService", "ImageFsInfo")
RUN_POD_SANDBOX = cri_method("RuntimeService", "RunPodSandbox")
REMOVE_POD_SANDBOX = cri_method("RuntimeService", "RemovePodSandbox")
LIST_POD_SANDBOX = cri_method("RuntimeService", "ListPodSandbox")
