"""A scripted containerd content API (ListStatuses, List, Read, Abort) for a FakeRuntime.

``Store`` holds committed blobs (with containerd's labels) and ingests; tests change it
between polls. ``serve(runtime)`` installs the handlers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shim.proto.containerd.services.content.v1 import content_pb2 as pb

MiB = 1 << 20
SVC = "/containerd.services.content.v1.Content/"
START_WALL = 1000.0


def dg(c: str) -> str:
    return "sha256:" + c * 64


@dataclass
class Store:
    """What containerd's content store holds: committed blobs (with labels) and ingests."""

    blobs: dict[str, tuple[int, dict[str, str], float, bytes]] = field(default_factory=dict)
    ingests: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # ref -> offset, total, started
    aborted: list[str] = field(default_factory=list)
    namespaces: set[str] = field(default_factory=set)

    def add_image(self, repo: str, tag_char: str, layer_sizes: list[int], *, touched: float = START_WALL + 1,
                  host: str = "reg.test") -> tuple[str, list[str]]:
        cfg = dg(tag_char.upper() if tag_char.isalpha() else "f")
        layers = [dg(chr(ord("0") + i) if i < 10 else "e") for i in range(len(layer_sizes))]
        layers = [d[:-2] + tag_char + str(i) for i, d in enumerate(layers)]
        doc = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
               "config": {"digest": cfg, "size": 100},
               "layers": [{"digest": d, "size": n} for d, n in zip(layers, layer_sizes)]}
        data = json.dumps(doc).encode()
        m = dg(tag_char)
        labels = {f"containerd.io/distribution.source.{host}": repo, "containerd.io/gc.ref.content.config": cfg,
                  **{f"containerd.io/gc.ref.content.l.{i}": d for i, d in enumerate(layers)}}
        self.blobs[m] = (len(data), labels, touched, data)
        self.blobs[cfg] = (100, {}, START_WALL - 10, b"{}")  # already in the store before the pull
        return m, layers

    def write(self, digest: str, offset: int, total: int) -> None:
        self.ingests[f"layer-{digest}"] = (offset, total, START_WALL + 1)

    def commit(self, digest: str, size: int) -> None:
        self.ingests.pop(f"layer-{digest}", None)
        self.blobs[digest] = (size, {}, START_WALL + 2, b"")

    def serve(self, rt) -> None:
        store = self

        async def list_statuses(request: bytes, context) -> bytes:
            store.namespaces.add(dict(context.invocation_metadata()).get("containerd-namespace", ""))
            statuses = []
            for r, (o, t, started) in store.ingests.items():
                st = pb.Status(ref=r, offset=o, total=t)
                st.started_at.seconds = int(started)
                statuses.append(st)
            return pb.ListStatusesResponse(statuses=statuses).SerializeToString()

        async def abort(request: bytes, context) -> bytes:
            ref = pb.AbortRequest.FromString(request).ref
            store.aborted.append(ref)
            store.ingests.pop(ref, None)
            return b""

        async def list_content(request: bytes, context):
            filters = pb.ListContentRequest.FromString(request).filters
            infos = []
            for d, (size, labels, touched, _) in store.blobs.items():
                if any(_matches(f, d, labels) for f in filters):
                    info = pb.Info(digest=d, size=size, labels=labels)
                    info.created_at.seconds = int(touched)
                    infos.append(info)
            yield pb.ListContentResponse(info=infos).SerializeToString()

        async def read(request: bytes, context):
            d = pb.ReadContentRequest.FromString(request).digest
            yield pb.ReadContentResponse(data=store.blobs[d][3]).SerializeToString()

        rt.unary[SVC + "ListStatuses"] = list_statuses
        rt.unary[SVC + "Abort"] = abort
        rt.streams[SVC + "List"] = list_content
        rt.streams[SVC + "Read"] = read


def _matches(f: str, digest: str, labels: dict[str, str]) -> bool:
    """Enough of containerd's filter semantics for the filters the poller sends."""
    if f.startswith("digest=="):
        return f == f"digest=={digest}"
    key = f.split("~=")[0].removeprefix("labels.").strip('"')
    repo = json.loads(f.split("~=")[1].split(",labels.")[0]).strip("^$").replace("(.*,)?", "").replace("(,.*)?", "")
    kind = "containerd.io/gc.ref.content.config" if f.endswith('config"') else "containerd.io/gc.ref.content.m.0"
    return repo.replace("\\", "") in labels.get(key, "").split(",") and kind in labels
