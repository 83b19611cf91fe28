"""Pull progress: the arithmetic, with no I/O (the poller feeds it what the runtime says).

One ``FlightProgress`` per upstream pull. Once the pull's image manifest is known
(``Manifest``: config and layers with their sizes), each poll tells it which blobs are
being written (ingest offset) and which are committed; from that it derives bytes done
and total, layers done, the rate over the last seconds, the ETA, the phase and which of
the 25/50/75/100 % steps were crossed. ``stall()`` decides whether the download moved
too few bytes over a whole window. Every method takes ``now`` (monotonic seconds), so
tests drive it with a fake clock.

Which manifest belongs to which pull is decided by ``resolve()`` from the runtime's own
records (see its docstring); when that is not certain the pull's progress stays unknown.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

# containerd copies a download into its content store through a 1 MiB buffer, filled
# completely before each write: an ingest's offset moves in steps of this size.
COPY_QUANTUM = 1 << 20
RATE_WINDOW_SECONDS = 10.0
STEPS = (25, 50, 75, 100)

MANIFEST_TYPES = frozenset({"application/vnd.oci.image.manifest.v1+json",
                            "application/vnd.docker.distribution.manifest.v2+json"})
INDEX_TYPES = frozenset({"application/vnd.oci.image.index.v1+json",
                         "application/vnd.docker.distribution.manifest.list.v2+json"})

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
SOURCE_LABEL = "containerd.io/distribution.source."
CONFIG_LABEL = "containerd.io/gc.ref.content.config"
LAYER_LABEL = "containerd.io/gc.ref.content.l."
CHILD_MANIFEST_LABEL = "containerd.io/gc.ref.content.m."


def ingest_digest(ref: str) -> str | None:
    """The blob digest in a containerd ingest ref, or None.

    containerd names ingests ``<kind>-<digest>`` (``layer-sha256:…``, ``config-…``,
    ``manifest-…``, ``index-…``, ``attestation-…``, ``unknown-…``; 1.6 and 2.x alike), or
    ``<kind>-<name>@<digest>`` when the descriptor carries an OCI ref-name annotation,
    or a prefix of the caller's choosing: the digest is the last ``sha256:<64 hex>``.
    """
    found = _DIGEST.findall(ref)
    return found[-1] if found else None


@dataclass(frozen=True, slots=True)
class Blob:
    digest: str
    size: int
    kind: str  # config | layer


@dataclass(frozen=True, slots=True)
class Manifest:
    digest: str
    blobs: tuple[Blob, ...]  # the config first, then the layers in order

    @property
    def total(self) -> int:
        return sum(b.size for b in self.blobs)

    @property
    def layers(self) -> tuple[Blob, ...]:
        return tuple(b for b in self.blobs if b.kind == "layer")


def parse_manifest(digest: str, data: bytes) -> Manifest | None:
    """An image manifest's blobs and sizes; None for anything else (an index, garbage)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict) or "manifests" in doc:
        return None
    config, layers = doc.get("config"), doc.get("layers")
    if not isinstance(config, dict) or not isinstance(layers, list):
        return None
    blobs = []
    for kind, d in [("config", config), *(("layer", x) for x in layers)]:
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str) or not isinstance(d.get("size"), int):
            return None
        blobs.append(Blob(d["digest"], max(0, d["size"]), kind))
    return Manifest(digest, tuple(blobs))


# --------------------------------------------------------------------------- which manifest


@dataclass(frozen=True, slots=True)
class StoredManifest:
    """A manifest (or index) in the runtime's content store, as its labels describe it."""

    digest: str
    repos: frozenset[str]  # containerd.io/distribution.source.<host> values: repositories it came from
    blobs: frozenset[str]  # config and layer digests (gc.ref labels)
    children: frozenset[str]  # an index's manifests
    touched: float  # wall-clock seconds of its last change (commit, label update)

    @property
    def is_index(self) -> bool:
        return bool(self.children) and not self.blobs

    @classmethod
    def from_labels(cls, digest: str, labels: Mapping[str, str], touched: float, host: str) -> StoredManifest:
        repos = frozenset(r for r in labels.get(SOURCE_LABEL + host, "").split(",") if r)
        blobs = frozenset(v for k, v in labels.items() if k == CONFIG_LABEL or k.startswith(LAYER_LABEL))
        children = frozenset(v for k, v in labels.items() if k.startswith(CHILD_MANIFEST_LABEL))
        return cls(digest, repos, blobs, children, touched)


@dataclass(frozen=True, slots=True)
class Unresolved:
    reason: str


