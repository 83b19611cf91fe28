"""This node's status object: one ``NodeImageSetStatus`` per node, named after it, written only
by that node's shim with server-side apply (field manager ``cri-shim``).

Writes are coalesced: the document is rebuilt at most every ``cluster.status_interval_seconds``
and sent only when it differs from the last one written, so a node at rest writes nothing and a
busy node at most one request per interval, plus one per set turning current: a set whose
images turned all present (``ImageSets.completed``) and that the last document written did not
show current is written at once (a paced rollout frees the node's slot when the controller reads
it: waiting for the interval would add up to an interval to every wave). A failed write is retried at the next interval
(the status catches up once the API server is back).

The object is restored: the shim watches its own object (list + watch, ``fieldSelector
metadata.name=<node>``) and, at the next interval, writes its document again when the object is
gone (deleted by hand, or with its Node and then re-created) or holds other content than the API
server answered to the last write (another writer changed it; a watch still showing one of this
node's own recent writes only lags behind, and is not taken for another writer); so a node at rest is back within
``cluster.status_interval_seconds``. A watch that RBAC refuses (403: an older role without
``list``/``watch`` on ``nodeimagesetstatuses``) is said once, and the shim writes as before.
Each write reads the API server's answer, 201 (created) as 200, so the object's uid is known from
the first write on and the Events of that first write are sent. The document is built once per interval at
most (costing the number of sets, never of images), not per image event. Failures also become
Warning Events on the status object, at most one per set and reason every
``cluster.event_interval_seconds``, and bounded per node as kubelet's are (events.py).

Rows go to at most ``cluster.status_max_rows`` sets, problem sets first; every set is counted in
``setStates`` and the worst sets without a row are listed in ``worst`` (aggregate.py). ``sets``
and ``worst`` are atomic lists in the CRD, so managedFields holds one entry for each, not one per
row and field.

Per set: desired generation (what is declared), current generation (the last one whose images
were all present, and pinned when the set pins), last failed generation with its error, image
counts by state, failures by typed reason, bytes done / total of its running pulls.
Conditions: ``Ready`` (every set current), ``Progressing`` (pulls queued or running, no failure:
slow is not failed), ``Degraded`` (an image failed: auth, not found, no space, stalled, other),
``DiskPressure`` (prefetch waits below kubelet's image GC threshold, ``image_sets.gc_threshold_guard``:
the message has the numbers; a waiting set's row has them in ``diskPressure``; not a failure).

A set whose newest version is refused (``ClusterSource.refused``; for files, a file in error)
keeps its row with the generation still in force as ``currentGeneration``, the refused one as
``desiredGeneration`` and ``lastFailedGeneration``, ``reason: InvalidSet`` and the error naming
the image and the rule; ``Degraded`` is True with reason ``InvalidSet``. A pull Secret a set
names that cannot be read: ``reason: PullSecretUnavailable`` (the set stays in force). Both
become Warning Events (``ImageSetInvalid``, ``ImageSetPullSecretUnavailable``), rate-limited
like the others. A paced set's generation waiting for its grant: ``desiredGeneration`` the
waiting one, ``reason: AwaitingGrant`` (not a failure).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from functools import partial
from typing import Any, Callable, Mapping

from kubernetes_asyncio.client import CoreV1Api, CustomObjectsApi

from ..imagesets.manager import ImageSets
from ..observability import logs
from ..pulls.failure import REASONS
from ..pulls.poller import ProgressPoller
from ..reference import pull_name
from . import aggregate
from .events import EventRecorder, timestamp
from .informer import Informer, describe, open_response
from .objects import AWAITING_GRANT, FIELD_MANAGER, INVALID_SET, NODE_STATUS, Refused
from .source import ClusterSource

_log = logs.get("cluster")
_CONDITION_REASON = {"auth": "AuthFailed", "notFound": "NotFound", "noSpace": "NoSpace", "stalled": "Stalled",
                     "other": "PullFailed"}
SECRET_UNAVAILABLE = "PullSecretUnavailable"
DISK_PRESSURE = "DiskPressure"  # prefetch waits below kubelet's image GC threshold (imagesets/threshold.py)
_PRESSURE_FIELDS = ("usedBytes", "sizeBytes", "thresholdBytes", "thresholdPercent", "image", "waiting")
SET_REASONS = (INVALID_SET, SECRET_UNAVAILABLE)  # why a set's declared version is not (fully) applied
_EVENT_REASON = {INVALID_SET: "ImageSetInvalid", SECRET_UNAVAILABLE: "ImageSetPullSecretUnavailable"}


def _generation(value: str) -> int:
    """A generation as written in a row ("" or not a number: 0)."""
    return int(value) if value.isdigit() else 0


def held(obj: Mapping[str, Any]) -> tuple[Any, Any]:
    """What of a stored status object this node writes and compares: its status and owner."""
    return obj.get("status"), (obj.get("metadata") or {}).get("ownerReferences")


class NodeReport:
    """Writes this node's NodeImageSetStatus (server-side apply, coalesced) and its Warning Events."""

    def __init__(self, source: ClusterSource, sets: ImageSets, poller: ProgressPoller | None, *,
                 interval: float, event_interval: float, event_namespace: str, request_timeout: float,
                 max_rows: int = 100, event_burst: int = 25, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.sets = sets
        self.poller = poller
        self.interval = interval
        self.event_interval = event_interval
        self.event_namespace = event_namespace
        self.request_timeout = request_timeout
        self.max_rows = max_rows
        self._clock = clock
        self.recorder = EventRecorder(source.node_name, event_namespace, burst=event_burst, interval=event_interval,
                                      request_timeout=request_timeout, clock=clock)
        self.current: dict[str, tuple[str, str]] = {}  # set -> (object uid, last generation found complete)
        self.failed: dict[str, tuple[str, str]] = {}  # set -> (generation, error) of the last failure
        self._conditions: dict[str, dict[str, str]] = {}
        self.last_written: dict[str, Any] | None = None
        self.rows_written: list[dict[str, Any]] = []  # every set's row in the last document written
        self._rows: list[dict[str, Any]] = []  # ... in the last document built
        self.writes = 0
        self.write_errors = 0
        self.error = ""
        self.uid = ""
        self.stored: dict[str, Any] | None = None  # the API server's answer to the last write
        # resourceVersions of this node's recent writes: a watch that has not yet delivered the
        # last write shows one of them, which is not another writer's change
        self._own_versions: deque[str] = deque(maxlen=8)
        self.restores = 0  # writes again because the object was deleted or changed by another writer
        self.own: Informer | None = None  # this node's own status object, watched
        self._event_at: dict[tuple[str, str], float] = {}
        self._task: asyncio.Task[None] | None = None
        self._own_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the document

    def _bytes(self) -> dict[str, tuple[int, int]]:
        """pull name -> (bytes done, bytes total) of the background pulls running now."""
        out: dict[str, tuple[int, int]] = {}
        if self.poller is None:
            return out
        for t in self.poller.running.values():
            p = t.progress
            if p.manifest is not None:
                out[t.flight.key.image] = (p.bytes_done, p.bytes_total)
        return out

    def document(self) -> dict[str, Any]:
        snap = self.sets.snapshot()
        by_pull = self._bytes()
        rows = []
        totals: Counter[str] = Counter()
        reasons_all: Counter[str] = Counter()
        errors: list[str] = []
        problems: dict[str, list[str]] = {r: [] for r in SET_REASONS}
        cluster_sets = self.sets.sources.get("cluster", {})
        refused, secret_errors = self.source.refused, self.source.secret_errors()
        for name, gen in self.source.last_refused.items():  # refused since the last document, maybe fixed by now
            if name not in self.failed or _generation(self.failed[name][0]) < _generation(gen):
                self.failed[name] = (gen, refused[name].error if name in refused else "")
        for name, v in snap.sets.items():
            c = v.counts.as_dict()
            reasons = v.failed_reasons
            done = total = 0
            for spelled in v.pulling:
                d, t = by_pull.get(pull_name(spelled), (0, 0))
                done, total = done + d, total + t
            if c["queued"] and snap.disk_blocked:
                reasons = {**reasons, "noSpace": reasons.get("noSpace", 0) + c["queued"]}
            from_cluster = name in cluster_sets
            sel = self.source.selected.get(name) if from_cluster else None
            uid = sel.uid if sel is not None else ""  # the object in force (a set is its object, not its name)
            if v.complete:
                self.current[name] = (uid, v.generation)
            err = v.last_error or (snap.disk_blocked if c["queued"] and snap.disk_blocked else "")
            if c["failed"] or (c["queued"] and snap.disk_blocked):
                self.failed[name] = (v.generation, err)
                errors.append(f"{name}: {err}")
            problem = self._problem(name, v.source, from_cluster, refused, secret_errors)
            row: dict[str, Any] = {
                "name": name, "kind": v.kind, "source": "cluster" if from_cluster else "file",
                "desiredGeneration": v.generation, **({"uid": uid} if uid else {}),
                "images": c,
            }
            if name in self.current:
                current_uid, row["currentGeneration"] = self.current[name]
                if current_uid and current_uid != uid:  # complete for another object of that name
                    row["currentUid"] = current_uid
            if name in self.failed:
                row["lastFailedGeneration"] = self.failed[name][0]
                if c["failed"] or (c["queued"] and snap.disk_blocked):
                    row["error"] = self.failed[name][1][:1024]
            if name in snap.refused:
                row["error"] = snap.refused[name][:1024]
            if reasons:
                row["failedReasons"] = {r: reasons[r] for r in REASONS if reasons.get(r)}
            if c["queued"] and snap.disk_pressure is not None:  # waiting, not failing: kubelet's GC threshold
                row["diskPressure"] = {k: snap.disk_pressure[k] for k in _PRESSURE_FIELDS}
                row["diskPressure"]["message"] = str(snap.disk_pressure["message"])[:1024]
            if total:
                row["bytesDone"], row["bytesTotal"] = done, total
            if problem is not None:
                self._mark(row, *problem, problems)
            rows.append(row)
            for k, n in c.items():
                totals[k] += n
            for k, n in reasons.items():
                reasons_all[k] += n
        for name, why in snap.refused.items():  # beyond image_sets.max_images
            errors.append(f"{name}: {why}")
        for name, r in refused.items():  # refused with no version in force: a row all the same
            if name not in snap.sets:
                row = {"name": name, "kind": r.kind, "source": "cluster", "desiredGeneration": r.generation,
                       "images": {k: 0 for k in ("declared", "present", "pulling", "queued", "failed")}}
                self._mark(row, INVALID_SET, r.generation, r.error, problems)
                rows.append(row)
        self._awaiting(rows)
        rows.sort(key=lambda r: r["name"])
        for name in list(self.current):
            if name not in snap.sets:
                del self.current[name]
        for name in list(self.failed):
            if name not in snap.sets and name not in refused:
                del self.failed[name]
        n_current = sum(1 for r in rows if r.get("currentGeneration") == r["desiredGeneration"])
        summary = {"sets": len(rows), "current": n_current, **{k: totals[k] for k in
                                                               ("declared", "present", "pulling", "queued", "failed")}}
        kept, aggregated = aggregate.bound(rows, self.max_rows)
        self._rows = rows
        status: dict[str, Any] = {"nodeName": self.source.node_name, "sets": kept, "summary": summary, **aggregated,
                                  "conditions": self._conds(rows, totals, reasons_all, errors, problems, n_current,
                                                            snap.disk_pressure)}
        return {"apiVersion": NODE_STATUS.api_version, "kind": NODE_STATUS.kind,
                "metadata": {"name": self.source.node_name, **self._owner()}, "status": status}

    def _awaiting(self, rows: list[dict[str, Any]]) -> None:
        """A paced set's generation waiting for its grant: declared (desiredGeneration) with
        ``reason: AwaitingGrant``; the version in force (if any) stays currentGeneration, its counts
        the images'. Not a failure: no Degraded, no Event."""
        by_name = {r["name"]: r for r in rows}
        for name, sel in self.source.held.items():
            row = by_name.get(name)
            if row is None:
                row = {"name": name, "kind": sel.set.kind, "source": "cluster",
                       "images": {k: 0 for k in ("declared", "present", "pulling", "queued", "failed")}}
                rows.append(row)
            elif row.get("reason"):
                continue  # the version in force has a problem of its own: that is what to say
            in_force = row.get("uid", "")
            if "currentGeneration" in row and in_force and in_force != sel.uid:  # a set deleted and created again
                row.setdefault("currentUid", in_force)
            row["desiredGeneration"] = sel.set.generation
            if sel.uid:
                row["uid"] = sel.uid
            row["reason"] = AWAITING_GRANT

    def _owner(self) -> dict[str, Any]:
        """An owner reference to this node's Node once its uid is known: the object goes with the Node."""
        inf = self.source.informers.get("node")
        node = inf.items.get(self.source.node_name) if inf is not None else None
        uid = ((node or {}).get("metadata") or {}).get("uid")
        if not uid:
            return {}
        return {"ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.source.node_name, "uid": uid}]}

    def _problem(self, name: str, source: str, from_cluster: bool, refused: dict[str, Refused],
                 secret_errors: dict[str, str]) -> tuple[str, str, str] | None:
        """(reason, refused generation or "", error) when the set's declared version is not (fully) applied."""
        if from_cluster:
            r = refused.get(name)
            if r is not None:
                return INVALID_SET, r.generation, r.error
            if name in secret_errors:
                return SECRET_UNAVAILABLE, "", secret_errors[name]
            return None
        file_error = self.sets.file_errors.get(source)
        return (INVALID_SET, "", f"{file_error}; the file's previous content stays in force") if file_error else None

    def _mark(self, row: dict[str, Any], reason: str, generation: str, error: str,
              problems: dict[str, list[str]]) -> None:
        row["reason"] = reason
        if generation:  # the refused version is what is declared; currentGeneration stays the one in force
            if "uid" in row:  # the refused object's own uid is not known here: currentUid keeps the one in force
                in_force = row.pop("uid")
                if "currentGeneration" in row:
                    row.setdefault("currentUid", in_force)
            row["desiredGeneration"] = generation
            self.failed[row["name"]] = (generation, error)
            row["lastFailedGeneration"] = generation
        row["error"] = (error + (f"; {row['error']}" if row.get("error") else ""))[:1024]
        problems[reason].append(f"{row['name']}: {error}")

    def _conds(self, rows: list[dict[str, Any]], totals: Counter[str], reasons: Counter[str], errors: list[str],
               problems: dict[str, list[str]], n_current: int,
               pressure: Mapping[str, Any] | None = None) -> list[dict[str, str]]:
        busy = totals["pulling"] + totals["queued"]
        everything = problems[INVALID_SET] + errors + problems[SECRET_UNAVAILABLE]
        if problems[INVALID_SET]:
            degraded: tuple[str, str, str] = ("True", INVALID_SET, "; ".join(everything[:5])[:2048])
        elif errors:
            degraded = ("True", _CONDITION_REASON[reasons.most_common(1)[0][0]] if reasons else "PullFailed",
                        "; ".join(everything[:5])[:2048])
        elif problems[SECRET_UNAVAILABLE]:
            degraded = ("True", SECRET_UNAVAILABLE, "; ".join(everything[:5])[:2048])
        else:
            degraded = ("False", "NoFailures", "no image of a set has failed and every set is valid")
        want = {
            "Ready": ("True", "AllSetsCurrent", f"{n_current} of {len(rows)} sets current")
            if n_current == len(rows) else ("False", "SetsNotCurrent", f"{n_current} of {len(rows)} sets current"),
            "Progressing": ("True", "Pulling", f"{totals['present']} of {totals['declared']} images present, "
                            f"{totals['pulling']} pulling, {totals['queued']} queued")
            if busy else ("False", "Idle", "no image set pull queued or running"),
            "Degraded": degraded,
            "DiskPressure": ("True", DISK_PRESSURE, str(pressure["message"])[:2048]) if pressure is not None else
            ("False", "BelowThreshold", "no prefetch waits below kubelet's image GC threshold"),
        }
        out = []
        for typ, (st, reason, message) in want.items():
            old = self._conditions.get(typ)
            since = old["lastTransitionTime"] if old is not None and old["status"] == st else timestamp()
            cond = {"type": typ, "status": st, "reason": reason, "message": message, "lastTransitionTime": since}
            self._conditions[typ] = cond
            out.append(cond)
        return out

    # ------------------------------------------------------------------ writing

    def restore_due(self) -> str:
        """Why the last document written must be written again ("" when the API server holds it):
        the object is gone, or another writer changed what this node wrote. Read from the watch of
        the object (nothing known before it lists: "")."""
        inf = self.own
        if inf is None or not inf.synced or self.stored is None:
            return ""
        obj = inf.items.get(self.source.node_name)
        if obj is None:
            return "deleted"
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv == (self.stored.get("metadata") or {}).get("resourceVersion") or held(obj) == held(self.stored):
            return ""
        if rv in self._own_versions:
            return ""  # an earlier write of ours: the watch lags (writes close together), it catches up
        return "changed by another writer"

    async def write(self, custom: CustomObjectsApi) -> bool:
        """Apply the document when it changed since the last write, or when the object no longer
        holds what was written (restore_due). True when written."""
        doc = self.document()
        restore = self.restore_due()
        if doc == self.last_written and not restore:
            return False
        try:
            # the answer read as it comes: the client's model has no type for 201 (created) and
            # would return no body, leaving the object's uid unknown (no Event) after a first write
            resp = await open_response(await custom.patch_cluster_custom_object(  # type: ignore[call-arg]
                NODE_STATUS.group, NODE_STATUS.version, NODE_STATUS.plural, self.source.node_name, doc,
                field_manager=FIELD_MANAGER, force=True, _content_type="application/apply-patch+yaml",
                _preload_content=False, _request_timeout=self.request_timeout))
            try:
                stored = json.loads(await resp.read())
            finally:
                resp.release()
        except Exception as e:
            self.write_errors += 1
            err = describe(e)
            if err != self.error:
                logs.log(_log, logging.WARNING, "cannot write this node's image set status; will retry",
                         error=err, interval=self.interval)
            self.error = err
            return False
        if self.error:
            logs.log(_log, logging.INFO, "image set status written again")
        elif restore:
            self.restores += 1
            logs.log(_log, logging.WARNING, "this node's image set status object was " + restore + "; written again",
                     node=self.source.node_name)
        self.error = ""
        self.written(doc, str((stored.get("metadata") or {}).get("uid") or ""), stored)
        self.writes += 1
        return True

    def written(self, doc: dict[str, Any], uid: str, stored: dict[str, Any] | None = None) -> None:
        """``doc`` (the last one built) is what the API server holds now, as object ``uid``
        (``stored``: the API server's answer, what restore_due compares the watched object with)."""
        self.last_written, self.rows_written = doc, self._rows
        self.uid = self.recorder.uid = uid
        self.stored = stored
        rv = ((stored or {}).get("metadata") or {}).get("resourceVersion")
        if rv:
            self._own_versions.append(str(rv))

    async def events(self, core: CoreV1Api) -> None:
        """A Warning Event per set and failure reason, at most one every event_interval, through the
        node's recorder (events.py: a token bucket per node, similar Events aggregated)."""
        if not self.uid or self.last_written is None:
            return
        now = self._clock()
        for row in self.rows_written:
            due: list[tuple[str, str, str]] = []  # (key reason, Event reason, message)
            if row.get("reason") in _EVENT_REASON:
                gen = (f"generation {row['desiredGeneration']} refused; generation {row['currentGeneration']} stays "
                       "in force" if row["reason"] == INVALID_SET and "currentGeneration" in row else
                       f"generation {row['desiredGeneration']}")
                due.append((row["reason"], _EVENT_REASON[row["reason"]],
                            f"image set {row['name']} {gen}: {row.get('error', '')}"))
            for reason in row.get("failedReasons", {}):
                due.append((reason, f"ImageSet{_CONDITION_REASON[reason]}",
                            f"image set {row['name']} generation {row['desiredGeneration']}: "
                            f"{row['failedReasons'][reason]} image(s) failed ({reason}): {row.get('error', '')}"))
            for reason, event_reason, message in due:
                key = (row["name"], reason)
                if now - self._event_at.get(key, -1e18) < self.event_interval:
                    continue
                self._event_at[key] = now
                await self.recorder.record(core, "Warning", event_reason, message)
        for key in [k for k in self._event_at if not self.sets.in_force(k[0]) and k[0] not in self.source.refused]:
            del self._event_at[key]

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="cluster-status")
        if self.source.api is not None and self.source.reach is not None:
            cfg = self.source.cfg
            custom = CustomObjectsApi(self.source.api)
            self.own = Informer(self.source.api, "nodeimagesetstatus",
                                partial(custom.list_cluster_custom_object, NODE_STATUS.group, NODE_STATUS.version,
                                        NODE_STATUS.plural),
                                kind=(NODE_STATUS.api_version, NODE_STATUS.kind),
                                field_selector=f"metadata.name={self.source.node_name}", on_change=lambda: None,
                                reach=self.source.reach, watch_timeout=cfg.watch_timeout_seconds,
                                request_timeout=cfg.request_timeout_seconds,
                                backoff_initial=cfg.backoff_initial_seconds, backoff_max=cfg.backoff_max_seconds,
                                give_up_on=frozenset({403}))
            self._own_task = loop.create_task(self.own.run(), name="cluster-watch-own-status")

    async def _loop(self) -> None:
        assert self.source.api is not None
        custom, core = CustomObjectsApi(self.source.api), CoreV1Api(self.source.api)
        last = -1e18
        while True:
            changed, completed = await self._wake()
            self.source.changed.clear()
            self.sets.completed.clear()
            if completed and not changed and not self.source.applies:
                continue  # sets of the state file turning present: nothing new to say before the API server answers
            if changed:  # let the reconciler read the runtime once first: one write with the outcome, not two
                await self._settle()
            # the rest of the interval since the last write; a set turning current meanwhile ends it
            due = last + self.interval
            while self._clock() < due and not (completed and self.source.labels is not None
                                                and self._turned_current()):
                completed = await self._completed_within(due - self._clock())
            if self.source.labels is None:
                continue  # nothing to say before this node's labels are known
            try:
                if await self.write(custom):
                    last = self._clock()
                    await self.events(core)
            except Exception as e:  # a bug here must not end status reporting for good
                logs.log(_log, logging.ERROR, "image set status not written", error=describe(e))
                last = self._clock()

    async def _wake(self) -> tuple[bool, bool]:
        """Wait, at most ``interval``, for the sets in force to change (``source.changed``) or a
        set's images to turn all present (``sets.completed``); which of the two happened."""
        changed, completed = self.source.changed, self.sets.completed
        if not changed.is_set() and not completed.is_set():
            waits = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(completed.wait())]
            try:
                await asyncio.wait(waits, timeout=self.interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return changed.is_set(), completed.is_set()

    async def _completed_within(self, timeout: float) -> bool:
        """Whether a set's images turned all present (``sets.completed``) within ``timeout`` s."""
        try:
            async with asyncio.timeout(timeout):
                await self.sets.completed.wait()
        except TimeoutError:
            return False
        self.sets.completed.clear()
        return True

    def _turned_current(self) -> bool:
        """Whether the document now shows a set current (its generation, no problem) that the
        last one written did not: written at once, not at the next interval (a paced rollout's
        controller frees that node's slot when it reads it). At most once per set turning
        current, which takes a pull or a new version. Not before the sets come from the API server
        (``source.applies``): a restart's sets from the state file are not what the cluster declares now."""
        if not self.source.applies:
            return False
        before = {r["name"]: r.get("currentGeneration") for r in self.rows_written}
        self.document()
        return any(r.get("currentGeneration") == r["desiredGeneration"] and not r.get("reason")
                   and before.get(r["name"]) != r["currentGeneration"] for r in self._rows)

    async def _settle(self, limit: float = 2.0) -> None:
        """Wait (at most ``limit`` s) until the reconciler has finished a pass over the new sets."""
        before = self.sets.passes
        deadline = self._clock() + limit
        while self.sets.passes == before and self._clock() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._own_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._own_task = None

    def status(self) -> dict[str, Any]:
        own = self.own
        return {"writes": self.writes, "write_errors": self.write_errors, "events": self.recorder.created,
                "event_requests": self.recorder.status(),
                **({"restored": self.restores} if self.restores else {}),
                **({"watch_error": own.error} if own is not None and own.error else {}),
                **({"error": self.error} if self.error else {}),
                **({"summary": self.last_written["status"]["summary"]} if self.last_written else {})}
