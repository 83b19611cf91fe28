"""Prefetch below kubelet's image GC threshold (image_sets.gc_threshold_guard): the rule, the
held images, manifest sizes read from a registry, and the reconciler against a scripted runtime
whose image filesystem fills as images land."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import random
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shim.cluster.node_report import NodeReport
from shim.config import ImageSetsConfig
from shim.controller import report, truth
from shim.credentials.keyring import Credential
from shim.cri.upstream import Upstream
from shim.imagesets.gate import Gate
from shim.imagesets.manager import ImageSets
from shim.imagesets.reconciler import Environment
from shim.imagesets.sizes import UNREACHABLE_SECONDS, ImageSizes, SizeUnknown
from shim.imagesets.threshold import KubeletThreshold, Limit, Usage, fits
from shim.observability.metrics import Metrics
from shim.process import status_render
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.scheduler import PullScheduler
from shim.reference import normalize
from tests.support.fake_runtime import FakeRuntime
from tests.support.manifest_registry import PASSWORD, TOKEN, USER, ManifestRegistry
from tests.support.prefetch_store import FakeImages
from tests.support.wait import wait_for
from tests.unit.test_cluster_refused import source

MiB = 1 << 20


# ---------------------------------------------------------------- the rule


@given(used=st.integers(0, 1 << 40), total=st.integers(1, 1 << 40), reserved=st.integers(0, 1 << 38),
       estimate=st.integers(0, 1 << 38), percent=st.integers(0, 100), margin=st.floats(0, 100))
def test_a_prefetch_fits_only_when_it_keeps_the_filesystem_at_or_below_the_limit(
        used: int, total: int, reserved: int, estimate: int, percent: int, margin: float) -> None:
    usage, limit = Usage("/images", min(used, total), total), Limit(percent, "test", margin)
    ok = fits(usage, limit, reserved, estimate)
    assert ok == (usage.used + reserved + estimate <= limit.bytes_of(total))
    assert limit.bytes_of(total) <= total * max(0.0, percent - margin) / 100
    if ok:  # anything smaller fits too; a larger margin never lets more in
        assert fits(usage, limit, reserved, estimate // 2)
    if not ok:
        assert not fits(usage, Limit(percent, "test", min(100.0, margin + 1)), reserved, estimate)


class HeldImages(RuleBasedStateMachine):
    """The gate against a model: the smallest valid held item is the one offered; reservations add up."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: Gate[str] = Gate()
        self.held: dict[str, int] = {}
        self.invalid: set[str] = set()
        self.reserved: dict[str, int] = {}

    @rule(name=st.sampled_from("abcdefgh"), estimate=st.integers(0, 100))
    def hold(self, name: str, estimate: int) -> None:
        self.gate.hold(name, estimate, estimate)
        self.held[name] = estimate
        self.invalid.discard(name)

    @rule(name=st.sampled_from("abcdefgh"))
    def invalidate(self, name: str) -> None:  # pulled by kubelet, or dropped from its sets
        self.invalid.add(name)

    @precondition(lambda self: bool(self.held))
    @rule()
    def take_smallest(self) -> None:
        top = self.gate.smallest(lambda n: n not in self.invalid)
        valid = {n: e for n, e in self.held.items() if n not in self.invalid}
        if not valid:
            assert top is None
            self.held.clear()
            return
        assert top is not None and top.estimate == min(valid.values()) and valid[top.item] == top.estimate
        self.gate.take(top.item)
        for n in [n for n in self.held if n in self.invalid]:
            del self.held[n]
        del self.held[top.item]

    @rule(name=st.sampled_from("abcdefgh"), estimate=st.integers(0, 100))
    def reserve(self, name: str, estimate: int) -> None:
        self.gate.reserve(name, estimate)
        self.reserved[name] = estimate

    @rule(name=st.sampled_from("abcdefgh"))
    def release(self, name: str) -> None:
        self.gate.release(name)
        self.reserved.pop(name, None)

    @invariant()
    def reservations_add_up(self) -> None:
        assert self.gate.reserved_bytes == sum(self.reserved.values())

    @invariant()
    def held_are_counted(self) -> None:
        assert len(self.gate) >= len([n for n in self.held if n not in self.invalid])


HeldImages.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_held_images = HeldImages.TestCase


