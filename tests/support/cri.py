"""Raw CRI calls over a unix socket, without generated protobuf code.

:func:`call` / :func:`acall` make a generic unary gRPC call with request and
response as raw bytes (no serializers), so tests can compare answers byte for
byte between containerd and the shim.  A tiny protobuf wire encoder/decoder
covers the few image-service messages the harness needs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
import grpc.aio

IMAGE_SERVICE = "runtime.v1.ImageService"
RUNTIME_SERVICE = "runtime.v1.RuntimeService"
IMAGE_METHODS = frozenset({"PullImage", "ImageStatus", "ListImages", "RemoveImage", "ImageFsInfo"})

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]

Metadata = tuple[tuple[str, str | bytes], ...]


def method_path(method: str) -> str:
    """``PullImage`` -> ``/runtime.v1.ImageService/PullImage``; a path (anything with a ``/``) is sent as it is."""
    if "/" in method:
        return method
    service = IMAGE_SERVICE if method in IMAGE_METHODS else RUNTIME_SERVICE
    return f"/{service}/{method}"


def target(socket: str | os.PathLike[str]) -> str:
    """A grpc target for a socket path or ``unix://`` URL."""
    s = os.fspath(socket)
    if s.startswith("unix:"):
        return s
    return f"unix://{s}"


@dataclass(frozen=True)
class CallResult:
    """Outcome of one raw call: response bytes or an error status."""

    code: grpc.StatusCode
    response: bytes | None
    details: str | None = None
    initial_metadata: Metadata = ()
    trailing_metadata: Metadata = ()

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def unwrap(self) -> bytes:
        """The response bytes; raises ``AssertionError`` on an error status."""
        if not self.ok or self.response is None:
            raise AssertionError(f"CRI call failed: {self.code.name}: {self.details}")
        return self.response

    def error_tuple(self) -> tuple[grpc.StatusCode, str | None]:
        return self.code, self.details


def _md(md: Sequence[tuple[str, str | bytes]] | None) -> Metadata:
    return tuple((k, v) for k, v in (md or ()))


def call(
    socket: str | os.PathLike[str],
    method: str,
    request: bytes,
    timeout: float = 30.0,
    metadata: Sequence[tuple[str, str]] | None = None,
    wait_for_ready: bool = False,
) -> CallResult:
    """Blocking raw unary call on a fresh channel (safe to use from any thread)."""
    with grpc.insecure_channel(target(socket), options=_CHANNEL_OPTIONS) as channel:
        stub = channel.unary_unary(method_path(method))
        try:
            response, c = stub.with_call(
                request, timeout=timeout, metadata=metadata, wait_for_ready=wait_for_ready
            )
        except grpc.RpcError as e:
            return CallResult(
                e.code(),  # type: ignore[attr-defined]
                None,
                e.details(),  # type: ignore[attr-defined]
                _md(e.initial_metadata()),  # type: ignore[attr-defined]
                _md(e.trailing_metadata()),  # type: ignore[attr-defined]
            )
        return CallResult(
            c.code(), response, c.details(), _md(c.initial_metadata()), _md(c.trailing_metadata())
        )


async def acall(
    socket: str | os.PathLike[str],
    method: str,
    request: bytes,
    timeout: float = 30.0,
    metadata: Sequence[tuple[str, str]] | None = None,
    wait_for_ready: bool = False,
) -> CallResult:
    """Async (grpc.aio) version of :func:`call`."""
    async with grpc.aio.insecure_channel(target(socket), options=_CHANNEL_OPTIONS) as channel:
        c = channel.unary_unary(method_path(method))(
            request, timeout=timeout, metadata=metadata, wait_for_ready=wait_for_ready
        )
        try:
            response = await c
        except grpc.aio.AioRpcError as e:
            return CallResult(
                e.code(), None, e.details(), _md(e.initial_metadata()), _md(e.trailing_metadata())
            )
        return CallResult(
            await c.code(),
            response,
            await c.details(),
            _md(await c.initial_metadata()),
            _md(await c.trailing_metadata()),
        )


# --------------------------------------------------------------------------
# Protobuf wire format (just enough for the image service)
# --------------------------------------------------------------------------



