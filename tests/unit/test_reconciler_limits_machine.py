"""The image-set reconciler's limits and per-set pull inputs against random sequences (a second
hypothesis state machine, over the first one's steps: tests/unit/test_reconciler_machine.py).

Besides everything the first machine does (sets edited, pulls held, kubelet's GC, reloads of the
threshold rule and max_parallel, restarts, settle), here:

- ``image_sets.min_free_bytes`` is set (and moved by reloads) while kubelet fills the disk;
- images of a broken registry (bad.local) fail at once, every time, under a retry budget
  (``retry_per_second``) and the failure backoff (``retry_initial_seconds`` ...);
- ``image_sets.max_images`` bounds the declared entries (and moves with reloads), and each lane
  rests ``cooldown_seconds`` after its pull;
- every set has its own pull secret (the cluster's, by set name: ``set_credentials``), and a set
  deleted and created again (a new uid) has a new one; runtime handler rules (``handler_for``)
  change;
- kubelet's image GC threshold is read from kubelet's config file, which is rewritten.

After every step, as a user would notice it:

1. no prefetch starts while the image filesystem's free space is below min_free_bytes; settled,
   an image waits only when space is short (status says ``min_free_bytes``) or it does not fit
   below the threshold;
2. a failing image is retried no sooner than its backoff, and a registry's retries stay within
   its budget: ``retry_per_second`` a second (a burst of as many), and a tenth of it once its
   prefetches have failed four times;
3. the declared entries never pass max_images: a set that would is refused (status ``refused``)
   and its previous version stays; nothing only a refused version declares is pulled;
4. never more pulls running, plus lanes resting after theirs, than max_parallel;
5. no pull and no manifest request carries another set's credential, a deleted set's included
   (a re-created set is a new set); an image of a set with a credential never goes anonymous;
   each pull carries the runtime handler its rule gives (as it was when its prefetch began), with the
   sandbox config containerd needs;
6. with the threshold from kubelet's file, status says that percent and that file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
from collections import deque
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from shim.credentials.keyring import Credential
from shim.credentials.prefetch import SetCredentials
from shim.imagesets.loader import ImageSet
from shim.imagesets.prefetch import HandlerFor, Prefetch, Pulled
from shim.imagesets.table import DeclaredImage
from shim.imagesets.threshold import KUBELET_DEFAULT_PERCENT
from shim.proto.runtime.v1 import api_pb2
from shim.reference import normalize
from tests.unit.test_reconciler_machine import MiB, POOL, SETS, TOTAL, ReconcilerMachine

BAD = ["bad.local/broken0:1", "bad.local/broken1:1"]  # a registry that refuses every pull at once
POOL2 = POOL + BAD
RETRY_INITIAL, RETRY_MAX = 0.05, 0.2
SLOWEST_SHARE = 0.1  # of retry_per_second, once a registry's prefetches failed four times (due.py)
T = TypeVar("T")
HANDLERS = ["kata", "gvisor"]
KUBELET_VALUES: list[int | str | None] = [60, 30, 100, None, "not a percent"]  # None: the key absent


def _backoff(failures: int) -> float:
    """The least a failed image waits after its ``failures``-th failure (docs: doubling, capped)."""
    return min(RETRY_INITIAL * 2.0 ** (failures - 1), RETRY_MAX)


class LimitsMachine(ReconcilerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.wanted: dict[str, tuple[str, ...]] = {}  # what the user declares; self.declared: the accepted versions
        self.gens: dict[str, int] = {}  # metadata.generation per set (bumped by an edit; 1 when re-created)
        self.accepted_gens: dict[str, int] = {}
        self.refused: set[str] = set()
        self.uids: dict[str, int] = {n: 1 for n in SETS}  # the object (and pull secret) of each set name
        self.auth_history: deque[tuple[int, frozenset[tuple[str, str]]]] = deque(maxlen=16)  # (run, (user, ref))
        self.rules: dict[str, str] = {}  # normalized ref -> the runtime handler a rule gives it
        self.rule_history: deque[tuple[int, dict[str, str]]] = deque(maxlen=16)
        self.dir = tempfile.mkdtemp(prefix="kubelet-")
        self.kubelet_file = os.path.join(self.dir, "config.yaml")
        self.kubelet_value: int | str | None = None
        self.kubelet_writes = 0
        self.per_second = 0.0
        # what happened to each image in this reconciler's life (a restart starts a new one)
        self.began: dict[str, int] = {}  # ref -> prefetches of it begun (ObservedPrefetch)
        self.began_handler: dict[str, str] = {}  # ref -> its rule's handler when its last prefetch began
        self.pulled_by: dict[str, int] = {}  # ref -> the prefetch its last pull belonged to
        self.failed_at: dict[str, tuple[float, int]] = {}  # ref -> (its last failed end, failures in a row)
        self.first_failure: dict[str, float] = {}  # host -> its first failed pull
        self.retries: dict[str, list[float]] = {}  # host -> retry starts
        self.bad_failures: list[float] = []  # ends of bad.local pulls
        self.slowed_retries: list[float] = []  # bad.local retries after its fourth failure
        self.redeclared: set[str] = set()  # dropped during the last apply (then maybe declared again)
        self.resting: dict[str, float] = {}  # ref -> when its lane's pull ended (the lane rests then)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ the sets, as a user declares them

    @initialize(sizes=st.lists(st.sampled_from([150, 1, 50, 100, 200, 300, None]), min_size=len(POOL2),
                               max_size=len(POOL2)),
                max_parallel=st.integers(1, 3), guard=st.sampled_from([True, False]),
                base=st.sampled_from([300, 0, 100, 500]), min_free=st.sampled_from([0, 300, 600]),
                max_images=st.sampled_from([8, 4, 12]), cooldown=st.sampled_from([0.0, 0.1]),
                per_second=st.sampled_from([5.0, 20.0, 0.0]), from_file=st.booleans(),
                kubelet=st.sampled_from(KUBELET_VALUES), broken=st.sampled_from([True, False]))
    def start(self, sizes: list[int | None], max_parallel: int, guard: bool, base: int,  # type: ignore[override]
              min_free: int, max_images: int, cooldown: float, per_second: float, from_file: bool,
              kubelet: int | str | None, broken: bool) -> None:
        """``broken``: set c declares the broken registry's images from the start."""
        self._write_kubelet(kubelet)
        if broken:
            self.wanted["c"], self.gens["c"] = tuple(BAD), 1
        self.per_second = per_second
        self.cfg = dataclasses.replace(
            self.cfg, min_free_bytes=min_free * MiB, max_images=max_images, cooldown_seconds=cooldown,
            retry_initial_seconds=RETRY_INITIAL, retry_max_seconds=RETRY_MAX, retry_per_second=per_second,
            kubelet_config_file=self.kubelet_file, gc_high_threshold_percent=0 if from_file else 60)
        self._rules({})
        self._begin(POOL2, sizes, max_parallel, guard, base)
        self._accept(scratch=True)

    @property
    def prefetch_type(self) -> type[Prefetch]:  # type: ignore[override]
        machine = self

        class ObservedPrefetch(Prefetch):
            """The real prefetch; the machine learns when each one begins (a retry, or the first)."""

            async def pull(self, img: DeclaredImage) -> Pulled:
                machine.began[img.ref] = machine.began.get(img.ref, 0) + 1
                machine.began_handler[img.ref] = machine.rules.get(img.ref, "")  # the rule as it began
                return await super().pull(img)

        return ObservedPrefetch

    def prefetch_sources(self) -> tuple[SetCredentials | None, HandlerFor | None]:
        return self._set_credentials, self._handler_for

    def _set_credentials(self, names: frozenset[str]) -> list[tuple[str, Credential]]:
        """The cluster's pull secrets of these sets, by name: the object in force now."""
        return [("reg.local", Credential(f"set {n}", username=f"{n}#{self.uids[n]}", password=f"pw-{n}-{self.uids[n]}"))
                for n in sorted(names)]

    def _handler_for(self, image: str) -> tuple[str, str] | None:
        handler = self.rules.get(normalize(image))
        return (handler, "runtime_handlers.rules[0]") if handler else None

    def _image_sets(self) -> dict[str, ImageSet]:
        return {name: ImageSet(name=name, kind="ImageSet", pin=False, refs=refs, spelled=refs,
                               generation=str(self.gens[name]), source=f"cluster/{name}")
                for name, refs in self.wanted.items()}

    def _accept(self, scratch: bool) -> None:
        """The model of ImageTable.apply: sets in name order; one that would take the declared entries
        past max_images is refused, its accepted version (if any) staying."""
        before = {r for refs in self.declared.values() for r in refs}
        accepted = {} if scratch else {n: r for n, r in self.declared.items() if n in self.wanted}
        gens = {} if scratch else dict(self.accepted_gens)
        self.refused = set()
        # an image no set declares at some point of the apply (one set drops it before the next, in
        # name order, takes it) is dropped, its prefetch cancelled, and declared again as a new image
        self.redeclared = before - {r for refs in accepted.values() for r in refs}
        for name in sorted(self.wanted):
            new, gen = self.wanted[name], self.gens[name]
            old = accepted.get(name)
            if old == new and gens.get(name) == gen:
                continue
            total = sum(map(len, accepted.values())) - len(old or ()) + len(new)
            if total > self.cfg.max_images:
                self.refused.add(name)
                continue
            accepted[name], gens[name] = new, gen
            self.redeclared |= before - {r for refs in accepted.values() for r in refs}
        self.declared, self.accepted_gens = accepted, {n: gens[n] for n in accepted}
        declared = {r for refs in accepted.values() for r in refs}
        for ref in [r for r in self.resting if r not in declared or r in self.redeclared]:
            del self.resting[ref]  # its prefetch cancelled, maybe before its lane began to rest
        for ref in [r for r in self.failed_at if r not in declared or r in self.redeclared]:  # a new image
            del self.failed_at[ref]
        self.auth_history.append((self.runs, frozenset(
            (f"{n}#{self.uids[n]}", r) for n, refs in accepted.items() for r in refs)))

    def _submit(self) -> None:
        self._accept(scratch=False)
        self._reconciler().set_sets(self._image_sets())
        self.run(asyncio.sleep(0.01))

    @rule(name=st.sampled_from(SETS), refs=st.lists(st.sampled_from(POOL2), unique=True, max_size=6))
    def declare(self, name: str, refs: list[str]) -> None:
        """A set added, or edited: images added, removed and renamed at once."""
        if self.wanted.get(name) != tuple(refs):
            self.gens[name] = self.gens.get(name, 0) + 1
        self.wanted[name] = tuple(refs)
        self._submit()

    @precondition(lambda self: bool(self.wanted))
    @rule(data=st.data(), new=st.sampled_from(POOL2))
    def rename(self, data: st.DataObject, new: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.wanted)))
        refs = list(self.wanted[name])
        if not refs or new in refs:
            return
        refs[data.draw(st.integers(0, len(refs) - 1))] = new
        self.wanted[name], self.gens[name] = tuple(refs), self.gens[name] + 1
        self._submit()

    @precondition(lambda self: bool(self.wanted))
    @rule(ref=st.sampled_from(POOL2))
    def share(self, ref: str) -> None:
        """One image added to every set at once: its prefetch has each set's credential to try."""
        for name, refs in self.wanted.items():
            if ref not in refs:
                self.wanted[name], self.gens[name] = (*refs, ref), self.gens[name] + 1
        self._submit()

    @precondition(lambda self: bool(self.wanted))
    @rule(data=st.data())
    def remove_set(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.wanted)))
        del self.wanted[name]
        self.uids[name] += 1  # declared again later: another object
        self._submit()

    @precondition(lambda self: bool(self.wanted))
    @rule(data=st.data(), same=st.booleans())
    def recreate(self, data: st.DataObject, same: bool) -> None:
        """A set's object deleted and created again (a new uid, a new pull secret), seen in one read
        of the API; its content the same or another. The cluster then retries failed images at once."""
        name = data.draw(st.sampled_from(sorted(self.wanted)))
        self.uids[name] += 1
        if not same:
            self.wanted[name] = tuple(data.draw(st.lists(st.sampled_from(POOL2), unique=True, max_size=6)))
        self.gens[name] = 1
        self._accept(scratch=False)
        self._reconciler().set_sets(self._image_sets())
        self._reconciler().retry_failed()
        self.failed_at.clear()  # due now: no backoff owed (the budget still holds)
        self.run(asyncio.sleep(0.01))

    # the next two draw an index, not from the runtime's lists: what runs or is present at a step
    # depends on timing, and a draw whose choices change between runs is flaky data generation
    @rule(i=st.integers(0, 15), fail=st.booleans())
    def pull_ends(self, i: int, fail: bool) -> None:  # type: ignore[override]
        """A pull the runtime holds (if any) finishes, or fails (the others stay held, or hang)."""
        if self.runtime.running:
            pull = self.runtime.running[i % len(self.runtime.running)]
            pull.fail = fail
            pull.release.set()
        self.run(asyncio.sleep(0.01))

    @rule(i=st.integers(0, 15))
    def kubelet_collects(self, i: int) -> None:  # type: ignore[override]
        """kubelet's image GC removes an image (declared or not), if there is one."""
        if self.runtime.images:
            self.runtime.images.discard(sorted(self.runtime.images)[i % len(self.runtime.images)])
            self._regime()
        self.run(asyncio.sleep(0.01))

    @rule(seconds=st.sampled_from([0.06, 0.01, 0.15, 0.3, 0.8]))
    def time_passes(self, seconds: float) -> None:
        """As the first machine's, and now and then long enough for a broken registry's retries to
        show their rate (its backoff alone would retry each image every retry_max_seconds)."""
        self.run(asyncio.sleep(seconds))

    @rule(mapping=st.dictionaries(st.sampled_from(POOL2), st.sampled_from(HANDLERS), max_size=4))
    def handler_rules_change(self, mapping: dict[str, str]) -> None:
        """A reload of runtime_handlers.rules: images pulled for another handler from now on."""
        self._rules(mapping)
        self.run(asyncio.sleep(0.01))

    def _rules(self, mapping: dict[str, str]) -> None:
        self.rules = dict(mapping)
        self.rule_history.append((self.runs, self.rules))

    @rule(guard=st.booleans(), percent=st.sampled_from([0, 30, 60, 85, 100]), margin=st.sampled_from([0, 5]),
          max_parallel=st.integers(1, 3), min_free=st.sampled_from([0, 300, 600, 900]),
          max_images=st.sampled_from([4, 8, 12]))
    def reload(self, guard: bool, percent: int, margin: int, max_parallel: int,  # type: ignore[override]
               min_free: int, max_images: int) -> None:
        """A reload: the guard, the threshold (0: kubelet's file), lanes, min_free_bytes, max_images."""
        self.cfg = dataclasses.replace(self.cfg, gc_threshold_guard=guard, gc_high_threshold_percent=percent,
                                       gc_threshold_margin_percent=margin, max_parallel=max_parallel,
                                       min_free_bytes=min_free * MiB, max_images=max_images)
        self.ceiling = max(self.ceiling, max_parallel)
        self._reconciler().configure(self.cfg)
        self._regime()
        self.run(asyncio.sleep(0.01))

    @rule(value=st.sampled_from(KUBELET_VALUES))
    def kubelet_config_changes(self, value: int | str | None) -> None:
        """kubelet's config file rewritten: another imageGCHighThresholdPercent, none, or a bad one."""
        self._write_kubelet(value)
        self._regime()
        self.run(asyncio.sleep(0.01))

    def _write_kubelet(self, value: int | str | None) -> None:
        self.kubelet_writes += 1
        text = f"apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n# write {self.kubelet_writes}\n"
        if value is not None:
            text += f"imageGCHighThresholdPercent: {value!r}\n" if isinstance(value, str) else \
                f"imageGCHighThresholdPercent: {value}\n"
        tmp = self.kubelet_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.kubelet_file)
        self.kubelet_value = value

    def percent(self) -> int:
        if self.cfg.gc_high_threshold_percent:
            return self.cfg.gc_high_threshold_percent
        return self.kubelet_value if isinstance(self.kubelet_value, int) else KUBELET_DEFAULT_PERCENT

    @rule()
    def restart(self) -> None:
        """The shim restarts: the new reconciler gets every set at once (none kept from before)."""
        super().restart()

    def new_epoch(self) -> None:
        # the old reconciler's last flights may still reach the runtime a turn after its drain (in
        # process only: a real restart ends them with the process): they land before the new one starts
        self.run(asyncio.sleep(0.02))
        self._accept(scratch=True)
        self.began.clear()
        self.pulled_by.clear()
        self.failed_at.clear()
        self.first_failure.clear()
        self.retries.clear()
        self.bad_failures.clear()
        self.slowed_retries.clear()
        self.resting.clear()

    # ------------------------------------------------------------------ what reaches the registry

    def _recent(self, history: deque[tuple[int, T]]) -> list[T]:
        """What was in force since the run before this one began, and just before (as ``recent``)."""
        return ([v for run, v in history if run >= self.runs - 1]
                + [v for run, v in history if run < self.runs - 1][-1:])

    def fails_at_once(self, ref: str) -> bool:
        return ref in BAD

    def request_seen(self, req: api_pb2.PullImageRequest) -> None:
        ref, now = normalize(req.image.image), time.monotonic()
        user = req.auth.username
        recent = self._recent(self.auth_history)
        if user:
            if not any((user, ref) in pairs for pairs in recent):
                self.violations.append(f"{ref} pulled with credential {user!r}: no set declaring it now has it "
                                       f"(objects in force {self.uids}, sets {self.declared})")
        elif ref not in BAD and any(ref in refs for refs in self.declared.values()):
            self.violations.append(f"{ref} pulled anonymously though its sets {self.declared} have a pull secret")
        # the rule's handler now, or when its prefetch began (its next credential goes to the same one)
        handlers = {m.get(ref, "") for m in self._recent(self.rule_history)}
        if ref in self.began_handler:
            handlers.add(self.began_handler[ref])
        if req.image.runtime_handler not in handlers:
            self.violations.append(f"{ref} pulled for handler {req.image.runtime_handler!r}; its rule says {handlers}")
        if bool(req.image.runtime_handler) != req.HasField("sandbox_config"):
            self.violations.append(f"{ref} for handler {req.image.runtime_handler!r}: sandbox_config "
                                   f"{'present' if req.HasField('sandbox_config') else 'missing'}")
        # a retry (a new prefetch of the image), or the next credential of the same prefetch
        began = self.began.get(ref, 0)
        again = began > self.pulled_by.get(ref, 0)
        self.pulled_by[ref] = began
        failed = self.failed_at.get(ref)
        if not again:
            self.resting.pop(ref, None)  # the same lane goes on with the next credential
            if failed is not None:  # the attempt before was not the prefetch's failure
                failed = self.failed_at[ref] = (failed[0], failed[1] - 1)
                if not failed[1]:
                    failed = self.failed_at.pop(ref, None) and None
        elif failed is not None:
            self._retried(ref, now, *failed)
        self._lanes_at_start(ref, now)

    def _retried(self, ref: str, now: float, at: float, failures: int) -> None:
        if now - at < _backoff(failures) - 0.002:
            self.violations.append(f"{ref} retried {now - at:.3f} s after its failure #{failures}: "
                                   f"its backoff is {_backoff(failures):.3f} s")
        ps = self.per_second
        if ps <= 0:
            return
        host = ref.split("/")[0]
        starts = self.retries.setdefault(host, [])
        starts.append(now)
        allowed = max(ps, 1.0) + ps * (now - self.first_failure[host]) + 0.5
        if len(starts) > allowed:
            self.violations.append(f"{host}: {len(starts)} retries in {now - self.first_failure[host]:.2f} s "
                                   f"since its first failure: past retry_per_second {ps:g}")
        if ref in BAD and len(self.bad_failures) >= 4 and at >= self.bad_failures[3]:
            slowest = ps * SLOWEST_SHARE
            self.slowed_retries.append(now)
            allowed = max(slowest, 1.0) + 1 + slowest * (now - self.bad_failures[3])
            if len(self.slowed_retries) > allowed:
                self.violations.append(f"{host}: {len(self.slowed_retries)} retries in "
                                       f"{now - self.bad_failures[3]:.2f} s after its fourth failure: not slowed "
                                       f"to {slowest:g} a second")

    def _lanes_at_start(self, ref: str, now: float) -> None:
        cooldown = self.cfg.cooldown_seconds
        resting = sum(1 for r, end in self.resting.items() if now - end < cooldown and r != ref)
        lanes = max(g.max_parallel for g in self.recent())
        running = len(self.runtime.running)
        if running + resting + 1 > lanes:
            self.violations.append(f"{ref} started with {running} pulls running and {resting} lanes resting "
                                   f"(cooldown_seconds {cooldown:g}): more than max_parallel {lanes}")
        free = TOTAL - min(g.used for g in self.recent())
        need = min(g.min_free for g in self.recent())
        if free < need:
            self.violations.append(f"{ref} started with {free // MiB} MiB free: below min_free_bytes {need // MiB} MiB")

    def pull_ended(self, ref: str, outcome: str) -> None:
        ceiling = self.ceiling
        super().pull_ended(ref, outcome)
        if outcome == "failed":  # its lane may go on with the next credential: still a lane (pulling)
            self.ceiling = max(self.ceiling, ceiling)
        now = time.monotonic()
        if not any(ref in refs for refs in self.declared.values()) or (outcome == "cancelled"
                                                                        and ref in self.redeclared):
            return  # dropped: its prefetch was cancelled, and it is a new image if declared again
        if outcome == "pulled":
            self.failed_at.pop(ref, None)
        else:  # failed, or timed out (the prefetch cancels its pull); a drop forgets it (_accept)
            failed = self.failed_at.get(ref)
            self.failed_at[ref] = (now, (failed[1] + 1) if failed else 1)
            self.first_failure.setdefault(ref.split("/")[0], now)
            if ref in BAD:
                self.bad_failures.append(now)
        if outcome != "cancelled":
            self.resting[ref] = now

    def size_asked(self, spelled: str, creds: Any) -> None:
        ref = normalize(spelled)
        recent = self._recent(self.auth_history)
        for c in creds:
            if c is not None and not any((c.username, ref) in pairs for pairs in recent):
                self.violations.append(f"{ref}'s manifest asked for with credential {c.username!r}: "
                                       f"no set declaring it now has it")

    # ------------------------------------------------------------------ rest

    def _at_rest(self) -> str:
        rec = self._reconciler()
        status = rec.status()
        totals = status["images"]
        if totals["unknown"] or self.runtime.running:
            return f"images {totals}"
        used, limit, guard = self.used(), self.limit(), self.cfg.gc_threshold_guard
        short = TOTAL - used < self.cfg.min_free_bytes
        declared = {r for refs in self.declared.values() for r in refs}
        good, bad = declared - set(BAD), declared & set(BAD)
        waiting = good - self.runtime.images
        if totals["pulling"] + totals["failed"] > len(bad):
            return f"images {totals}, {len(bad)} failing"
        if waiting and not guard and not short:
            return f"{sorted(waiting)} not pulled, with the guard off and {(TOTAL - used) // MiB} MiB free"
        if not short:
            for r in sorted(waiting):
                if used + (self.on_disk(r) if self.sizes[r] is not None else 0) <= limit:
                    return f"{r} would fit ({used // MiB} MiB used, limit {limit // MiB} MiB) yet waits"
        elif waiting and "min_free_bytes" not in status["disk"]["blocked"]:
            return f"{sorted(waiting)} wait with {(TOTAL - used) // MiB} MiB free; status: {status['disk']['blocked']!r}"
        for name, refs in self.declared.items():
            row = status["sets"][name]
            present = sum(1 for r in refs if r in self.runtime.images)
            failing = sum(1 for r in refs if r in BAD)
            got = {k: row[k] for k in ("declared", "present", "pulling", "queued", "failed")}
            if (row["declared"] != len(refs) or row["present"] != present or row["pulling"] + row["failed"] > failing
                    or sum(got.values()) - row["declared"] != len(refs)):
                return f"set {name}: status {got}, {present} present, {failing} failing, of {len(refs)}"
        if totals["present"] != len(declared & self.runtime.images):
            return f"totals {totals} for {len(declared)} declared"
        if guard and not short:
            gc = status["disk"]["gc_threshold"]
            if waiting and not (gc["pressure"] and len(waiting) <= gc["waiting"] <= len(waiting) + len(bad)):
                return f"DiskPressure {gc}, {len(waiting)} waiting"
            if not waiting and not bad and gc["pressure"]:
                return f"DiskPressure {gc} with nothing waiting"
        elif not guard and rec.snapshot().disk_pressure is not None:
            return "DiskPressure with the guard off"
        return ""

    # ------------------------------------------------------------------ invariants

    @invariant()
    def refused_as_the_limit_says(self) -> None:
        """Status names the refused sets, and the declared entries are those of the accepted versions."""
        if self.rec is None:
            return
        status = self.rec.status()
        assert set(status["refused"]) == self.refused, f"refused {status['refused']}, expected {self.refused}"
        entries = sum(map(len, self.declared.values()))
        assert status["declared_entries"] == entries, f"{status['declared_entries']} entries, {self.declared}"

    @invariant()
    def threshold_from_kubelets_file(self) -> None:
        """With the guard on, status says the threshold in force and where it was read."""
        if self.rec is None or not self.cfg.gc_threshold_guard:
            return
        gc = self.rec.status()["disk"]["gc_threshold"]
        assert gc["threshold_percent"] == self.percent(), f"{gc}, expected {self.percent()}"
        if not self.cfg.gc_high_threshold_percent and isinstance(self.kubelet_value, int):
            assert gc["threshold_source"] == self.kubelet_file, gc


LimitsMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CRI_SHIM_RECONCILER_MACHINE_EXAMPLES", "15")), stateful_step_count=35,
    deadline=None, suppress_health_check=[HealthCheck.too_slow],
    **({"phases": [Phase.generate]} if os.environ.get("CRI_SHIM_RECONCILER_MACHINE_NO_SHRINK") else {}))
test_reconciler_limits_machine = LimitsMachine.TestCase
