"""containerd's content API, as far as pull progress needs it.

containerd serves ``containerd.services.content.v1.Content`` on the CRI socket. The CRI
plugin keeps its images in the namespace ``k8s.io``, so every call carries the metadata
``containerd-namespace: k8s.io``. A runtime without this API (CRI-O) answers
UNIMPLEMENTED: ``NoContentApi`` then, and progress is reported as unknown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import grpc

from ..cri.deadline import Deadline
from ..cri.upstream import Upstream
from ..errors import RpcError
from ..proto.containerd.services.content.v1 import content_pb2 as pb

SERVICE = "/containerd.services.content.v1.Content/"
LIST_STATUSES = SERVICE + "ListStatuses"
LIST = SERVICE + "List"
READ = SERVICE + "Read"
ABORT = SERVICE + "Abort"
NAMESPACE = (("containerd-namespace", "k8s.io"),)
CALL_TIMEOUT_SECONDS = 5.0
MAX_MANIFEST_BYTES = 4 << 20  # a manifest larger than this is not read


class NoContentApi(Exception):
    """The runtime does not serve containerd's content API (e.g. CRI-O)."""


@dataclass(frozen=True, slots=True)
class Ingest:
    ref: str
    offset: int
    total: int
    started_wall: float  # wall-clock seconds


@dataclass(frozen=True, slots=True)
class StoredBlob:
    digest: str
    size: int
    labels: dict[str, str]
    touched_wall: float  # the later of created_at and updated_at (containerd 1.6 leaves updated_at unset in List)
    created_wall: float = 0.0  # when it was committed


def _wall(ts: object) -> float:
    seconds = getattr(ts, "seconds", 0)
    if seconds <= 0:
        return 0.0
    return seconds + getattr(ts, "nanos", 0) / 1e9


def quote(s: str) -> str:
    """A value in containerd's filter syntax (Go string quoting; JSON's is a subset for these)."""
    return json.dumps(s)


def regex_escape(s: str) -> str:
    """Escape the regexp metacharacters that can occur in a repository path."""
    return "".join("\\" + c if c in ".+*?()[]{}|^$\\" else c for c in s)


def repo_filters(host: str, repo: str) -> list[str]:
    """List filters for the image manifests and indexes labelled as fetched from ``host/repo``."""
    key = quote("containerd.io/distribution.source." + host)
    rx = quote(f"^(.*,)?{regex_escape(repo)}(,.*)?$")
    return [f'labels.{key}~={rx},labels."containerd.io/gc.ref.content.config"',
            f'labels.{key}~={rx},labels."containerd.io/gc.ref.content.m.0"']


def digest_filter(digest: str) -> str:
    return f"digest=={digest}"


class ContentClient:
    """The calls the progress poller makes; each counted in ``calls`` (by method name)."""

    def __init__(self, upstream: Upstream, on_call: Callable[[str], None] | None = None) -> None:
        self.upstream = upstream
        self.calls: dict[str, int] = {}
        self._on_call = on_call

    def _count(self, method: str) -> None:
        name = method.rpartition("/")[2]
        self.calls[name] = self.calls.get(name, 0) + 1
        if self._on_call is not None:
            self._on_call(name)

    @staticmethod
    def _check(e: RpcError) -> None:
        if e.code is grpc.StatusCode.UNIMPLEMENTED:
            raise NoContentApi(e.details) from None

    async def list_statuses(self) -> list[Ingest]:
        self._count(LIST_STATUSES)
        try:
            raw = await self.upstream.unary(LIST_STATUSES, b"", metadata=NAMESPACE,
                                            deadline=Deadline.after(CALL_TIMEOUT_SECONDS))
        except RpcError as e:
            self._check(e)
            raise
        return [Ingest(s.ref, s.offset, s.total, _wall(s.started_at))
                for s in pb.ListStatusesResponse.FromString(raw).statuses]

    async def list(self, filters: list[str]) -> list[StoredBlob]:
        """Committed blobs matching any of ``filters``."""
        self._count(LIST)
        req = pb.ListContentRequest(filters=filters).SerializeToString()
        out: list[StoredBlob] = []
        try:
            async for raw in self.upstream.server_stream(LIST, req, metadata=NAMESPACE,
                                                         deadline=Deadline.after(CALL_TIMEOUT_SECONDS)):
                for i in pb.ListContentResponse.FromString(raw).info:
                    out.append(StoredBlob(i.digest, i.size, dict(i.labels),
                                          max(_wall(i.created_at), _wall(i.updated_at)), _wall(i.created_at)))
        except RpcError as e:
            self._check(e)
            raise
        return out

    async def read(self, digest: str, size: int = 0) -> bytes:
        """A blob's bytes (manifests only: at most MAX_MANIFEST_BYTES)."""
        self._count(READ)
        req = pb.ReadContentRequest(digest=digest,
                                    size=min(size, MAX_MANIFEST_BYTES) if size else 0).SerializeToString()
        chunks: list[bytes] = []
        got = 0
        try:
            async for raw in self.upstream.server_stream(READ, req, metadata=NAMESPACE,
                                                         deadline=Deadline.after(CALL_TIMEOUT_SECONDS)):
                data = pb.ReadContentResponse.FromString(raw).data
                got += len(data)
                if got > MAX_MANIFEST_BYTES:
                    raise ValueError(f"{digest} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")
                chunks.append(data)
        except RpcError as e:
            self._check(e)
            raise
        return b"".join(chunks)

    async def abort(self, ref: str) -> None:
        self._count(ABORT)
        await self.upstream.unary(ABORT, pb.AbortRequest(ref=ref).SerializeToString(), metadata=NAMESPACE,
                                  deadline=Deadline.after(CALL_TIMEOUT_SECONDS))