def wait_runtime_ready(name: str, socket: str | os.PathLike[str], proc: subprocess.Popen[bytes] | None,
                       log_tail: Callable[[], str], timeout: float) -> None:
    """Wait until a runtime process (containerd, CRI-O) answers CRI ``Version`` on ``socket``;
    RuntimeError if it exits first, TimeoutError (with its log tail) if it never answers."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_tail()}")
        if os.path.exists(socket):
            res = call(str(socket), "Version", b"", timeout=2.0)
            if res.ok:
                return
            last = res
        time.sleep(0.05)
    raise TimeoutError(f"{name} not ready on {socket} ({last}):\n{log_tail()}")

def varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_bytes(number: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def field_map(number: int, entries: dict[str, str]) -> bytes:
    return b"".join(
        field_bytes(number, field_bytes(1, k) + field_bytes(2, v)) for k, v in sorted(entries.items())
    )


def decode(data: bytes) -> dict[int, list[int | bytes]]:
    """Decode one message level: field number -> values (ints or raw bytes)."""
    out: dict[int, list[int | bytes]] = {}
    i, n = 0, len(data)

    def read_varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while i < n:
        key = read_varint()
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value = read_varint()
        elif wire == 2:
            length = read_varint()
            value = data[i : i + length]
            i += length
        elif wire == 1:
            value = int.from_bytes(data[i : i + 8], "little")
            i += 8
        elif wire == 5:
            value = int.from_bytes(data[i : i + 4], "little")
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def _str(fields: dict[int, list[int | bytes]], number: int) -> str:
    vals = fields.get(number)
    return vals[-1].decode() if vals else ""  # type: ignore[union-attr]


def _strs(fields: dict[int, list[int | bytes]], number: int) -> list[str]:
    return [v.decode() for v in fields.get(number, [])]  # type: ignore[union-attr]


def image_spec(image: str, annotations: dict[str, str] | None = None) -> bytes:
    return field_bytes(1, image) + (field_map(2, annotations) if annotations else b"")


def auth_config(
    username: str | None = None,
    password: str | None = None,
    auth: str | None = None,
    server_address: str | None = None,
) -> bytes:
    out = b""
    for number, value in ((1, username), (2, password), (3, auth), (4, server_address)):
        if value:
            out += field_bytes(number, value)
    return out


def pull_image_request(
    image: str,
    *,
    username: str | None = None,
    password: str | None = None,
    auth: str | None = None,
    server_address: str | None = None,
    annotations: dict[str, str] | None = None,
) -> bytes:
    """``PullImageRequest{image: ImageSpec{image}, auth: AuthConfig{...}}``."""
    out = field_bytes(1, image_spec(image, annotations))
    creds = auth_config(username, password, auth, server_address)
    if creds:
        out += field_bytes(2, creds)
    return out


def image_status_request(image: str, verbose: bool = False) -> bytes:
    return field_bytes(1, image_spec(image)) + (field_varint(2, 1) if verbose else b"")


def list_images_request(image_filter: str | None = None) -> bytes:
    if image_filter is None:
        return b""
    return field_bytes(1, field_bytes(1, image_spec(image_filter)))


def remove_image_request(image: str) -> bytes:
    return field_bytes(1, image_spec(image))


def version_request(version: str = "v1") -> bytes:
    return field_bytes(1, version)


@dataclass(frozen=True)
class ImageInfo:
    """The CRI ``Image`` message fields the harness cares about."""

    id: str
    repo_tags: list[str] = field(default_factory=list)
    repo_digests: list[str] = field(default_factory=list)
    size: int = 0
    pinned: bool = False


def decode_image(data: bytes) -> ImageInfo:
    f = decode(data)
    size = f.get(4, [0])[-1]
    pinned = f.get(8, [0])[-1]
    return ImageInfo(_str(f, 1), _strs(f, 2), _strs(f, 3), int(size), bool(pinned))  # type: ignore[arg-type]


def decode_pull_image_response(data: bytes) -> str:
    """The ``image_ref`` (image id) of a PullImageResponse."""
    return _str(decode(data), 1)


def decode_image_status_response(data: bytes) -> ImageInfo | None:
    f = decode(data)
    if not f.get(1):
        return None
    return decode_image(f[1][-1])  # type: ignore[arg-type]


def decode_list_images_response(data: bytes) -> list[ImageInfo]:
    return [decode_image(v) for v in decode(data).get(1, [])]  # type: ignore[arg-type]


def decode_version_response(data: bytes) -> dict[str, str]:
    f = decode(data)
    return {
        "version": _str(f, 1),
        "runtime_name": _str(f, 2),
        "runtime_version": _str(f, 3),
        "runtime_api_version": _str(f, 4),
    }


async def until_ok(ch: grpc.aio.Channel, method: str, request: bytes, timeout: float = 15.0,
                   call_timeout: float = 5.0) -> float:
    """Seconds until ``method`` succeeds on ``ch``, trying every 50 ms like a retrying client."""
    t0 = time.monotonic()
    while True:
        try:
            await ch.unary_unary(method)(request, timeout=call_timeout)
            return time.monotonic() - t0
        except grpc.aio.AioRpcError as e:
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"{method} still failing after {timeout}s: {e.code().name} {e.details()}")
        await asyncio.sleep(0.05)


class Timed(NamedTuple):
    code: grpc.StatusCode
    seconds: float  # from before the call object was built
    details: str  # the error's details ("" when OK)
    response: bytes | None  # the answer (None on an error)


def timed(start: Callable[[], Awaitable[bytes]]) -> Coroutine[None, None, Timed]:
    """Start the call now and time it from before it is made: grpc.aio fixes a call's deadline when
    the call object is built, so a clock started later (when the coroutine first runs) reads less
    than the deadline. ``start`` builds the call (``lambda: ch.unary_unary(M)(req, timeout=...)``)."""
    t0 = time.monotonic()
    call = start()

    async def finish() -> Timed:
        try:
            response = await call
            return Timed(grpc.StatusCode.OK, time.monotonic() - t0, "", response)
        except grpc.aio.AioRpcError as e:
            return Timed(e.code(), time.monotonic() - t0, e.details() or "", None)
    return finish()