def test_kubelet_threshold_read_from_its_file_the_override_wins(tmp_path: Path) -> None:
    kc = tmp_path / "config.yaml"
    cfg = ImageSetsConfig(kubelet_config_file=str(kc), gc_threshold_margin_percent=3)
    k = KubeletThreshold()
    assert (k.limit(cfg).percent, k.limit(cfg).source) == (85, "kubelet's default") and "config.yaml" in k.error
    kc.write_text("kind: KubeletConfiguration\nimageGCHighThresholdPercent: 70\n")
    assert (k.limit(cfg).percent, k.limit(cfg).source, k.error) == (70, str(kc), "")
    kc.write_text("kind: KubeletConfiguration\nimageGCHighThresholdPercent: 72\nimageGCLowThresholdPercent: 60\n")
    assert k.limit(cfg).percent == 72  # the file changed: read again
    kc.write_text("kind: KubeletConfiguration\n")
    assert k.limit(cfg).percent == 85 and "does not set" in k.limit(cfg).source
    over = ImageSetsConfig(kubelet_config_file=str(kc), gc_high_threshold_percent=50)
    assert (k.limit(over).percent, k.limit(over).source) == (50, "image_sets.gc_high_threshold_percent")


# ---------------------------------------------------------------- sizes from manifests


@pytest.fixture
def registry() -> Iterator[ManifestRegistry]:
    reg = ManifestRegistry().start()
    yield reg
    reg.stop()


async def test_size_is_config_and_layers_an_index_resolves_to_this_platform_cached_by_digest(registry) -> None:
    sizes = ImageSizes(arch="amd64")
    plain = registry.add("app/a", "v1", [10 * MiB, 5 * MiB])
    multi = registry.add("app/b", "v1", [3 * MiB], index=True)
    assert await sizes.size_of(plain, [None]) == 15 * MiB + 100
    assert await sizes.size_of(multi, [None]) == 3 * MiB + 100  # amd64's, not arm64's (twice as big)
    digest = registry.digest_of("app/b", "v1")
    before = sum(registry.gets.values())
    assert await sizes.size_of(f"{registry.host}/app/b@{digest}", [None]) == 3 * MiB + 100
    assert sum(registry.gets.values()) == before  # by digest, known: no request


async def test_size_with_a_token_from_the_node_credentials_never_in_an_error(registry) -> None:
    sizes = ImageSizes(arch="amd64")
    ref = registry.add("private/c", "v1", [MiB])
    cred = Credential("config.json", username=USER, password=PASSWORD)
    wrong = Credential("other", username=USER, password="nope")
    assert await sizes.size_of(ref, [wrong, cred]) == MiB + 100
    assert f"Bearer {TOKEN}" in registry.seen_auth
    with pytest.raises(SizeUnknown) as e:
        await sizes.size_of(registry.add("private/d", "v1", [MiB]), [wrong])
    assert registry.host in str(e.value) and "nope" not in str(e.value) and USER not in str(e.value)
    with pytest.raises(SizeUnknown):
        await sizes.size_of(f"{registry.host}/app/missing:v1", [None])


# ---------------------------------------------------------------- the reconciler