def resolve(repo: str, digest: str | None, started_wall: float, other_refs: Mapping[str, float],
            stored: Iterable[StoredManifest], ingesting: Iterable[str],
            taken: Mapping[str, str], ref: str) -> str | Unresolved:
    """The digest of the image manifest a running pull is fetching, when it is certain.

    - A pull by digest: that digest when it is an image manifest; when it is an index,
      its one child manifest that this pull touched.
    - A pull by tag: the runtime labels every manifest it fetches with the repository
      it came from (``containerd.io/distribution.source.<host>``) and commits or updates
      it when fetched. The candidates are the image manifests of that repository
      touched since the pull started, or with a blob being downloaded now. When other
      tags of the same repository were pulled through the shim meanwhile
      (``other_refs``: ref -> when the first of its pulls started), their known
      manifests (``taken``: manifest -> ref) are set aside. While one of them is still
      unknown, only a manifest touched after this pull started and before any of those
      did can be this pull's for sure.

    Exactly one candidate: its digest. Otherwise ``Unresolved`` with the reason.
    """
    stored = [m for m in stored if repo in m.repos or m.digest == digest]
    busy = set(ingesting)
    if digest is not None:
        by_digest = {m.digest: m for m in stored}
        top = by_digest.get(digest)
        if top is None:
            return Unresolved("manifest not fetched yet")
        if not top.is_index:
            return digest
        kids = [by_digest[c] for c in top.children if c in by_digest and not by_digest[c].is_index
                and (by_digest[c].touched >= started_wall or by_digest[c].blobs & busy)]
        return kids[0].digest if len(kids) == 1 else Unresolved("platform manifest not known yet")
    mine = [m for m in stored if not m.is_index and m.blobs
            and (m.touched >= started_wall or m.blobs & busy)
            and taken.get(m.digest, ref) == ref]
    known = set(taken.values())
    unknown_others = [start for r, start in other_refs.items() if r != ref and r not in known]
    if unknown_others:
        limit = min(unknown_others)
        sure = [m for m in mine if started_wall <= m.touched < limit]
        if len(sure) == 1:
            return sure[0].digest
        return Unresolved("other tags of this repository are being pulled")
    if len(mine) == 1:
        return mine[0].digest
    return Unresolved("manifest not fetched yet" if not mine else "several manifests could be this pull's")


# --------------------------------------------------------------------------- progress


@dataclass(frozen=True, slots=True)
class Stall:
    moved: int  # bytes in the window
    window: float  # seconds


def stall_window(timeout: float, min_bps: int) -> float:
    """The window the stall guard judges over: ``timeout``, but never shorter than one
    copy-buffer step at the minimum rate, so a pull that is merely slow (its offset moves
    a MiB at a time) is not mistaken for a stalled one."""
    if timeout <= 0:
        return 0.0
    return max(timeout, COPY_QUANTUM / min_bps) if min_bps > 0 else timeout


