"""The cluster as a source of image sets for this node.

Watches this node's Node (labels), the shim's ImageSets and, when ``cluster.mco`` is on, MCO's
PinnedImageSets and MachineConfigPools; whenever one of them changes, selects the sets that
apply to this node (selection.py) and hands them to the image-set manager. What was applied
last is saved to ``cluster.state_file`` and loaded before the shim serves; while a resource
cannot be read, the sets it gave last stay in force. docs/image-sets.md ("Safe without the
API", "A version that cannot be applied") has the rules.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from ..config import ClusterConfig
from ..credentials import Credential
from ..imagesets.loader import ImageSet
from ..imagesets.manager import ImageSets
from ..observability import logs
from . import objects, state
from .client import identity_problem, new_client, user_name
from .discovery import mco_kinds
from .informer import Informer
from .objects import Kind, SecretRef, Selected
from .parses import DocumentParser, Parses
from .pods import NodePods
from .reachability import Reachability, backoff, describe, readyz
from .secrets import PullSecrets
from .selection import Applied, select_sets
from .source_events import SourceEvents

_log = logs.get("cluster")
SOURCE = "cluster"
MCO_KEYS = ("pinnedimagesets", "machineconfigpools")  # their informers' keys, in mco_kinds' order


def node_name(cfg: ClusterConfig) -> str:
    return cfg.node_name or socket.gethostname().lower()


def _lister(custom: CustomObjectsApi, kind: Kind) -> Any:
    return partial(custom.list_cluster_custom_object, kind.group, kind.version, kind.plural)


HAND_OVER_IMAGES = 4000  # new names handed to the reconciler per step of the apply loop (ClusterSource.hand_over)


@dataclass(frozen=True)
class _HandOver:
    """A selection to hand to the image sets (``ImageSets.set_source``'s arguments)."""
    sets: dict[str, ImageSet]
    held: dict[str, ImageSet]
    uids: dict[str, str]
    fresh: frozenset[str]
    present: frozenset[str]
    decided: tuple[str, ...]


class ClusterSource:
    def __init__(self, cfg: ClusterConfig, sets: ImageSets, events: SourceEvents, *,
                 parser: DocumentParser | None = None) -> None:
        """``parser``: where objects are parsed (the image sets' parser child); None: in threads."""
        self.cfg = cfg
        self.sets = sets
        self.events = events  # the metrics
        self.node_name = node_name(cfg)
        self.labels: dict[str, str] | None = None  # None: not known yet
        self.selected: dict[str, Selected] = {}
        self.errors: dict[str, str] = {}  # by object (cluster:Kind/name, MachineConfigPool name, node)
        self.refused: dict[str, objects.Refused] = {}  # by set name: its newest version cannot be applied
        self.last_refused: dict[str, str] = {}  # by set name: the generation refused last, while the set is declared
        self.held: dict[str, Selected] = {}  # by set name: a paced set's generation waiting for its grant
        self.state_error = ""  # why the state file cannot be read or written; "" once a save succeeded
        self.identity_error = ""  # the kubeconfig is another node's kubelet (client.identity_problem)
        self.state_write_failures = 0  # the start check and every save that failed
        self._unsaved = False  # the last save failed: tried again after backoff_max_seconds
        self._clear_metrics()  # not a previous source's (a reload that changed cluster.*)
        self.loaded_from_state = False
        self.applies = 0
        self.api: ApiClient | None = None
        self.informers: dict[str, Informer] = {}
        self.secrets: PullSecrets | None = None
        self.parses = Parses(parser)  # the objects' sets, parsed off the loop (parses.py)
        self.hand_over_images = HAND_OVER_IMAGES
        self._target: _HandOver | None = None  # the rest of the last selection to hand over (hand_over)
        self._handed: dict[str, ImageSet] = {}  # the sets handed to the image sets last, by name
        self._handed_uids: dict[str, str] = {}  # their objects' uids
        self._own_raw: dict[str, dict[str, Any]] = {}  # applied ImageSet objects, by name
        self._encoded: state.Encoded = {}  # their JSON as saved last, by version (state.py)
        self._pinned_raw: dict[str, dict[str, Any]] = {}  # applied PinnedImageSet objects, by name
        self._inputs: object = None
        self._dirty = asyncio.Event()
        self.changed = asyncio.Event()  # set after every apply (the status writer listens)
        self._tasks: list[asyncio.Task[None]] = []
        self.reach: Reachability | None = None
        self._common: dict[str, Any] = {}  # what every Informer of this source is built with
        self.mco_kinds: tuple[Kind, Kind] | None = None  # (PinnedImageSet, MachineConfigPool) as served
        self.mco_checks = 0  # discovery answers
        self.mco_error = ""
        self._mco_tasks: dict[str, asyncio.Task[None]] = {}
        # the pods bound to this node and their priority (pods.py): built by start when
        # cluster.pod_priority is on, None before start, after stop, or when it is off
        self.pods: NodePods | None = None

    def priority_of(self, namespace: str, name: str, uid: str) -> int | None:
        """A pod's ``spec.priority`` from the API server (NodePods.priority_of); None = unknown:
        not started, ``cluster.pod_priority`` off, the pod not seen, or the API server not answering."""
        return self.pods.priority_of(namespace, name, uid) if self.pods is not None else None

    def mark_changed(self) -> None:
        """Something the selection reads changed (the informers call this): the apply loop runs again."""
        self._dirty.set()

    def credentials_for(self, set_names: frozenset[str]) -> list[tuple[str, Credential]]:
        """The entries of the pull secrets the applied sets ``set_names`` name (once started)."""
        return self.secrets.for_sets(set_names) if self.secrets is not None else []

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
        self._select(labels, list(self._own_raw.values()), None, gate=False, read=False)  # every one was in force
        self.loaded_from_state = True
        logs.log(_log, logging.INFO, "cluster image sets loaded from the state file", file=self.cfg.state_file,
                 sets=len(self.selected))

    def save_state(self) -> None:
        """Write what is applied now to cluster.state_file (the apply loop does after every apply,
        in a thread); a failure is logged, counted and tried again later."""
        assert self.labels is not None
        try:
            state.save(self.cfg.state_file, self.labels, list(self._own_raw.values()), list(self._pinned_raw.values()),
                       self._encoded)
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
        self.events.cluster_state_write_failed()
        self._state_problem(f"{self.cfg.state_file}: cannot write: {e.strerror or e}")

    def _state_problem(self, error: str) -> None:
        self.state_error = error
        self.events.cluster_state_error(bool(error))

    # ------------------------------------------------------------------ selection

    def _select(self, labels: dict[str, str], own: list[dict[str, Any]],
                mco: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None, *, gate: bool = True,
                read: bool = True) -> bool:
        """Select (selection.py) and hand over; ``mco`` None keeps the PinnedImageSets applied last.
        True when the sets in force changed. ``gate``: hold a paced set's generation until granted
        (not for the state file's sets, all in force). ``read``: ``own`` is what the API server
        holds now (not the state file's, nor kept while the ImageSets cannot be listed): a set it
        no longer selects is confirmed gone (the pin ledger). A refused set is reported in
        ``refused`` (status row, Degraded, Event)."""
        result = select_sets(self.node_name, labels, own, mco,
                             Applied(self.selected, self._own_raw, self._pinned_raw), gate=gate,
                             parse=self.parses.parsed_set)
        selected, errors, refused, held = result.applied.selected, result.errors, result.refused, result.held
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
        for name in held.keys() - self.held.keys():
            logs.log(_log, logging.INFO, "paced image set generation waits for its grant; the version in force stays",
                     set=name, generation=held[name].set.generation,
                     in_force=selected[name].set.generation if name in selected else "none")
        for name in self.held.keys() - held.keys():
            if name in selected:
                logs.log(_log, logging.INFO, "paced image set generation granted", set=name,
                         generation=selected[name].set.generation)
        self.held = held
        self.last_refused.update((n, r.generation) for n, r in refused.items())
        for name in self.last_refused.keys() - refused.keys() - selected.keys():  # no longer declared here
            del self.last_refused[name]
        self._own_raw, self._pinned_raw = result.applied.own_raw, result.applied.pinned_raw
        changed = {n: s.set for n, s in selected.items()} != {n: s.set for n, s in self.selected.items()}
        self.selected = selected
        if self.secrets is not None:
            self.secrets.name_sets({n: s.secrets for n, s in selected.items() if s.secrets})
        self._target = _HandOver({n: s.set for n, s in selected.items()}, {n: s.set for n, s in held.items()},
                                 {n: s.uid for n, s in (*selected.items(), *held.items())},
                                 frozenset((selected.keys() - result.kept) | held.keys()) if read else frozenset(),
                                 frozenset(selected.keys() | refused.keys() | held.keys() | result.undecided),
                                 tuple(f"{SOURCE}:{kind}/" for kind, whole in
                                       (("ImageSet", read), ("PinnedImageSet", read and mco is not None)) if whole))
        self.hand_over(whole=not read)  # the state file's, before serving: at once
        self.sets.set_overrides(**self._overrides())
        self.report()
        return changed

    @property
    def handing_over(self) -> bool:
        """Whether the last selection's new versions are not all handed to the image sets yet."""
        return self._target is not None

    def hand_over(self, *, whole: bool = False) -> None:
        """Hand the last selection to the image sets: its unchanged sets and new versions of at most
        ``hand_over_images`` names (the reconciler's table costs about 7 us a new name on the event
        loop), unless ``whole``. A set whose turn has not come keeps the version handed before (or
        none yet); every selected set is ``present`` throughout, so no pin goes meanwhile. The apply
        loop calls it again, yielding in between, while ``handing_over``."""
        t = self._target
        if t is None:
            return
        budget = None if whole else self.hand_over_images
        sets: dict[str, ImageSet] = {}
        uids: dict[str, str] = {}
        fresh: set[str] = set()
        rest = False
        for name, s in t.sets.items():
            old = self._handed.get(name)
            if old is s or budget is None or budget > 0:
                if old is not s and budget is not None:
                    budget -= len(s.refs)
                sets[name], uids[name] = s, t.uids[name]
                if name in t.fresh:
                    fresh.add(name)
                continue
            rest = True  # its turn comes at the next step
            if old is not None:
                sets[name], uids[name] = old, self._handed_uids[name]
        uids.update((n, t.uids[n]) for n in t.held)
        self._handed, self._handed_uids = sets, {n: uids[n] for n in sets}
        self._target = t if rest else None
        self.sets.set_source(SOURCE, sets, held=t.held, uids=uids, fresh=frozenset(fresh), present=t.present,
                             decided=t.decided)

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

    def report(self) -> None:
        """The refused sets and the unusable pull Secrets, to the metrics."""
        self.events.invalid_declarations(SOURCE, len(self.refused))
        self.events.secret_errors(len(self.secret_errors()))

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
        self._select(labels, own, mco, read=own_inf.synced)
        self.applies += 1
        return True

    async def prepare(self) -> None:
        """Parse the set objects' new versions off the loop (parses.py), so ``recompute`` costs the change.
        ImageSets whose nodeSelector does not select this node (as its labels are known now) are not parsed."""
        node_inf, own_inf = self.informers.get("node"), self.informers.get("imagesets")
        node = node_inf.items.get(self.node_name) if node_inf is not None and node_inf.synced else None
        if node is None or own_inf is None or not own_inf.synced:
            return
        labels = (node.get("metadata") or {}).get("labels") or {}
        docs = []
        for obj in own_inf.items.values():
            try:
                if not objects.selects((obj.get("spec") or {}).get("nodeSelector"), labels, none_selects_all=True):
                    continue
            except (objects.SelectorError, AttributeError):
                continue  # refused without parsing (own_set says why)
            docs.append((objects.source_of(obj), obj, *objects.own_document(obj)))
        pis = self.informers.get("pinnedimagesets")
        for obj in pis.items.values() if pis is not None and pis.synced else ():
            docs.append((objects.source_of(obj), obj, *objects.pinned_document(obj)))
        await self.parses.prepare(docs)

    # ------------------------------------------------------------------ running

    async def start(self) -> None:
        self.api = await new_client(self.cfg.kubeconfig)
        api = self.api
        custom = CustomObjectsApi(api)
        core = CoreV1Api(api)
        self.reach = Reachability(lambda: readyz(api, self.cfg.request_timeout_seconds),
                                  probe_interval=self.cfg.probe_interval_seconds,
                                  request_timeout=self.cfg.request_timeout_seconds)
        self._common = dict(on_change=self.mark_changed, reach=self.reach, watch_timeout=self.cfg.watch_timeout_seconds,
                            request_timeout=self.cfg.request_timeout_seconds,
                            backoff_initial=self.cfg.backoff_initial_seconds,
                            backoff_max=self.cfg.backoff_max_seconds)
        self.secrets = PullSecrets(core, refresh_seconds=self.cfg.secret_refresh_seconds,
                                   request_timeout=self.cfg.request_timeout_seconds,
                                   watcher=partial(self._secret_watch, core),
                                   on_change=self.sets.retry_failed)
        self.secrets.name_sets({n: s.secrets for n, s in self.selected.items() if s.secrets})

        self.informers = {
            "node": Informer(api, "nodes", core.list_node, kind=("v1", "Node"),
                             field_selector=f"metadata.name={self.node_name}", **self._common),
            "imagesets": Informer(api, "imagesets", _lister(custom, objects.IMAGE_SET),
                                  kind=(objects.IMAGE_SET.api_version, objects.IMAGE_SET.kind), **self._common),
        }
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(inf.run(), name=f"cluster-watch-{name}")
                       for name, inf in self.informers.items()]
        if self.cfg.pod_priority:  # its own status row ("pod_priority"), not under "watches": a refused
            # pod list (a ServiceAccount without rights on pods) leaves the image sets' watches as they are
            self.pods = NodePods(api, core.list_pod_for_all_namespaces, self.node_name, max_pods=self.cfg.max_pods,
                                 **self._common)
            self._tasks.append(loop.create_task(self.pods.run(), name="cluster-watch-pods"))
        self._tasks.append(loop.create_task(self.apply_loop(), name="cluster-apply"))
        self._tasks.append(loop.create_task(self._secrets_loop(), name="cluster-secrets"))
        self._tasks.append(loop.create_task(self._identity_check(api), name="cluster-identity"))
        if self.cfg.mco:  # in the background: the shim serves before any API request is answered
            self._tasks.append(loop.create_task(self._mco_loop(custom), name="cluster-mco"))

    async def _identity_check(self, api: ApiClient) -> None:
        """Once answered: whether the kubeconfig's user is another node's kubelet. Not answered
        (unreachable, 401 before a certificate rotation) it is asked again after backoff."""
        delay = self.cfg.backoff_initial_seconds
        while True:
            try:
                user = await user_name(api, self.cfg.request_timeout_seconds)
                break
            except ApiException as e:
                if e.status in (403, 404):
                    return  # not allowed to ask, or an API server before 1.28: nothing to say
            except Exception:  # unreachable: ask again
                pass
            await asyncio.sleep(delay * random.uniform(1, 2))
            delay = min(delay * 2, self.cfg.backoff_max_seconds)
        self.identity_error = identity_problem(user, self.node_name)
        if self.identity_error:
            logs.log(_log, logging.ERROR, "wrong node name for this identity", error=self.identity_error)

    def _secret_watch(self, core: CoreV1Api, ref: SecretRef, on_change: Callable[[], None]) -> Informer:
        assert self.api is not None
        common = {**self._common, "on_change": on_change}
        return Informer(self.api, f"secret {ref.namespace}/{ref.name}",
                        partial(core.list_namespaced_secret, ref.namespace), kind=("v1", "Secret"),
                        field_selector=f"metadata.name={ref.name}", give_up_on=frozenset({403}), **common)

    # ------------------------------------------------------------------ MCO, when served

    async def _mco_loop(self, custom: CustomObjectsApi) -> None:
        """Ask discovery whether MCO's pinned sets are served; watch them while they are.

        Asked at start and every ``cluster.mco_discovery_seconds`` (x 1..1.5) while they are not served (or
        while a watch of them fails): a cluster without MCO costs one discovery request per
        node per interval, never a list. When they go away, their watches stop and the
        PinnedImageSets applied last stay in force."""
        assert self.reach is not None
        failures = 0
        while True:
            if self.mco_kinds is None or any(self.informers[k].error for k in MCO_KEYS if k in self.informers):
                try:
                    assert self.api is not None
                    kinds = await mco_kinds(self.api, self.cfg.request_timeout_seconds)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # down, forbidden: ask again with backoff
                    failures += 1
                    self.reach.failed("discovery", e)
                    self.mco_error = describe(e)
                    await self.reach.wait(backoff(failures, self.cfg.backoff_initial_seconds,
                                                  self.cfg.backoff_max_seconds))
                    continue
                failures, self.mco_error = 0, ""
                self.reach.succeeded("discovery")
                self.mco_checks += 1
                self._mco_served(kinds, custom)
            # x 1..1.5: a fleet started together does not ask together
            await asyncio.sleep(self.cfg.mco_discovery_seconds * (1 + 0.5 * random.random()))

    def _mco_served(self, kinds: tuple[Kind, Kind] | None, custom: CustomObjectsApi) -> None:
        first = self.mco_checks == 1
        if kinds == self.mco_kinds and not first and (kinds is None or all(k in self._mco_tasks for k in MCO_KEYS)):
            return
        for key in MCO_KEYS:  # not served, or at another version: stop what watches the old one
            task = self._mco_tasks.pop(key, None)
            if task is not None:
                task.cancel()
            self.informers.pop(key, None)
        if kinds is None:
            logs.log(_log, logging.INFO if first else logging.WARNING,
                     "MCO's PinnedImageSets are not served; the ones applied last stay in force; asking again later",
                     every_seconds=self.cfg.mco_discovery_seconds)
        else:
            logs.log(_log, logging.INFO, "MCO's PinnedImageSets are served; watching them",
                     version=kinds[0].api_version)
        self.mco_kinds = kinds
        self._dirty.set()
        if kinds is None:
            return
        assert self.api is not None
        loop = asyncio.get_running_loop()
        for key, kind in zip(MCO_KEYS, kinds):
            inf = Informer(self.api, f"{kind.plural}.{kind.version}", _lister(custom, kind),
                           kind=(kind.api_version, kind.kind), **self._common)
            self.informers[key] = inf
            self._mco_tasks[key] = loop.create_task(inf.run(), name=f"cluster-watch-{key}")

    async def apply_loop(self) -> None:
        """Apply what the informers know each time one of them changed (``mark_changed``); run by ``start``."""
        while True:
            try:  # while the last save failed, it is tried again when nothing else happened meanwhile
                await asyncio.wait_for(self._dirty.wait(), self.cfg.backoff_max_seconds if self._unsaved else None)
            except TimeoutError:
                await asyncio.to_thread(self.save_state)
                continue
            self._dirty.clear()
            try:
                await self.prepare()
                applied = self.recompute()
                while self.handing_over:  # a large first apply: the reconciler takes it in steps
                    await asyncio.sleep(0)
                    self.hand_over()
            except Exception as e:  # no rule foresaw this object: keep what is in force, say so, try again
                self._inputs = None  # the same inputs are looked at again, not skipped as already applied
                logs.log(_log, logging.ERROR, "cluster image sets not applied; the sets applied last stay in force",
                         error=f"{type(e).__name__}: {e}", retry_seconds=self.cfg.backoff_max_seconds)
                await asyncio.sleep(self.cfg.backoff_max_seconds)
                self._dirty.set()
                continue
            if applied:
                await asyncio.to_thread(self.save_state)
                self.changed.set()
                if self.secrets is not None:
                    self.secrets.sync()
                    if self.secrets.due():
                        await self._refresh_secrets()

    async def _secrets_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.cfg.secret_refresh_seconds, 60.0))
            await self._refresh_secrets()

    async def _refresh_secrets(self) -> None:
        assert self.secrets is not None
        due = self.secrets.due()
        if due and await self.secrets.refresh(due):
            self.sets.retry_failed()
        self.report()

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._mco_tasks.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._mco_tasks = [], {}
        self.pods = None  # every answer None from now on: the callers' rules
        if self.secrets is not None:
            await self.secrets.stop()
        if self.reach is not None:
            await self.reach.stop()
        if self.api is not None:
            await self.api.close()
            self.api = None
        self._clear_metrics()  # no source: no state file, nothing refused

    def _clear_metrics(self) -> None:
        """The gauges this source sets, at 0: a stopped source (or a new one before its first
        apply) must not leave a previous source's state-file error or counts behind."""
        self.events.cluster_state_error(False)
        self.events.invalid_declarations(SOURCE, 0)
        self.events.secret_errors(0)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "node": self.node_name,
            "labels_known": self.labels is not None,
            "loaded_from_state": self.loaded_from_state,
            "state_file": self.cfg.state_file,
            "sets": {n: {"kind": s.set.kind, "generation": s.set.generation} for n, s in sorted(self.selected.items())},
            "watches": {name: {"synced": inf.synced, "lists": inf.lists, "watches": inf.watches,
                               **({"throttled": inf.throttled} if inf.throttled else {}),
                               **({"error": inf.error} if inf.error else {})}
                        for name, inf in self.informers.items()},
        }
        if self.errors:
            out["errors"] = dict(self.errors)
        if self.refused:
            out["refused_sets"] = {n: {"kind": r.kind, "refused_generation": r.generation, "error": r.error,
                                       "in_force_generation": r.kept or "none"}
                                   for n, r in sorted(self.refused.items())}
        if self.held:
            out["awaiting_grant"] = {n: {"generation": s.set.generation,
                                         "in_force_generation": self.selected[n].set.generation
                                         if n in self.selected else "none"}
                                     for n, s in sorted(self.held.items())}
        if self.state_error:
            out["state_error"] = self.state_error
        if self.identity_error:
            out["identity_error"] = self.identity_error
        if self.state_write_failures:
            out["state_write_failures"] = self.state_write_failures
        if self.secrets is not None and self.secrets.by_set:
            out["pull_secrets"] = self.secrets.status()
        if self.cfg.mco:
            out["mco"] = {"served": None if not self.mco_checks else self.mco_kinds is not None,
                          "discovery_answers": self.mco_checks,
                          **({"version": self.mco_kinds[0].api_version} if self.mco_kinds else {}),
                          **({"error": self.mco_error} if self.mco_error else {})}
        if self.pods is not None:
            out["pod_priority"] = self.pods.status()
        if self.reach is not None:
            out["api"] = self.reach.status()
        return out