@contextlib.asynccontextmanager
async def threshold_sets(runtime: FakeRuntime, directory: Path, on_disk: dict[str, int], *, total: int,
                         unreadable: bool = False, **cfg: Any) -> AsyncIterator[SimpleNamespace]:
    """Image sets whose image filesystem holds ``on_disk[ref]`` bytes for each image present."""
    store = FakeImages(runtime).install()
    config = ImageSetsConfig(dir=str(directory), max_parallel=2, debounce_seconds=0.05, retry_initial_seconds=0.05,
                             retry_max_seconds=0.2, docker_config=(), state_file="", kubelet_config_file="",
                             **({"gc_threshold_guard": True} | cfg))
    upstream = Upstream(runtime.endpoint, 16 << 20)
    metrics = Metrics()
    scheduler = PullScheduler(4, config.max_parallel, observers=[metrics])
    extra = {"used": 0, "unreadable": int(unreadable)}

    def statvfs(path: str) -> SimpleNamespace:
        if path and extra["unreadable"]:
            raise OSError(errno.EIO, "Input/output error")
        used = extra["used"] + sum(on_disk.get(r, 0) for r in store.images)
        return SimpleNamespace(f_blocks=total // 4096, f_bavail=(total - used) // 4096, f_frsize=4096)

    sets = ImageSets(config, upstream, scheduler, metrics, on_pins=lambda p: None, use_inotify=False,
                     poll_seconds=0.05, env=Environment(statvfs=statvfs, disk_recheck_seconds=0.05))
    await sets.start()
    try:
        yield SimpleNamespace(sets=sets, store=store, metrics=metrics, extra=extra,
                              used=lambda: statvfs(""))
    finally:
        await sets.stop()
        await upstream.close()


def own(name: str, images: list[str]) -> str:
    items = "".join(f"    - name: {i}\n" for i in images)
    return f"apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata:\n  name: {name}\nspec:\n  images:\n{items}"


async def test_prefetch_fills_up_to_the_threshold_smaller_ones_go_and_gc_lets_the_rest_in(
        runtime, registry, tmp_path) -> None:
    total = 1000 * MiB
    big = [registry.add(f"app/big{i}", "v1", [100 * MiB]) for i in range(5)]
    small = registry.add("app/small", "v1", [20 * MiB])
    on_disk = {normalize(r): 2 * (100 * MiB + 100) for r in big} | {normalize(small): 2 * (20 * MiB + 100)}
    (tmp_path / "s.yaml").write_text(own("big", [*big, small]))
    # limit: 1000 MiB * (60 - 5) % = 550 MiB; each big image takes ~200 MiB: two fit, then the small one
    async with threshold_sets(runtime, tmp_path, on_disk, total=total, gc_high_threshold_percent=60,
                              gc_threshold_margin_percent=5, size_factor=2.0) as h:
        limit = int(total * 55 / 100)

        def gc() -> dict[str, Any]:
            return h.sets.status()["disk"]["gc_threshold"]

        # settled: held by the threshold, nothing pulling, the small one in, the reason's figures those of
        # the disk now (the hold comes before the small one's pull, and is checked again after it)
        await wait_for(lambda: gc()["pressure"] and h.sets.status()["sets"]["big"]["pulling"] == 0
                       and h.sets.status()["sets"]["big"]["present"] == 3
                       and gc()["usedBytes"] == total - h.used().f_bavail * 4096, 10,
                       "prefetch held, the small one in, the reason's figures current")
        s, p = h.sets.status()["sets"]["big"], gc()
        used = total - h.used().f_bavail * 4096
        assert used <= limit and s["present"] == 3 and normalize(small) in h.store.images
        assert (p["thresholdPercent"], p["threshold_source"], p["thresholdBytes"]) == (
            60, "image_sets.gc_high_threshold_percent", limit)
        assert p["usedBytes"] == used and p["sizeBytes"] == 100 * MiB + 100 and p["waiting"] == 3
        assert "DiskPressure" in p["reason"] and "DiskPressure" in s["last_error"] and s["queued"] == 3
        snap = h.sets.snapshot()
        assert snap.disk_pressure is not None and snap.disk_pressure["usedBytes"] == used
        shown = [ln for ln in status_render.render({"image_sets": h.sets.status()}).splitlines()
                 if ln.startswith("prefetch ")]
        assert len(shown) == 1 and "DiskPressure" in shown[0] and "/app/big" in shown[0]  # `cri-shim status`
        sample = h.metrics.registry.get_sample_value

        # the node's status row and condition, and the set's condition the controller writes from it
        src, _ = source(tmp_path, h.sets, h.metrics)
        doc = NodeReport(src, h.sets, None, interval=1, event_interval=300, event_namespace="default",
                         request_timeout=5).document()["status"]
        row = next(r for r in doc["sets"] if r["name"] == "big")
        assert {k: row["diskPressure"][k] for k in ("usedBytes", "sizeBytes", "thresholdBytes", "waiting")} == {
            "usedBytes": used, "sizeBytes": 100 * MiB + 100, "thresholdBytes": limit, "waiting": 3}
        assert "failedReasons" not in row and doc["setStates"]["failing"] == 0  # waiting is not failing
        conds = {c["type"]: c for c in doc["conditions"]}
        assert conds["DiskPressure"]["status"] == "True" and "DiskPressure" in conds["DiskPressure"]["message"]
        assert conds["Degraded"]["status"] == "False"
        image_set = {"metadata": {"name": "big", "generation": 1}, "spec": {}}
        at = {"metadata": {"name": "n1"}, "status": {**doc, "sets": [{**row, "desiredGeneration": "1"}]}}
        t = truth.compute(image_set, {"n1": {"metadata": {"name": "n1", "labels": {}}}}, {"n1": at},
                          now=2e9, changed_at=2e9, stale_after=120)
        set_conds = {c["type"]: c for c in report.status_of(image_set, t, started=2e9, now=2e9)["conditions"]}
        assert set_conds["DiskPressure"]["status"] == "True" and "n1 (used" in set_conds["DiskPressure"]["message"]
        assert set_conds["Degraded"]["status"] == "False"
        assert sample("cri_shim_image_set_disk_pressure", {"quantity": "waiting"}) == 3
        assert sample("cri_shim_image_set_disk_pressure", {"quantity": "threshold_bytes"}) == limit

        # kubelet collects other images: room for one more, and only one
        h.extra["used"] -= 250 * MiB
        await wait_for(lambda: h.sets.status()["sets"]["big"]["present"] == 4
                       and h.sets.status()["sets"]["big"]["pulling"] == 0, 10, "one more pulled")
        await wait_for(lambda: gc()["pressure"], 5, "still held")
        assert total - h.used().f_bavail * 4096 <= limit and gc()["waiting"] == 2

        # plenty of room: the rest go and the pressure is gone
        h.extra["used"] -= 1000 * MiB
        await wait_for(lambda: h.sets.status()["sets"]["big"]["present"] == 6 and not gc()["pressure"], 10,
                       "all present")
        assert sample("cri_shim_image_set_disk_pressure", {"quantity": "waiting"}) == 0
        assert h.sets.snapshot().disk_pressure is None


async def test_past_the_limit_nothing_is_sized_and_an_unknown_size_goes_by_usage(runtime, registry,
                                                                                  tmp_path) -> None:
    total = 1000 * MiB
    a = registry.add("app/a", "v1", [MiB])
    unknown = f"{registry.host}/app/not-in-registry:v1"
    (tmp_path / "s.yaml").write_text(own("s", [a, unknown]))
    async with threshold_sets(runtime, tmp_path, {}, total=total, gc_high_threshold_percent=50,
                              gc_threshold_margin_percent=0) as h:
        h.extra["used"] = 600 * MiB
        await wait_for(lambda: h.sets.status()["disk"]["gc_threshold"]["pressure"], 10, "held")
        p = h.sets.status()["disk"]["gc_threshold"]
        assert p["sizeBytes"] == 0 and "no image fits" in p["reason"] and h.store.pulls == []
        assert sum(registry.gets.values()) == 0  # nothing sized while nothing can fit
        h.extra["used"] = 0
        await wait_for(lambda: h.sets.status()["sets"]["s"]["present"] == 2, 10, "both pulled")
        assert not h.sets.status()["disk"]["gc_threshold"]["pressure"]


@pytest.mark.timeout(60)
async def test_held_images_with_every_lane_busy_leave_the_loop_free(runtime, registry, tmp_path) -> None:
    """An image held below the threshold while every lane is busy for longer than the disk
    recheck: the reconciler waits for a lane instead of looking at the disk again and again
    without yielding (a livelock that stopped every task of the process: the prefetches it was
    waiting for, and kubelet's calls)."""
    total = 1000 * MiB
    big = registry.add("busy/big", "v1", [300 * MiB])  # ~600 MiB on disk: never fits below 550
    small = [registry.add(f"busy/small{i}", "v1", [MiB]) for i in range(2)]
    on_disk = {normalize(big): 2 * (300 * MiB + 100)} | {normalize(r): 2 * (MiB + 100) for r in small}
    async with threshold_sets(runtime, tmp_path, on_disk, total=total, gc_high_threshold_percent=60,
                              gc_threshold_margin_percent=5, size_factor=2.0) as h:
        gates = [h.store.hold(normalize(r)) for r in small]
        (tmp_path / "s.yaml").write_text(own("s", [big, *small]))
        await wait_for(lambda: h.sets.status()["disk"]["gc_threshold"]["pressure"]
                       and h.sets.status()["sets"]["s"]["pulling"] == 2, 10, "big held, both lanes pulling")
        loop = asyncio.get_running_loop()
        for _ in range(10):  # ten times the disk recheck (0.05 s): the loop keeps turning
            t0 = loop.time()
            await asyncio.sleep(0.05)
            assert loop.time() - t0 < 5, "the event loop was held"
        for g in gates:
            g.set()
        await wait_for(lambda: h.sets.status()["sets"]["s"]["present"] == 2, 10, "both small ones pulled")
        assert normalize(big) not in h.store.images and h.sets.status()["disk"]["gc_threshold"]["waiting"] == 1


async def test_waiting_counts_held_and_unsized_images_alike(runtime, registry, tmp_path) -> None:
    """Held images (sized) and images queued behind them that were never sized (nothing fits: the
    filesystem is past the limit) all wait for room: status and the metric count both."""
    total = 1000 * MiB
    big = [registry.add(f"w/big{i}", "v1", [100 * MiB]) for i in range(3)]
    small = [registry.add(f"w/small{i}", "v1", [MiB]) for i in range(2)]
    on_disk = {normalize(r): 2 * (100 * MiB + 100) for r in big} | {normalize(r): 2 * (MiB + 100) for r in small}
    (tmp_path / "a.yaml").write_text(own("a", big))
    async with threshold_sets(runtime, tmp_path, on_disk, total=total, gc_high_threshold_percent=60,
                              gc_threshold_margin_percent=5, size_factor=2.0) as h:  # limit 550 MiB

        def gc() -> dict[str, Any]:
            return h.sets.status()["disk"]["gc_threshold"]

        await wait_for(lambda: gc()["pressure"] and gc()["waiting"] == 1
                       and h.sets.status()["sets"]["a"]["pulling"] == 0, 10, "two pulled, one held")
        h.extra["used"] = 200 * MiB  # kubelet pulled something: 600 MiB used, past the limit
        sizes_asked = h.sets.status()["disk"]["gc_threshold"]["sizes"]["manifest_requests"]
        (tmp_path / "b.yaml").write_text(own("b", small))
        await wait_for(lambda: h.sets.status()["sets"].get("b", {}).get("queued") == 2 and gc()["waiting"] == 3,
                       10, "the held image and the two never sized counted alike")
        assert "no image fits" in gc()["reason"] and "3 prefetch(es) wait for room" in gc()["reason"]
        assert h.sets.status()["disk"]["gc_threshold"]["sizes"]["manifest_requests"] == sizes_asked
        assert h.metrics.registry.get_sample_value("cri_shim_image_set_disk_pressure", {"quantity": "waiting"}) == 3
        h.extra["used"] = 0  # collected: the two small ones fit, the big one does not
        await wait_for(lambda: h.sets.status()["sets"]["b"]["present"] == 2 and gc()["waiting"] == 1, 10,
                       "small ones pulled, the big one still held")


@pytest.mark.parametrize("seed", range(6))
async def test_random_sets_never_cross_the_limit_and_leave_nothing_that_fits_waiting(
        runtime, registry, tmp_path, seed: int) -> None:
    """Random image sizes, limits and usage: at every prefetch start the filesystem plus the
    pulls running stays within the limit; once settled, no waiting image would fit."""
    rng = random.Random(seed)
    total = 1000 * MiB
    sizes = {registry.add(f"rnd{seed}/i{n}", "v1", [rng.randint(1, 150) * MiB]): 0 for n in range(rng.randint(3, 9))}
    on_disk: dict[str, int] = {}
    for r in sizes:
        d = registry.digest_of(r.split("/", 1)[1].rsplit(":", 1)[0], "v1")
        sizes[r] = sum(layer["size"] for layer in json.loads(registry.blobs[d][0])["layers"]) + 100
        on_disk[normalize(r)] = 2 * sizes[r]
    percent, margin = rng.randint(20, 90), rng.choice([0, 2.5, 5])
    limit = int(total * (percent - margin) / 100)
    async with threshold_sets(runtime, tmp_path, on_disk, total=total, gc_high_threshold_percent=percent,
                              gc_threshold_margin_percent=margin, size_factor=2.0) as h:
        h.extra["used"] = rng.randint(0, total // 2)
        crossed: list[str] = []
        pull = runtime.unary["/runtime.v1.ImageService/PullImage"]
        running: dict[str, int] = {}

        async def watched(request: bytes, context: Any) -> bytes:
            ref = normalize(api_pb2.PullImageRequest.FromString(request).image.image)
            running[ref] = on_disk[ref]
            now = total - h.used().f_bavail * 4096
            if now + sum(running.values()) > limit + 4096:  # statvfs counts whole blocks
                crossed.append(f"{ref}: {now} used + {sum(running.values())} running > {limit}")
            try:
                return await pull(request, context)
            finally:
                running.pop(ref, None)

        runtime.unary["/runtime.v1.ImageService/PullImage"] = watched
        (tmp_path / "s.yaml").write_text(own("s", list(sizes)))  # declared once the pulls are watched

        def settled() -> bool:
            st = h.sets.status()
            return "s" in st["sets"] and st["images"]["unknown"] == 0 and st["sets"]["s"]["pulling"] == 0 \
            and not running

        def waiting() -> list[str]:
            return [r for r in sizes if normalize(r) not in h.store.images]

        def at_rest() -> bool:
            """Settled, nothing waiting would fit, and status says so (eventually, however loaded the machine)."""
            if not settled():
                return False
            used_now = total - h.used().f_bavail * 4096
            if any(used_now + on_disk[normalize(r)] <= limit - 4096 for r in waiting()):  # surely fits
                return False
            gc = h.sets.status()["disk"]["gc_threshold"]
            return gc["pressure"] == bool(waiting()) and (not waiting() or gc["waiting"] == len(waiting()))

        try:
            await wait_for(at_rest, 60, "at rest with nothing that fits waiting")
        except AssertionError as e:  # what it stood at, to tell which part did not hold
            st = h.sets.status()
            raise AssertionError(f"{e}; used {total - h.used().f_bavail * 4096}, limit {limit}, "
                                 f"waiting {[(r, on_disk[normalize(r)]) for r in waiting()]}, running {running}, "
                                 f"set {st['sets'].get('s')}, images {st['images']}, "
                                 f"disk {json.dumps(st['disk'], default=str)}, "
                                 f"rest {json.dumps({k: v for k, v in st.items() if k not in ('sets', 'disk')}, default=str)}") from None
        assert crossed == []
        left = waiting()
        print(f"seed {seed}: {len(sizes) - len(left)} pulled, {len(left)} waiting; "
              f"used {(total - h.used().f_bavail * 4096) >> 20} MiB, limit {limit >> 20} MiB")
        if left:
            assert h.sets.status()["disk"]["gc_threshold"]["thresholdBytes"] == limit


async def test_a_prefetch_running_when_the_rule_is_turned_on_counts_once_sized(runtime, registry, tmp_path) -> None:
    """The rule turned on by a reload while a prefetch runs: that prefetch is sized beside its pull
    and reserved, so the next one waits for it instead of taking the filesystem past the limit."""
    total = 1000 * MiB
    first = registry.add("on/first", "v1", [200 * MiB])  # ~400 MiB on disk each; the limit is 550 MiB
    second = registry.add("on/second", "v1", [200 * MiB])
    on_disk = {normalize(r): 2 * (200 * MiB + 100) for r in (first, second)}
    async with threshold_sets(runtime, tmp_path, on_disk, total=total, gc_threshold_guard=False,
                              gc_high_threshold_percent=60, gc_threshold_margin_percent=5, size_factor=2.0) as h:
        gate = h.store.hold(normalize(first))
        (tmp_path / "a.yaml").write_text(own("a", [first]))
        await wait_for(lambda: h.sets.status()["sets"].get("a", {}).get("pulling") == 1, 10, "first pulling")
        assert sum(registry.gets.values()) == 0  # the rule off: nothing sized

        h.sets.configure(dataclasses.replace(h.sets.cfg, gc_threshold_guard=True))
        await wait_for(lambda: h.sets.status()["disk"]["gc_threshold"].get("reserved_bytes") == 2 * (200 * MiB + 100),
                       10, "the running prefetch sized and reserved")
        (tmp_path / "b.yaml").write_text(own("b", [second]))
        await wait_for(lambda: h.sets.status()["disk"]["gc_threshold"].get("waiting") == 1, 10, "second held")
        p = h.sets.status()["disk"]["gc_threshold"]
        assert p["pressure"] and p["sizeBytes"] == 200 * MiB + 100 and normalize(second) not in h.store.pulls
        assert h.sets.status()["sets"]["b"]["pulling"] == 0

        gate.set()  # the first lands: 400 MiB used, the second still does not fit, and nothing is reserved
        await wait_for(lambda: h.sets.status()["sets"]["a"]["present"] == 1, 10, "first present")
        await wait_for(lambda: h.sets.status()["disk"]["gc_threshold"].get("reserved_bytes") == 0, 10, "released")
        assert normalize(second) not in h.store.images and h.sets.status()["disk"]["gc_threshold"]["waiting"] == 1

        h.extra["used"] -= 400 * MiB  # kubelet collects other images: room for the second
        await wait_for(lambda: h.sets.status()["sets"]["b"]["present"] == 1, 10, "second present")


async def test_turning_the_rule_off_lets_the_held_images_go(runtime, registry, tmp_path) -> None:
    total = 1000 * MiB
    refs = [registry.add(f"off/i{n}", "v1", [100 * MiB]) for n in range(3)]
    on_disk = {normalize(r): 2 * (100 * MiB + 100) for r in refs}
    (tmp_path / "s.yaml").write_text(own("s", refs))
    async with threshold_sets(runtime, tmp_path, on_disk, total=total, gc_high_threshold_percent=30,
                              gc_threshold_margin_percent=0) as h:
        await wait_for(lambda: h.sets.status()["disk"]["gc_threshold"].get("waiting") == 2
                       and h.sets.status()["sets"]["s"]["pulling"] == 0, 10, "two held")
        assert h.sets.status()["sets"]["s"]["present"] == 1
        h.sets.configure(dataclasses.replace(h.sets.cfg, gc_threshold_guard=False))
        await wait_for(lambda: h.sets.status()["sets"]["s"]["present"] == 3, 10, "all pulled")
        assert "gc_threshold" not in h.sets.status()["disk"] and h.sets.snapshot().disk_pressure is None
        assert h.metrics.registry.get_sample_value("cri_shim_image_set_disk_pressure", {"quantity": "waiting"}) == 0


async def test_held_images_wait_for_min_free_bytes_too(runtime, registry, tmp_path) -> None:
    """Both guards on: an image held below the threshold does not start while free space is under
    image_sets.min_free_bytes, though it would fit below the threshold; status says why."""
    total = 1000 * MiB
    refs = [registry.add(f"both/i{n}", "v1", [100 * MiB]) for n in range(3)]
    on_disk = {normalize(r): 2 * (100 * MiB + 100) for r in refs}
    (tmp_path / "s.yaml").write_text(own("s", refs))
    async with threshold_sets(runtime, tmp_path, on_disk, total=total, gc_high_threshold_percent=30,
                              gc_threshold_margin_percent=0, min_free_bytes=500 * MiB) as h:
        await wait_for(lambda: h.sets.status()["disk"]["gc_threshold"].get("waiting") == 2
                       and h.sets.status()["sets"]["s"]["pulling"] == 0, 10, "two held")
        assert h.sets.status()["sets"]["s"]["present"] == 1
        # kubelet's own pulls fill the disk to 300 MiB free; the threshold is raised so that a held
        # image would fit below it: min_free_bytes still holds them
        h.extra["used"] = 1000 * MiB - 300 * MiB - 2 * (100 * MiB + 100)
        h.sets.configure(dataclasses.replace(h.sets.cfg, gc_high_threshold_percent=100))
        await wait_for(lambda: "image_sets.min_free_bytes" in h.sets.status()["disk"]["blocked"], 10, "blocked")
        await asyncio.sleep(0.3)  # several passes of the loop (debounce 0.05 s, recheck 0.05 s)
        assert h.sets.status()["sets"]["s"]["present"] == 1 and h.sets.status()["sets"]["s"]["pulling"] == 0
        h.extra["used"] = 0  # room again: both go
        await wait_for(lambda: h.sets.status()["sets"]["s"]["present"] == 3, 10, "all pulled")
        assert h.sets.status()["disk"]["blocked"] == ""


async def test_turning_the_rule_off_while_min_free_bytes_holds_prefetch_ends_disk_pressure(
        runtime, registry, tmp_path) -> None:
    """Images held below the threshold, then space short of min_free_bytes, then the rule turned
    off by a reload: prefetch still waits (for min_free_bytes), but no longer for kubelet's GC
    threshold, so DiskPressure (the node's condition, the gauge) ends. Found by the reconciler's
    limits machine (tests/unit/test_reconciler_limits_machine.py): it stayed while min_free_bytes held."""
    total = 1000 * MiB
    refs = [registry.add(f"offshort/i{n}", "v1", [100 * MiB]) for n in range(3)]
    on_disk = {normalize(r): 2 * (100 * MiB + 100) for r in refs}
    (tmp_path / "s.yaml").write_text(own("s", refs))
    async with threshold_sets(runtime, tmp_path, on_disk, total=total, gc_high_threshold_percent=30,
                              gc_threshold_margin_percent=0, min_free_bytes=300 * MiB) as h:
        await wait_for(lambda: h.sets.status()["disk"]["gc_threshold"].get("waiting") == 2
                       and h.sets.status()["sets"]["s"]["pulling"] == 0, 10, "two held")
        assert h.sets.snapshot().disk_pressure is not None
        h.extra["used"] = total - 200 * MiB - 2 * (100 * MiB + 100)  # kubelet's pulls: 200 MiB free
        await wait_for(lambda: "image_sets.min_free_bytes" in h.sets.status()["disk"]["blocked"], 10, "blocked")
        h.sets.configure(dataclasses.replace(h.sets.cfg, gc_threshold_guard=False))
        await wait_for(lambda: h.sets.snapshot().disk_pressure is None, 2, "DiskPressure ended")
        assert h.metrics.registry.get_sample_value("cri_shim_image_set_disk_pressure", {"quantity": "waiting"}) == 0
        status = h.sets.status()
        assert "image_sets.min_free_bytes" in status["disk"]["blocked"] and status["sets"]["s"]["present"] == 1


async def test_an_unreadable_usage_holds_prefetch_and_says_why(runtime, registry, tmp_path) -> None:
    """The threshold rule cannot read the image filesystem's usage: nothing starts (as with
    min_free_bytes), status says why; once it can, the prefetch goes."""
    ref = registry.add("usage/i", "v1", [MiB])
    (tmp_path / "s.yaml").write_text(own("s", [ref]))
    async with threshold_sets(runtime, tmp_path, {}, total=1000 * MiB, gc_high_threshold_percent=80,
                              unreadable=True) as h:
        await wait_for(lambda: "cannot read the image filesystem's usage" in h.sets.status()["disk"]["blocked"],
                       10, "blocked")
        assert "image_sets.gc_threshold_guard" in h.sets.status()["disk"]["blocked"]
        await asyncio.sleep(0.3)
        assert h.sets.status()["sets"]["s"]["present"] == 0 and h.store.pulls == []
        h.extra["unreadable"] = 0
        await wait_for(lambda: h.sets.status()["sets"]["s"]["present"] == 1, 10, "pulled")
        assert h.sets.status()["disk"]["blocked"] == ""


async def test_an_unreachable_registry_is_not_asked_again_for_a_while() -> None:
    """A registry that refuses connections costs one attempt per UNREACHABLE_SECONDS, not one per image."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    now = [1000.0]
    sizes = ImageSizes(arch="amd64", clock=lambda: now[0])
    with pytest.raises(SizeUnknown, match="cannot connect"):
        await sizes.size_of(f"127.0.0.1:{port}/app/a:v1", [None])
    for name in ("app/a:v1", "app/b:v2"):  # the same registry: not asked, said why
        with pytest.raises(SizeUnknown, match="not reached within the last 300 s"):
            await sizes.size_of(f"127.0.0.1:{port}/{name}", [None])
    assert sizes.status()["unreachable_registries"] == 1 and sizes.status()["errors"] == 3
    now[0] += UNREACHABLE_SECONDS
    with pytest.raises(SizeUnknown, match="cannot connect"):  # asked again after the interval
        await sizes.size_of(f"127.0.0.1:{port}/app/a:v1", [None])
