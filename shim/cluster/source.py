"""The cluster as a source of image sets for this node.

Watches this node's Node (labels), the shim's ImageSets and, when ``cluster.mco`` is on, MCO's
PinnedImageSets and MachineConfigPools; whenever one of them changes, selects the sets that
apply to this node and hands them to the image-set manager (one diff against the runtime).

Safe without the API: what was applied last is saved to ``cluster.state_file`` and loaded
before the shim serves. While a resource cannot be read (API down, not installed, forbidden),
the sets it gave last stay in force: losing the API never unpins or drops a set. Only a
successful read that no longer selects a set removes it (the object deleted, the node's labels
or a pool no longer selecting it). A set whose newest version cannot be applied (an image name
the shim refuses, a field it cannot read) keeps its last valid version, in force and in the
state file, and is reported (``refused``: status row, Degraded ``InvalidSet``, Event, metric).
A state file that cannot be written is an error in the log, in ``cri-shim status`` and in
metrics, at start (checked before serving) and on every failed save; a failed save is tried
again every ``cluster.backoff_max_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from functools import partial
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import new_client_from_config

from ..config import ClusterConfig
from ..imagesets.loader import SetFileError
from ..imagesets.manager import ImageSets
from ..observability import logs
from ..observability.metrics import Metrics
from . import objects, state
from .informer import Informer, backoff
from .objects import Kind, Selected
from .secrets import PullSecrets

_log = logs.get("cluster")
SOURCE = "cluster"


def node_name(cfg: ClusterConfig) -> str:
    return cfg.node_name or socket.gethostname().lower()


def _lister(custom: CustomObjectsApi, kind: Kind) -> Any:
    return partial(custom.list_cluster_custom_object, kind.group, kind.version, kind.plural)


def _slim(obj: dict[str, Any]) -> dict[str, Any]:
    """What the state file keeps of an object: no managedFields, no status."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items()
            if k in ("name", "uid", "generation", "resourceVersion", "annotations")}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": meta,
            "spec": obj.get("spec") or {}}


