"""Errors that reach the CRI caller as a gRPC status."""

from __future__ import annotations

import grpc

Metadata = tuple[tuple[str, str | bytes], ...]


class RpcError(Exception):
    """A status to return to the caller: code, details and trailing metadata.

    Raised for the runtime's own errors (``from_upstream=True``; code, details and
    trailers are passed back unchanged, ``grpc-status-details-bin`` included) and for
    the shim's refusals (a message a node operator can act on).
    """

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Metadata = (),
                 *, from_upstream: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata
        self.from_upstream = from_upstream

    @classmethod
    def from_aio(cls, e: grpc.aio.AioRpcError) -> RpcError:
        md = e.trailing_metadata() or ()
        return cls(e.code(), e.details() or "", tuple((k, v) for k, v in md) if md else (),
                   from_upstream=True)


def invalid_request(message_type: str, err: Exception) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                    f"cri-shim: malformed {message_type}: {err or 'cannot decode protobuf'}")


def check_image_name(name: str, field: str) -> None:
    """INVALID_ARGUMENT for an image name longer than any image reference can be
    (reference.MAX_LENGTH), before it is looked at, logged or sent on."""
    from .reference import MAX_LENGTH  # local import: errors is imported by everything

    if len(name) > MAX_LENGTH:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"cri-shim: {field} has {len(name)} characters; an image reference has at most {MAX_LENGTH}")
