"""kubelet's image GC threshold, and whether a prefetch of a given size fits below it.

kubelet starts deleting unused images when its image filesystem is ``imageGCHighThresholdPercent``
full (default 85). With ``image_sets.gc_threshold_guard`` on, a prefetch starts only when

    used + reserved + size * size_factor <= total * (threshold - margin) / 100

where ``used`` and ``total`` are those of the fullest image filesystem (``statvfs`` of the
``ImageFsInfo`` mountpoints, disk.py), ``reserved`` the estimates of the prefetches already
running (their bytes are not all on disk yet), ``size`` the bytes the image's manifest lists
(sizes.py), ``size_factor`` (``image_sets.size_factor``) what one downloaded byte takes on disk
(the stored blob and its unpacked copy), ``threshold`` ``image_sets.gc_high_threshold_percent``
or, when 0, kubelet's ``imageGCHighThresholdPercent`` read from ``image_sets.kubelet_config_file``
(85 when the file does not set it) and ``margin`` ``image_sets.gc_threshold_margin_percent``.
A prefetch that does not fit waits; smaller ones that fit go. kubelet's own pulls never pass here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import yaml

from ..config import ImageSetsConfig
from ..pulls.progress import human_bytes

KUBELET_DEFAULT_PERCENT = 85  # kubelet's default imageGCHighThresholdPercent
KUBELET_KEY = "imageGCHighThresholdPercent"
MAX_KUBELET_CONFIG_BYTES = 1 << 20  # a larger kubelet config file is not read


@dataclass(frozen=True, slots=True)
class Usage:
    """The fullest image filesystem at the last check."""
    mountpoint: str
    used: int  # bytes
    total: int  # bytes (what an unprivileged writer can reach: f_blocks - reserved)


@dataclass(frozen=True, slots=True)
class Limit:
    percent: int  # kubelet's imageGCHighThresholdPercent
    source: str  # where it was read: the shim's config key, kubelet's file, or kubelet's default
    margin_percent: float

    def bytes_of(self, total: int) -> int:
        """The usage a prefetch may bring the filesystem to."""
        return int(total * max(0.0, self.percent - self.margin_percent) / 100)


def fits(usage: Usage, limit: Limit, reserved: int, estimate: int) -> bool:
    """Whether a prefetch taking ``estimate`` bytes keeps the filesystem at or below the limit."""
    return usage.used + reserved + estimate <= limit.bytes_of(usage.total)


@dataclass(frozen=True, slots=True)
class Pressure:
    """Why a prefetch waits: the numbers."""
    image: str
    size: int  # bytes the manifest lists (0: any size would cross: the filesystem is past the limit)
    estimate: int  # size * image_sets.size_factor
    usage: Usage
    reserved: int
    limit: Limit
    waiting: int  # prefetches waiting: the held ones and those queued behind them, sized or not

    @property
    def threshold_bytes(self) -> int:
        return self.limit.bytes_of(self.usage.total)

    def message(self) -> str:
        u, lim = self.usage, self.limit
        head = (f"{u.mountpoint} is {human_bytes(u.used)} used of {human_bytes(u.total)}"
                + (f" (+{human_bytes(self.reserved)} for prefetches running)" if self.reserved else ""))
        what = (f"{self.image} needs ~{human_bytes(self.estimate)} (manifest {human_bytes(self.size)})"
                if self.size else "no image fits")
        return (f"DiskPressure: {head}; {what}; limit {human_bytes(self.threshold_bytes)} = kubelet's image GC "
                f"threshold {lim.percent}% ({lim.source}) minus margin {lim.margin_percent:g}%; "
                f"{self.waiting} prefetch(es) wait for room")

    def numbers(self) -> dict[str, int | str]:
        return {"usedBytes": self.usage.used, "sizeBytes": self.size, "estimateBytes": self.estimate,
                "reservedBytes": self.reserved, "thresholdBytes": self.threshold_bytes,
                "totalBytes": self.usage.total, "thresholdPercent": self.limit.percent, "image": self.image,
                "waiting": self.waiting}


class KubeletThreshold:
    """kubelet's ``imageGCHighThresholdPercent``: read from its config file again only when the
    file's mtime or size changed (one ``stat`` per check)."""

    def __init__(self) -> None:
        self._stamp: tuple[str, int, int] | None = None
        self._value: tuple[int, str] = (KUBELET_DEFAULT_PERCENT, "kubelet's default")
        self.error = ""  # why the file could not be used (the default is used then)

    def limit(self, cfg: ImageSetsConfig) -> Limit:
        if cfg.gc_high_threshold_percent:
            return Limit(cfg.gc_high_threshold_percent, "image_sets.gc_high_threshold_percent",
                         cfg.gc_threshold_margin_percent)
        percent, source = self._read(cfg.kubelet_config_file)
        return Limit(percent, source, cfg.gc_threshold_margin_percent)

    def _read(self, path: str) -> tuple[int, str]:
        default = (KUBELET_DEFAULT_PERCENT, "kubelet's default")
        if not path:
            self._stamp, self.error = None, ""
            return default
        try:
            st = os.stat(path)
        except OSError as e:
            self._stamp, self.error = None, f"{path}: {e.strerror}"
            return default
        stamp = (path, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return self._value
        self._stamp = stamp
        self._value, self.error = parse_kubelet_config(path)
        return self._value


def parse_kubelet_config(path: str) -> tuple[tuple[int, str], str]:
    """((percent, source), error) from a KubeletConfiguration file."""
    default = (KUBELET_DEFAULT_PERCENT, "kubelet's default")
    try:
        with open(path, "rb") as f:
            data = yaml.safe_load(f.read(MAX_KUBELET_CONFIG_BYTES))
    except (OSError, yaml.YAMLError) as e:
        return default, f"{path}: unreadable: {type(e).__name__}"
    if not isinstance(data, dict) or KUBELET_KEY not in data:
        return (KUBELET_DEFAULT_PERCENT, f"kubelet's default; {path} does not set {KUBELET_KEY}"), ""
    v = data[KUBELET_KEY]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 100:
        return default, f"{path}: {KUBELET_KEY} is not a percent"
    return (v, path), ""