class ClusterSource:
    def __init__(self, cfg: ClusterConfig, sets: ImageSets, metrics: Metrics) -> None:
        self.cfg = cfg
        self.sets = sets
        self.metrics = metrics
        self.node_name = node_name(cfg)
        self.labels: dict[str, str] | None = None  # None: not known yet
        self.selected: dict[str, Selected] = {}
        self.errors: dict[str, str] = {}  # by object (cluster:Kind/name, MachineConfigPool name, node)
        self.refused: dict[str, objects.Refused] = {}  # by set name: its newest version cannot be applied
        self.state_error = ""  # why the state file cannot be read or written; "" once a save succeeded
        self.state_write_failures = 0  # the start check and every save that failed
        self._unsaved = False  # the last save failed: tried again after backoff_max_seconds
        metrics.cluster_state_file_error.set(0)  # not a previous source's (a reload that changed cluster.*)
        self.loaded_from_state = False
        self.applies = 0
        self.api: ApiClient | None = None
        self.informers: dict[str, Informer] = {}
        self.secrets: PullSecrets | None = None
        self._own_raw: dict[str, dict[str, Any]] = {}  # applied ImageSet objects, by name
        self._pinned_raw: dict[str, dict[str, Any]] = {}  # applied PinnedImageSet objects, by name
        self._inputs: object = None
        self._dirty = asyncio.Event()
        self.changed = asyncio.Event()  # set after every apply (the status writer listens)
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ state file

    def load_state(self) -> None:
        """At start, before serving: the sets applied last, so pins hold from the first call;
        and whether the file can be written (said once, clearly, before anything needs saving)."""
        self._load()
        try:
            state.probe(self.cfg.state_file)
        except OSError as e:
            self._write_failed(e)
            logs.log(_log, logging.ERROR, "cluster state file cannot be written: the sets applied from the API "
                     "server will not hold after a restart while it is down (under systemd the unit needs "
                     "StateDirectory=cri-shim, or ReadWritePaths= for the file's directory)",
                     file=self.cfg.state_file, error=self.state_error)

    def _load(self) -> None:
        try:
            loaded = state.load(self.cfg.state_file)
        except ValueError as e:
            self._state_problem(str(e))
            logs.log(_log, logging.ERROR, "cluster state file unusable; waiting for the API server", error=str(e))
            return
        if loaded is None:
            return
        labels, own, pinned = loaded
        self._own_raw = {o["metadata"]["name"]: o for o in own}
        self._pinned_raw = {o["metadata"]["name"]: o for o in pinned}
        self.labels = labels
        self._select(labels, list(self._own_raw.values()), None)
        self.loaded_from_state = True
        logs.log(_log, logging.INFO, "cluster image sets loaded from the state file", file=self.cfg.state_file,
                 sets=len(self.selected))

    def _save(self) -> None:
        assert self.labels is not None
        try:
            state.save(self.cfg.state_file, self.labels, list(self._own_raw.values()), list(self._pinned_raw.values()))
        except OSError as e:
            self._write_failed(e)
            self._unsaved = True
            logs.log(_log, logging.ERROR, "cannot save the cluster state file; a restart without the API server "
                     "would start without these sets", error=self.state_error, failures=self.state_write_failures,
                     retry_seconds=self.cfg.backoff_max_seconds)
            return
        if self._unsaved:
            logs.log(_log, logging.INFO, "cluster state file saved again", file=self.cfg.state_file)
        self._unsaved = False
        self._state_problem("")

    def _write_failed(self, e: OSError) -> None:
        self.state_write_failures += 1
        self.metrics.cluster_state_write_failures.inc()
        self._state_problem(f"{self.cfg.state_file}: cannot write: {e.strerror or e}")

    def _state_problem(self, error: str) -> None:
        self.state_error = error
        self.metrics.cluster_state_file_error.set(1 if error else 0)

    # ------------------------------------------------------------------ selection

    def _select(self, labels: dict[str, str], own: list[dict[str, Any]],
                mco: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None) -> bool:
        """Select and hand over; ``mco`` None keeps the PinnedImageSets applied last. True when changed.

        A set whose newest version is refused (an invalid image name, an unreadable field) keeps
        its last valid version in force, and the state file keeps that version's object: an
        invalid edit never unpins. It is reported in ``refused`` (status row, Degraded, Event)."""
        previous, old_own, old_pinned = self.selected, self._own_raw, self._pinned_raw
        selected, errors = objects.select(labels, own, [], [])
        refused: dict[str, objects.Refused] = {}
        own_raw: dict[str, dict[str, Any]] = {}
        by_own = {o["metadata"]["name"]: o for o in own}
        for name, obj in by_own.items():
            if name in selected:
                own_raw[name] = _slim(obj)
            elif (err := errors.get(objects.source_of(obj))) is not None:
                kept = self._keep(previous, name, "ImageSet", old_own, selected, own_raw)
                refused[name] = objects.Refused(name, "ImageSet", objects.generation_of(obj), err, kept)
        if mco is not None:
            pinned, pools = mco
            listed = objects.pool_sets(pools, labels)
            for err in listed.errors:
                errors[err.split(".spec", 1)[0]] = err
            pinned_objs = [o for o in pinned if o["metadata"]["name"] in listed.names]
            undecided = listed.undecided - listed.names
        else:
            pinned_objs, undecided = list(old_pinned.values()), set()
        pinned_raw: dict[str, dict[str, Any]] = {}
        for name in sorted(undecided):  # a pool that cannot be read keeps what it gave
            self._keep(previous, name, "PinnedImageSet", old_pinned, selected, pinned_raw)
        for obj in pinned_objs:
            name = obj["metadata"]["name"]
            if name in selected:  # an ImageSet of that name is in force (a refused one with no valid version is not)
                errors[objects.source_of(obj)] = (f"PinnedImageSet {name}: an ImageSet of the same name applies; "
                                                  "ignoring this one")
                continue
            try:
                sel = objects.pinned_set(obj)
            except SetFileError as e:
                errors[objects.source_of(obj)] = str(e)
                kept = self._keep(previous, name, "PinnedImageSet", old_pinned, selected, pinned_raw)
                refused[name] = objects.Refused(name, "PinnedImageSet", objects.generation_of(obj), str(e), kept)
                continue
            selected[name] = sel
            pinned_raw[name] = _slim(obj)
        own_keys = {f"cluster:{r.kind}/{n}" for n, r in refused.items()}  # logged below, with what stays
        for key, err in errors.items():
            if self.errors.get(key) != err and key not in own_keys:
                logs.log(_log, logging.ERROR, "cluster image set rejected", object=key, error=err)
        for name, r in refused.items():
            if self.refused.get(name) != r:
                logs.log(_log, logging.ERROR, "cluster image set refused; its last valid version stays in force"
                         if r.kept else "cluster image set refused; it has no valid version to apply",
                         set=name, kind=r.kind, generation=r.generation, kept_generation=r.kept or "none",
                         error=r.error)
        for name in self.refused.keys() - refused.keys():
            logs.log(_log, logging.INFO, "cluster image set no longer refused", set=name)
        self.errors, self.refused = errors, refused
        self._own_raw, self._pinned_raw = own_raw, pinned_raw
        changed = {n: s.set for n, s in selected.items()} != {n: s.set for n, s in self.selected.items()}
        self.selected = selected
        if self.secrets is not None:
            self.secrets.by_set = {n: s.secrets for n, s in selected.items() if s.secrets}
        self.sets.set_source(SOURCE, {n: s.set for n, s in selected.items()})
        self.sets.set_overrides(**self._overrides())
        self._report()
        return changed

    @staticmethod
    def _keep(previous: dict[str, Selected], name: str, kind: str, old_raw: dict[str, dict[str, Any]],
              selected: dict[str, Selected], raw: dict[str, dict[str, Any]]) -> str:
        """Keep the version of ``name`` applied last (when it was of this kind); its generation, or ""."""
        old = previous.get(name)
        if old is None or old.set.kind != kind or name in selected or name not in old_raw:
            return ""
        selected[name] = old
        raw[name] = old_raw[name]
        return old.set.generation

    def secret_errors(self) -> dict[str, str]:
        """Set name -> why a pull Secret it names cannot be used (its last good entries, if any, stay)."""
        if self.secrets is None:
            return {}
        errs = self.secrets.errors
        out = {}
        for name, s in self.selected.items():
            bad = [errs[r] for r in s.secrets if r in errs]
            if bad:
                out[name] = "; ".join(bad)
        return out

    def _report(self) -> None:
        self.metrics.image_set_invalid.labels(SOURCE).set(len(self.refused))
        self.metrics.image_set_secret_errors.set(len(self.secret_errors()))

    def _overrides(self) -> dict[str, Any]:
        """The narrowest per-role override of any selected set: fewest lanes, longest cooldown."""
        lanes = [o.max_parallel for s in self.selected.values() for o in s.overrides if o.max_parallel is not None]
        cooldowns = [o.cooldown_seconds for s in self.selected.values() for o in s.overrides
                     if o.cooldown_seconds is not None]
        out: dict[str, Any] = {}
        if lanes:
            out["max_parallel"] = max(1, min(lanes))
        if cooldowns:
            out["cooldown_seconds"] = max(cooldowns)
        return out

    def recompute(self) -> bool:
        """Apply what the informers know now. Returns True when anything was handed over."""
        node_inf = self.informers.get("node")
        if node_inf is None or not node_inf.synced:
            return False
        node = node_inf.items.get(self.node_name)
        if node is None:
            if self.errors.get("node") is None:
                logs.log(_log, logging.WARNING, "this node's Node object does not exist; keeping the sets applied last",
                         node=self.node_name)
            self.errors["node"] = f"Node {self.node_name} not found"
            return False
        self.errors.pop("node", None)
        labels = dict((node.get("metadata") or {}).get("labels") or {})
        own_inf = self.informers["imagesets"]
        own = list(own_inf.items.values()) if own_inf.synced else list(self._own_raw.values())
        pis, mcp = self.informers.get("pinnedimagesets"), self.informers.get("machineconfigpools")
        mco = ((list(pis.items.values()), list(mcp.items.values()))
               if pis is not None and mcp is not None and pis.synced and mcp.synced else None)
        inputs = (labels, [(o["metadata"]["name"], o["metadata"].get("resourceVersion")) for o in own],
                  None if mco is None else [(o["metadata"]["name"], o["metadata"].get("resourceVersion"))
                                            for o in (*mco[0], *mco[1])], own_inf.synced)
        if inputs == self._inputs:
            return False
        self._inputs = inputs
        if labels != self.labels:
            logs.log(_log, logging.INFO, "node labels read", node=self.node_name, labels=len(labels))
        self.labels = labels
        self._select(labels, own, mco)
        self.applies += 1
        return True

    # ------------------------------------------------------------------ running

    async def start(self) -> None:
        self.api = await new_client_from_config(config_file=self.cfg.kubeconfig, persist_config=False)
        custom = CustomObjectsApi(self.api)
        core = CoreV1Api(self.api)
        self.secrets = PullSecrets(core, refresh_seconds=self.cfg.secret_refresh_seconds,
                                   request_timeout=self.cfg.request_timeout_seconds)
        self.secrets.by_set = {n: s.secrets for n, s in self.selected.items() if s.secrets}
        self.sets.reconciler.set_credentials = self.secrets.for_sets
        common: dict[str, Any] = dict(on_change=self._dirty.set, watch_timeout=self.cfg.watch_timeout_seconds,
                      request_timeout=self.cfg.request_timeout_seconds,
                      backoff_initial=self.cfg.backoff_initial_seconds, backoff_max=self.cfg.backoff_max_seconds)

        self.informers = {
            "node": Informer(self.api, "nodes", core.list_node, kind=("v1", "Node"),
                             field_selector=f"metadata.name={self.node_name}", **common),
            "imagesets": Informer(self.api, "imagesets", _lister(custom, objects.IMAGE_SET),
                                  kind=(objects.IMAGE_SET.api_version, objects.IMAGE_SET.kind), **common),
        }
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(inf.run(), name=f"cluster-watch-{name}")
                       for name, inf in self.informers.items()]
        self._tasks.append(loop.create_task(self._apply_loop(), name="cluster-apply"))
        self._tasks.append(loop.create_task(self._secrets_loop(), name="cluster-secrets"))
        if self.cfg.mco:  # in the background: the shim serves before any API request is answered
            self._tasks.append(loop.create_task(self._start_mco(custom, common), name="cluster-mco"))

    async def _start_mco(self, custom: CustomObjectsApi, common: dict[str, Any]) -> None:
        pis = await self._pinned_version(custom)
        if self.api is None:  # stopped while asking which version the API server serves
            return
        mcp = objects.MACHINE_CONFIG_POOL
        loop = asyncio.get_running_loop()
        for key, kind in (("pinnedimagesets", pis), ("machineconfigpools", mcp)):
            inf = Informer(self.api, f"{kind.plural}.{kind.version}", _lister(custom, kind),
                           kind=(kind.api_version, kind.kind), **common)
            self.informers[key] = inf
            self._tasks.append(loop.create_task(inf.run(), name=f"cluster-watch-{key}"))

    async def _pinned_version(self, custom: CustomObjectsApi) -> Kind:
        """PinnedImageSet at v1 when the API serves it, else v1alpha1 (v1 when neither is installed).
        Asked again with backoff until the API server answers."""
        failures = 0
        while True:
            try:
                for kind in objects.PINNED_IMAGE_SETS:
                    try:
                        await custom.list_cluster_custom_object(kind.group, kind.version, kind.plural, limit=1,
                                                                _request_timeout=self.cfg.request_timeout_seconds)
                        return kind
                    except ApiException as e:
                        if e.status != 404:
                            raise
                return objects.PINNED_IMAGE_SETS[0]
            except Exception:  # down, forbidden: ask again
                failures += 1
                await asyncio.sleep(backoff(failures, self.cfg.backoff_initial_seconds, self.cfg.backoff_max_seconds))

    async def _apply_loop(self) -> None:
        while True:
            try:  # while the last save failed, it is tried again when nothing else happened meanwhile
                await asyncio.wait_for(self._dirty.wait(), self.cfg.backoff_max_seconds if self._unsaved else None)
            except TimeoutError:
                await asyncio.to_thread(self._save)
                continue
            self._dirty.clear()
            if self.recompute():
                await asyncio.to_thread(self._save)
                self.changed.set()
                if self.secrets is not None and self.secrets.due():
                    await self._refresh_secrets()

    async def _secrets_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.cfg.secret_refresh_seconds, 60.0))
            await self._refresh_secrets()

    async def _refresh_secrets(self) -> None:
        assert self.secrets is not None
        due = self.secrets.due()
        if due and await self.secrets.refresh(due):
            self.sets.reconciler.retry_failed()
        self._report()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.api is not None:
            await self.api.close()
            self.api = None
        self.metrics.cluster_state_file_error.set(0)  # no source, no state file

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "node": self.node_name,
            "labels_known": self.labels is not None,
            "loaded_from_state": self.loaded_from_state,
            "state_file": self.cfg.state_file,
            "sets": {n: {"kind": s.set.kind, "generation": s.set.generation} for n, s in sorted(self.selected.items())},
            "watches": {name: {"synced": inf.synced, "lists": inf.lists, "watches": inf.watches,
                               **({"error": inf.error} if inf.error else {})}
                        for name, inf in self.informers.items()},
        }
        if self.errors:
            out["errors"] = dict(self.errors)
        if self.refused:
            out["refused_sets"] = {n: {"kind": r.kind, "refused_generation": r.generation, "error": r.error,
                                       "in_force_generation": r.kept or "none"}
                                   for n, r in sorted(self.refused.items())}
        if self.state_error:
            out["state_error"] = self.state_error
        if self.state_write_failures:
            out["state_write_failures"] = self.state_write_failures
        if self.secrets is not None and self.secrets.by_set:
            out["pull_secrets"] = self.secrets.status()
        return out


