"""The image-set reconciler against random sequences of what happens on a node (hypothesis
state machine).

The steps: sets declared, edited (images added, removed, renamed) and removed; prefetch pulls
that the fake runtime holds (every lane busy) until a step lets one finish or fail, or leaves it
hanging until image_sets.pull_timeout_seconds; kubelet's garbage collection removing images and
its own pulls filling the disk; reloads turning image_sets.gc_threshold_guard on and off and
moving the threshold and max_parallel; the reconciler restarted (a new one, the runtime's images
kept); time passing. After every step:

1. the event loop is never held: a heartbeat on the loop is watched from a thread; a loop that
   does not run it for HELD_SECONDS is interrupted (the reconciler's livelock of e1ee76b: a
   prefetch held below the threshold with every lane busy longer than the disk recheck);
2. never more prefetches reach the runtime at once than max_parallel (and never more lanes);
3. with the guard on, no prefetch starts that takes the filesystem past the limit
   (used + running + its size, threshold.py); settled, nothing that fits is left waiting;
4. an image no longer declared never starts; settled, every declared image is present, or
   waits for room with the guard on (counted in DiskPressure's ``waiting``);
5. status counts per set (declared, present, pulling, queued, failed) add up and, settled, are
   a recount from scratch of the declared images against the runtime.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shim.config import ImageSetsConfig
from shim.credentials.dockerconfig import DockerConfigFiles
from shim.credentials.prefetch import PrefetchCredentials, SetCredentials
from shim.cri.deadline import NO_DEADLINE, Deadline
from shim.cri.methods import IMAGE_FS_INFO, IMAGE_STATUS, LIST_IMAGES, PULL_IMAGE
from shim.errors import RpcError
from shim.imagesets.loader import ImageSet
from shim.imagesets.prefetch import HandlerFor, Prefetch
from shim.imagesets.reconciler import Environment, Reconciler
from shim.imagesets.sizes import SizeUnknown
from shim.observability.metrics import Metrics
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.scheduler import PullScheduler
from shim.reference import normalize
from tests.support.prefetch_store import make_image

pytestmark = pytest.mark.timeout(420)  # a failure's shrinking stops after 5 minutes

MiB = 1 << 20
TOTAL = 1000 * MiB  # the image filesystem
MOUNT = "/var/lib/fake/images"
POOL = [f"reg.local/app{i}:1" for i in range(8)]
SETS = ["a", "b", "c"]
SIZE_FACTOR = 2.0  # what one manifest byte takes on disk, here and in the config
RECHECK = 0.05  # Environment.disk_recheck_seconds
RESYNC = 0.2  # Environment.resync_seconds
PULL_TIMEOUT = 0.6  # image_sets.pull_timeout_seconds: a pull left hanging fails after this
HELD_SECONDS = 2.0  # the event loop not running its heartbeat this long: held
SETTLE_SECONDS = 4.0

T = TypeVar("T")


class LoopHeld(BaseException):
    """Raised in the event loop's thread when the loop has not run its heartbeat for HELD_SECONDS
    (a BaseException, so that no ``except Exception`` of the code under test swallows it)."""


@dataclass
class Pull:
    ref: str
    release: asyncio.Event = field(default_factory=asyncio.Event)
    fail: bool = False


@dataclass
class Regime:
    """What the guard judged by at some moment: usage, limit, whether the rule was on."""
    run: int  # ReconcilerMachine.runs when it began
    used: int
    limit: int
    guard: bool
    max_parallel: int = 0
    min_free: int = 0


class FakeRuntime:
    """The runtime as the reconciler's Upstream, in process: images, their bytes on disk, pulls
    held until a step releases them."""

    def __init__(self, machine: ReconcilerMachine) -> None:
        self.m = machine
        self.images: set[str] = set()  # normalized refs present
        self.running: list[Pull] = []
        self.hold = True  # new pulls wait for a step (else they finish at once)
        self.starts: list[str] = []
        self.max_running = 0

    async def unary(self, method: str, request: bytes, *, metadata: Any = (),
                    deadline: Deadline = NO_DEADLINE) -> bytes:
        if method != PULL_IMAGE:
            await asyncio.sleep(0)
        if method == IMAGE_FS_INFO:
            fs = api_pb2.FilesystemUsage(fs_id=api_pb2.FilesystemIdentifier(mountpoint=MOUNT))
            return api_pb2.ImageFsInfoResponse(image_filesystems=[fs]).SerializeToString()
        if method == LIST_IMAGES:
            return api_pb2.ListImagesResponse(images=[make_image(r) for r in sorted(self.images)]).SerializeToString()
        if method == IMAGE_STATUS:
            name = normalize(api_pb2.ImageStatusRequest.FromString(request).image.image)
            if name in self.images:
                return api_pb2.ImageStatusResponse(image=make_image(name)).SerializeToString()
            return b""
        if method == PULL_IMAGE:
            return await self._pull(api_pb2.PullImageRequest.FromString(request))
        raise RpcError(grpc.StatusCode.UNIMPLEMENTED, method, from_upstream=True)

    async def _pull(self, req: api_pb2.PullImageRequest) -> bytes:
        ref = normalize(req.image.image)
        pull = Pull(ref, fail=self.m.fails_at_once(ref))
        self.m.request_seen(req)
        self.m.pull_started(ref, [p.ref for p in self.running], len(self.running))
        self.running.append(pull)
        self.starts.append(ref)
        self.max_running = max(self.max_running, len(self.running))
        outcome = "cancelled"
        try:
            if self.hold and not pull.fail:
                await pull.release.wait()
            outcome = "failed" if pull.fail else "pulled"
        finally:
            self.running.remove(pull)
            self.m.pull_ended(ref, outcome)
        if pull.fail:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"fake registry: {ref} not found", from_upstream=True)
        self.images.add(ref)
        return api_pb2.PullImageResponse(image_ref=make_image(ref).id).SerializeToString()


class FakeSizes:
    """Manifest sizes (the reconciler's ``sizes``): known for most images, unknown for some."""

    def __init__(self, sizes: dict[str, int | None], seen: Callable[[str, Any], None]) -> None:
        self.sizes = sizes
        self.seen = seen  # the machine checks the credentials a manifest request carries
        self.asked = 0

    async def size_of(self, spelled: str, creds: Any) -> int:
        self.asked += 1
        self.seen(spelled, creds)
        size = self.sizes[normalize(spelled)]
        if size is None:
            raise SizeUnknown(f"{spelled}: no manifest (fake registry)")
        return size

    def status(self) -> dict[str, Any]:
        return {"manifest_requests": self.asked}


class ReconcilerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.runtime = FakeRuntime(self)
        self.declared: dict[str, tuple[str, ...]] = {}  # set -> refs, as the last set_sets gave them
        self.generation = 0
        self.sizes: dict[str, int | None] = {}
        self.base_used = 0  # bytes on the image filesystem besides the declared images (kubelet's own)
        self.cfg = ImageSetsConfig(docker_config=(), state_file="", kubelet_config_file="", max_parallel=2,
                                   cooldown_seconds=0.0, retry_initial_seconds=0.05, retry_max_seconds=0.2,
                                   retry_per_second=0.0, pull_timeout_seconds=PULL_TIMEOUT, size_factor=SIZE_FACTOR,
                                   gc_threshold_guard=True, gc_high_threshold_percent=60,
                                   gc_threshold_margin_percent=5)
        self.ceiling = self.cfg.max_parallel  # pulls that may be running at the runtime now
        self.regimes: deque[Regime] = deque(maxlen=64)
        self.violations: list[str] = []
        self.rec: Reconciler | None = None
        self.task: asyncio.Task[None] | None = None
        self.restarts = 0
        self.runs = 0  # calls of run(): a pull reaching the runtime was decided in this one or the one before
        # the watchdog: the loop beats every 10 ms while a step runs it; a thread interrupts a held loop
        self.beat = time.monotonic()
        self.in_loop = False
        self.held: str = ""
        self.stop = threading.Event()
        self.main = threading.get_ident()
        self.previous_handler = signal.signal(signal.SIGUSR1, self._interrupt)
        self.watchdog = threading.Thread(target=self._watch, name="loop watchdog", daemon=True)
        self.watchdog.start()

    # ------------------------------------------------------------------ harness

    def _interrupt(self, signum: int, frame: Any) -> None:
        raise LoopHeld(self.held)

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            stalled = time.monotonic() - self.beat
            if self.in_loop and stalled > HELD_SECONDS and not self.held:
                self.held = f"the event loop ran no other task for {stalled:.1f} s"
                signal.pthread_kill(self.main, signal.SIGUSR1)

    def _heartbeat(self) -> None:
        self.beat = time.monotonic()
        self.loop.call_later(0.01, self._heartbeat)

    def run(self, coro: Awaitable[T]) -> T:
        self.beat = time.monotonic()
        self.in_loop = True
        self.runs += 1
        try:
            return self.loop.run_until_complete(coro)  # type: ignore[arg-type]
        except LoopHeld as e:
            raise AssertionError(f"{e}: {self._where()}") from None
        finally:
            self.in_loop = False

    def teardown(self) -> None:
        try:
            if self.task is not None:
                self.task.cancel()
                self.loop.run_until_complete(asyncio.gather(self.task, return_exceptions=True))
            if self.rec is not None:
                self.loop.run_until_complete(self.rec.drain())
            for t in asyncio.all_tasks(self.loop):
                t.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))
        finally:
            self.stop.set()
            self.watchdog.join()
            signal.signal(signal.SIGUSR1, self.previous_handler)
            self.loop.close()

    def _reconciler(self) -> Reconciler:
        assert self.rec is not None
        return self.rec

    def _where(self) -> str:
        rec = self.rec
        if rec is None:
            return "no reconciler"
        st_ = rec.status()
        return (f"cfg max_parallel={self.cfg.max_parallel} guard={self.cfg.gc_threshold_guard} "
                f"threshold={self.cfg.gc_high_threshold_percent}; used {self.used() // MiB} MiB, limit "
                f"{self.limit() // MiB} MiB; running at the runtime {[p.ref for p in self.runtime.running]}; "
                f"declared {self.declared}; sizes { {r: (s // MiB if s else s) for r, s in self.sizes.items()} }; "
                f"present {sorted(self.runtime.images)}; images {st_['images']}; sets {st_['sets']}; "
                f"disk {st_['disk']}")

    # ------------------------------------------------------------------ the disk and the rule

    def on_disk(self, ref: str) -> int:
        size = self.sizes[ref]
        return int((size if size is not None else 10 * MiB) * SIZE_FACTOR)

    def used(self) -> int:
        return min(TOTAL, self.base_used + sum(self.on_disk(r) for r in self.runtime.images))

    def percent(self) -> int:
        """kubelet's image GC threshold as the shim should read it (a subclass reads kubelet's file)."""
        return self.cfg.gc_high_threshold_percent

    def limit(self) -> int:
        return int(TOTAL * max(0.0, self.percent() - self.cfg.gc_threshold_margin_percent) / 100)

    def statvfs(self, path: str) -> Any:
        assert path == MOUNT
        return _Statvfs(TOTAL // 4096, (TOTAL - self.used()) // 4096, 4096)

    def _regime(self) -> None:
        self.regimes.append(Regime(self.runs, self.used(), self.limit(), self.cfg.gc_threshold_guard,
                                   self.cfg.max_parallel, self.cfg.min_free_bytes))

    def recent(self) -> list[Regime]:
        """What was in force since the run before this one began (a decision reaching the runtime
        may be a few loop turns old: a lane's task, the scheduler's flight), and just before."""
        recent = [g for g in self.regimes if g.run >= self.runs - 1]
        return recent + [g for g in self.regimes if g.run < self.runs - 1][-1:]

    def new_epoch(self) -> None:
        """A restart: the old reconciler's pulls are over, a new one starts (a subclass forgets
        what it tracked of the old one)."""

    def fails_at_once(self, ref: str) -> bool:
        """Whether the fake registry refuses ``ref`` at once (a subclass has broken images)."""
        return False

    def request_seen(self, req: api_pb2.PullImageRequest) -> None:
        """A prefetch's request reached the runtime (a subclass checks its credential and handler)."""

    def size_asked(self, spelled: str, creds: Any) -> None:
        """A manifest was asked for, with these credentials (a subclass checks them)."""

    def pull_started(self, ref: str, running: list[str], in_flight: int) -> None:
        """A prefetch reached the runtime: checked against what was declared and the rule."""
        declared = {r for refs in self.declared.values() for r in refs}
        if ref not in declared:
            self.violations.append(f"{ref} started though no set declares it ({self.declared})")
        if in_flight + 1 > self.ceiling:
            self.violations.append(f"{ref} started with {in_flight} running: more than max_parallel "
                                   f"{self.cfg.max_parallel} (ceiling {self.ceiling})")
        if self.sizes[ref] is None:
            return  # size unknown: judged by the usage alone
        self._regime()
        # the decision may be a few loop turns old: the most lenient disk and limit since then
        recent = self.recent()
        if not all(g.guard for g in recent):
            return
        # every running pull counts, those started before a reload turned the guard on too: they are
        # sized then, and nothing starts before they are (found by this machine; the named test is in
        # test_gc_threshold.py)
        sized = sum(self.on_disk(r) for r in running if self.sizes[r] is not None)
        used, limit = min(g.used for g in recent), max(g.limit for g in recent)
        if used + sized + self.on_disk(ref) > limit:
            self.violations.append(f"{ref} ({self.on_disk(ref) // MiB} MiB) started with {used // MiB} MiB used "
                                   f"and {sized // MiB} MiB running: past the limit {limit // MiB} MiB")

    def pull_ended(self, ref: str, outcome: str) -> None:
        """A pull left the runtime: ``outcome`` pulled, failed, or cancelled (the prefetch stopped)."""
        self.ceiling = max(self.cfg.max_parallel, len(self.runtime.running))
        self._regime()

    # ------------------------------------------------------------------ steps

    # the simplest values come first: 150 MiB images (300 on disk: two cross the default limit, 550 MiB),
    # the guard on, 300 MiB used (one fits, the next is held)
    @initialize(sizes=st.lists(st.sampled_from([150, 1, 50, 100, 200, 300, None]), min_size=len(POOL),
                               max_size=len(POOL)),
                max_parallel=st.integers(1, 3), guard=st.sampled_from([True, False]), base=st.sampled_from([300, 0, 100, 500]))
    def start(self, sizes: list[int | None], max_parallel: int, guard: bool, base: int) -> None:
        self._begin(POOL, sizes, max_parallel, guard, base)

    def _begin(self, pool: list[str], sizes: list[int | None], max_parallel: int, guard: bool, base: int) -> None:
        self.sizes = {r: (s * MiB if s is not None else None) for r, s in zip(pool, sizes)}
        self.base_used = base * MiB
        self.cfg = dataclasses.replace(self.cfg, max_parallel=max_parallel, gc_threshold_guard=guard)
        self.ceiling = max_parallel
        self.loop.call_soon(self._heartbeat)
        self._start_reconciler()
        self._regime()

    def _start_reconciler(self) -> None:
        metrics = Metrics()
        scheduler = PullScheduler(16, 16, observers=[metrics])
        set_credentials, handler_for = self.prefetch_sources()
        prefetch = self.prefetch_type(self.cfg, self.runtime, scheduler,  # type: ignore[arg-type]
                                      PrefetchCredentials(DockerConfigFiles(()), set_credentials), metrics, handler_for)
        rec = Reconciler(self.cfg, self.runtime, prefetch, metrics,  # type: ignore[arg-type]
                         env=Environment(statvfs=self.statvfs, disk_recheck_seconds=RECHECK, resync_seconds=RESYNC))
        rec.sizes = FakeSizes(self.sizes, self.size_asked)  # type: ignore[assignment]
        sets = self._image_sets()
        if sets:
            rec.set_sets(sets)
        self.rec = rec
        self.task = self.loop.create_task(rec.run(), name="reconciler under test")

    prefetch_type: type[Prefetch] = Prefetch  # a subclass watches when each prefetch begins

    def prefetch_sources(self) -> tuple[SetCredentials | None, HandlerFor | None]:
        """The sets' own pull secrets and the runtime handler rules (a subclass has them)."""
        return None, None

    def _image_sets(self) -> dict[str, ImageSet]:
        return {name: ImageSet(name=name, kind="ImageSet", pin=False, refs=refs, spelled=refs,
                               generation=str(self.generation), source=f"/sets/{name}.yaml")
                for name, refs in self.declared.items()}

    def _declare(self) -> None:
        self.generation += 1
        self._reconciler().set_sets(self._image_sets())

    @rule(name=st.sampled_from(SETS), refs=st.lists(st.sampled_from(POOL), unique=True, max_size=6))
    def declare(self, name: str, refs: list[str]) -> None:
        """A set added, or a new version of it: images added, removed and renamed at once."""
        self.declared[name] = tuple(refs)
        self._declare()
        self.run(asyncio.sleep(0.01))

    @precondition(lambda self: bool(self.declared))
    @rule(data=st.data(), new=st.sampled_from(POOL))
    def rename(self, data: st.DataObject, new: str) -> None:
        """One image of a set renamed (another tag, or another image)."""
        name = data.draw(st.sampled_from(sorted(self.declared)))
        refs = list(self.declared[name])
        if not refs or new in refs:
            return
        refs[data.draw(st.integers(0, len(refs) - 1))] = new
        self.declared[name] = tuple(refs)
        self._declare()
        self.run(asyncio.sleep(0.01))

    @precondition(lambda self: bool(self.declared))
    @rule(data=st.data())
    def remove_set(self, data: st.DataObject) -> None:
        del self.declared[data.draw(st.sampled_from(sorted(self.declared)))]
        self._declare()
        self.run(asyncio.sleep(0.01))

    @precondition(lambda self: bool(self.runtime.running))
    @rule(data=st.data(), fail=st.booleans())
    def pull_ends(self, data: st.DataObject, fail: bool) -> None:
        """A pull the runtime held finishes, or fails (the others stay held, or hang)."""
        pull = data.draw(st.sampled_from(self.runtime.running))
        pull.fail = fail
        pull.release.set()
        self.run(asyncio.sleep(0.01))

    @rule(seconds=st.sampled_from([0.06, 0.01, 0.15, 0.3]))
    def time_passes(self, seconds: float) -> None:
        """Held pulls stay held (every lane busy for longer than the disk recheck, or until
        pull_timeout_seconds), retries fall due, the runtime is read again."""
        self.run(asyncio.sleep(seconds))

    @precondition(lambda self: bool(self.runtime.images))
    @rule(data=st.data())
    def kubelet_collects(self, data: st.DataObject) -> None:
        """kubelet's image GC removes an image (declared or not)."""
        ref = data.draw(st.sampled_from(sorted(self.runtime.images)))
        self.runtime.images.discard(ref)
        self._regime()
        self.run(asyncio.sleep(0.01))

    @rule(base=st.sampled_from([0, 100, 300, 500, 700]))
    def kubelet_fills_the_disk(self, base: int) -> None:
        """kubelet's own pulls (or their collection) change the filesystem's usage."""
        self.base_used = base * MiB
        self._regime()
        self.run(asyncio.sleep(0.01))

    @rule(guard=st.booleans(), percent=st.sampled_from([30, 60, 85, 100]), margin=st.sampled_from([0, 5]),
          max_parallel=st.integers(1, 3))
    def reload(self, guard: bool, percent: int, margin: int, max_parallel: int) -> None:
        """A reload: the guard on or off, another threshold, more or fewer lanes."""
        self.cfg = dataclasses.replace(self.cfg, gc_threshold_guard=guard, gc_high_threshold_percent=percent,
                                       gc_threshold_margin_percent=margin, max_parallel=max_parallel)
        self.ceiling = max(self.ceiling, max_parallel)  # lowered as running pulls end
        self._reconciler().configure(self.cfg)
        self._regime()
        self.run(asyncio.sleep(0.01))

    @rule()
    def restart(self) -> None:
        """The shim restarts: the running prefetches stop, a new reconciler gets the same sets;
        the runtime keeps its images."""
        rec, task = self._reconciler(), self.task
        assert task is not None
        task.cancel()
        self.run(asyncio.gather(task, return_exceptions=True))
        self.run(rec.drain())
        self.restarts += 1
        self.new_epoch()
        self._start_reconciler()
        self.run(asyncio.sleep(0.01))

    @rule()
    def settle(self) -> None:
        """Every pull the runtime holds finishes, new ones finish at once: the reconciler comes to
        rest, where the counts are a recount from scratch and nothing that fits waits."""
        self.runtime.hold = False
        for p in self.runtime.running:
            p.release.set()
        try:
            self.run(self._until(self._at_rest, SETTLE_SECONDS))
        finally:
            self.runtime.hold = True

    # ------------------------------------------------------------------ rest

    async def _until(self, check: Callable[[], str], timeout: float) -> None:
        rec = self._reconciler()
        passes = rec.passes
        deadline = time.monotonic() + timeout
        why = "not checked"
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            if self.declared and rec.passes < passes + 1:
                continue  # a full read of the runtime since kubelet's last collection
            why = check()
            if not why:
                return
        raise AssertionError(f"not at rest after {timeout} s: {why}; {self._where()}")

    def _at_rest(self) -> str:
        """'' at rest, else what is not yet."""
        rec = self._reconciler()
        status = rec.status()
        totals = status["images"]
        if totals["unknown"] or totals["pulling"] or totals["failed"] or self.runtime.running:
            return f"images {totals}"
        used, limit = self.used(), self.limit()
        declared = {r for refs in self.declared.values() for r in refs}
        waiting = declared - self.runtime.images
        guard = self.cfg.gc_threshold_guard
        if waiting and not guard:
            return f"{sorted(waiting)} not pulled, with the guard off"
        for r in sorted(waiting):
            size = self.sizes[r]
            if used + (self.on_disk(r) if size is not None else 0) <= limit:
                return f"{r} would fit ({used // MiB} MiB used, limit {limit // MiB} MiB) yet waits"
        for name, refs in self.declared.items():
            row = status["sets"][name]
            present = sum(1 for r in refs if r in self.runtime.images)
            want = {"declared": len(refs), "present": present, "pulling": 0, "queued": len(refs) - present,
                    "failed": 0}
            got = {k: row[k] for k in want}
            if got != want:
                return f"set {name}: status {got}, recount {want}"
        if set(status["sets"]) != set(self.declared):
            return f"status sets {sorted(status['sets'])}, declared {sorted(self.declared)}"
        if totals != {"present": len(declared) - len(waiting), "pulling": 0, "queued": len(waiting), "failed": 0,
                      "unknown": 0}:
            return f"totals {totals} for {len(declared)} declared, {len(waiting)} waiting"
        if guard:
            gc = status["disk"]["gc_threshold"]
            if gc["pressure"] != bool(waiting) or gc.get("waiting", 0) != len(waiting):
                return f"DiskPressure {gc}, {len(waiting)} waiting"
        elif rec.snapshot().disk_pressure is not None:
            return "DiskPressure with the guard off"
        return ""

    # ------------------------------------------------------------------ invariants

    @invariant()
    def loop_is_free(self) -> None:
        """A task scheduled now runs soon: the reconciler never holds the loop."""
        if self.rec is None:
            return
        t0 = time.monotonic()
        self.run(asyncio.sleep(0))
        assert time.monotonic() - t0 < HELD_SECONDS, "the event loop was held"
        task = self.task
        assert task is not None
        if task.done():
            e = None if task.cancelled() else task.exception()
            if isinstance(e, LoopHeld):
                raise AssertionError(f"the event loop was held (interrupted in the reconciler's run(): {e}); "
                                     f"{self._where()}")
            raise AssertionError(f"the reconciler stopped: {task!r}")

    @invariant()
    def nothing_broke_a_rule(self) -> None:
        assert self.violations == [], f"{self.violations}; {self._where() if self.rec else ''}"

    @invariant()
    def counts_add_up(self) -> None:
        """Per set, the states add up to its images; never more lanes than max_parallel allows."""
        if self.rec is None:
            return
        status = self.rec.status()
        for name, refs in self.declared.items():
            row = status["sets"][name]
            assert row["declared"] == len(refs), f"set {name}: {row}, declared {refs}"
            assert sum(row[k] for k in ("present", "pulling", "queued", "failed")) <= len(refs), f"set {name}: {row}"
        assert set(status["sets"]) == set(self.declared)
        assert status["images"]["pulling"] <= max(self.ceiling, self.cfg.max_parallel)


@dataclass(frozen=True)
class _Statvfs:
    f_blocks: int
    f_bavail: int
    f_frsize: int


ReconcilerMachine.TestCase.settings = settings(max_examples=int(os.environ.get("CRI_SHIM_RECONCILER_MACHINE_EXAMPLES", "20")), stateful_step_count=35, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
test_reconciler_machine = ReconcilerMachine.TestCase