@dataclass
class FlightProgress:
    """What is known about one upstream pull's download. ``now`` is monotonic seconds."""

    image: str
    started: float
    manifest: Manifest | None = None
    unknown: str | None = None  # why progress cannot be known (e.g. the runtime has no content API)
    pending_reason: str = "resolving the manifest"
    offsets: dict[str, int] = field(default_factory=dict)  # blob -> bytes written (committed: size)
    committed: set[str] = field(default_factory=set)
    baseline: dict[str, int] = field(default_factory=dict)  # blob -> bytes it had when first seen
    samples: deque[tuple[float, int]] = field(default_factory=deque)  # (now, bytes done) while downloading
    phase: str = "resolving"  # resolving | downloading | unpacking | unknown
    steps_done: set[int] = field(default_factory=set)
    keep_seconds: float = 3600.0  # samples older than this are dropped (the poller sets it from its windows)

    # -- updates

    def set_manifest(self, manifest: Manifest) -> None:
        self.manifest = manifest

    def observe(self, now: float, ingests: Mapping[str, int], committed: Iterable[str],
                fresh_ingests: Iterable[str] = ()) -> list[int]:
        """One poll: ``ingests`` (blob -> offset being written), ``committed`` (blobs in the
        store). ``fresh_ingests``: blobs whose ingest started, or which were committed, after
        this pull began (all their bytes count as downloaded by it). Returns the percent
        steps newly crossed."""
        if self.manifest is None:
            return []
        committed = set(committed)
        fresh = set(fresh_ingests)
        for b in self.manifest.blobs:
            d = b.digest
            if d in committed:
                value = b.size
                self.committed.add(d)
            elif d in ingests:
                value = min(ingests[d], b.size) if b.size else ingests[d]
            else:
                value = self.offsets.get(d, 0) if d not in self.committed else b.size
            if d not in self.baseline:
                self.baseline[d] = 0 if (d in fresh or (d not in committed and d not in ingests)) else value
            self.offsets[d] = value
        done = self.bytes_done
        downloading = any(b.digest not in self.committed for b in self.manifest.blobs)
        if downloading:
            if self.phase != "downloading":
                self.samples.clear()
            self.phase = "downloading"
            self.samples.append((now, done))
            self._trim(now)
        else:
            self.phase = "unpacking"  # every blob is in: the runtime unpacks, no bytes move
            self.samples.clear()
        return self._new_steps()

    def complete(self) -> list[int]:
        """The runtime answered the pull: every blob is in. Returns the steps newly crossed
        (a pull can finish between two polls)."""
        if self.manifest is None:
            return []
        for b in self.manifest.blobs:
            self.offsets[b.digest] = b.size
            self.committed.add(b.digest)
        self.phase = "done"
        return self._new_steps()

    def _trim(self, now: float) -> None:
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.keep_seconds:
            self.samples.popleft()

    def _new_steps(self) -> list[int]:
        total = self.bytes_total
        if not total:
            return []
        pct = 100.0 * self.bytes_done / total
        new = [s for s in STEPS if pct >= s and s not in self.steps_done]
        self.steps_done.update(new)
        return new

    # -- readings

    @property
    def known(self) -> bool:
        return self.manifest is not None and self.unknown is None

    @property
    def bytes_total(self) -> int:
        return self.manifest.total if self.manifest is not None else 0

    @property
    def bytes_done(self) -> int:
        return sum(self.offsets.values())

    @property
    def downloaded(self) -> int:
        """Bytes this pull brought in (blobs already in the store when it started do not count)."""
        return sum(max(0, v - self.baseline.get(d, v)) for d, v in self.offsets.items())

    @property
    def layers_total(self) -> int:
        return len(self.manifest.layers) if self.manifest is not None else 0

    @property
    def layers_done(self) -> int:
        return sum(1 for b in self.manifest.layers if b.digest in self.committed) if self.manifest else 0

    def rate(self, now: float, window: float = RATE_WINDOW_SECONDS) -> float | None:
        """Bytes per second over the last ``window`` seconds of downloading. With one sample
        only: what this pull downloaded since it started, over that time. None before."""
        if len(self.samples) == 1:
            elapsed = self.samples[0][0] - self.started
            return self.downloaded / elapsed if elapsed > 0 and self.downloaded else None
        if len(self.samples) < 2:
            return None
        t1, b1 = self.samples[-1]
        start = self.samples[0]
        for t, b in self.samples:  # the last sample at or before the window's start
            if t > t1 - window:
                break
            start = (t, b)
        t0, b0 = start
        if t1 - t0 <= 0:
            return None
        return max(0.0, (b1 - b0) / (t1 - t0))

    def eta(self, now: float) -> float | None:
        rate = self.rate(now)
        if self.phase != "downloading" or not rate:
            return None
        return (self.bytes_total - self.bytes_done) / rate

    def moved_in(self, now: float, window: float) -> int | None:
        """Bytes done now minus bytes done ``window`` seconds ago; None if the pull has not
        been downloading for that long."""
        if not self.samples or self.samples[0][0] > now - window:
            return None
        past = self.samples[0][1]
        for t, b in self.samples:
            if t > now - window:
                break
            past = b
        return max(0, self.samples[-1][1] - past)

    def stall(self, now: float, timeout: float, min_bps: int) -> Stall | None:
        """A Stall when the download moved fewer than ``min_bps`` bytes per second over the
        whole window (``stall_window``). Never while resolving, unpacking or unknown."""
        window = stall_window(timeout, min_bps)
        if window <= 0 or not self.known or self.phase != "downloading":
            return None
        moved = self.moved_in(now, window)
        if moved is None:
            return None
        if moved < max(1, min_bps * window):
            return Stall(moved, window)
        return None

    def view(self, now: float) -> dict[str, object]:
        """The JSON for `cri-shim status` (numbers, and the phase)."""
        if self.unknown is not None:
            return {"phase": "unknown", "reason": self.unknown}
        if self.manifest is None:
            return {"phase": "resolving", "reason": self.pending_reason}
        rate = self.rate(now)
        eta = self.eta(now)
        total = self.bytes_total
        return {
            "phase": self.phase,
            "manifest": self.manifest.digest,
            "bytes_done": self.bytes_done,
            "bytes_total": total,
            "percent": round(100.0 * self.bytes_done / total, 1) if total else 100.0,
            "layers_done": self.layers_done,
            "layers_total": self.layers_total,
            "bytes_per_second": None if rate is None else round(rate),
            "eta_seconds": None if eta is None else round(eta, 1),
        }


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; whole numbers below 1 KiB as bytes."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    return f"{n:.1f} TiB"


def stall_message(image: str, stall: Stall, min_bps: int) -> str:
    """``cri-shim: pull of reg/app:v1 stalled: 9 KiB in the last 60 s (< 64 KiB/s); cancelled``."""
    return (f"cri-shim: pull of {image} stalled: {human_bytes(stall.moved)} in the last {stall.window:g} s "
            f"(< {human_bytes(min_bps)}/s); cancelled")


def no_progress_message(image: str, seconds: float, phase: str, registry: str, done: int, total: int) -> str:
    """What the callers of a pull ended by the no-progress guard are told, e.g. ``cri-shim: pull
    of reg/app:v1 made no progress for 60 s (resolving the manifest from reg: no manifest, no
    bytes); cancelled so that it does not hold a pull slot (pulls.no_progress_timeout_seconds),
    retry later``."""
    where = (f"resolving the manifest from {registry}: no manifest, no bytes" if phase == "resolving" else
             f"downloading: {human_bytes(done)} of {human_bytes(total)}, no more bytes from {registry}")
    return (f"cri-shim: pull of {image} made no progress for {seconds:g} s ({where}); "
            f"cancelled so that it does not hold a pull slot (pulls.no_progress_timeout_seconds), retry later")
