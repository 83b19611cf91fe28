"""Simulated shims for the cluster suite: nodes that follow one paced ImageSet as a shim does, and
really fetch its images from the registry, each through its own counting proxy, so the registry
side counts what every node fetches and when (``RequestRecord`` start and end).

Each simulated node decides with the shim's own rule (shim/cluster/grant.py): a generation of a
paced set starts only with a grant (or when not paced); until then the node reports
``reason: AwaitingGrant`` with the version in force as ``currentGeneration`` (and, while it still
pulls the version in force, ``images.pulling``, as a shim's row counts that version's images). A started
generation fetches every image (manifest, then config and layer blobs); a 404 is ``notFound``
(failing, retried like a shim would after ``retry_seconds``); all fetched is current. Reports are
server-side applies of the node's NodeImageSetStatus with the shims' field manager, written only
when the row changes, as shim/cluster/node_report.py does.

    fleet = SimFleet(kubeconfig, registry.direct_host, "web", ["n1", "n2"]).start()
    ...
    fleet.intervals()   # node -> [(first request start, last request end)] per generation, at its proxy
    fleet.silence("n1")  # its shim stops: no read, no write, no fetch (silence("n1", False): back)
    fleet.stop()

``kind="PinnedImageSet"``: the nodes follow MCO's PinnedImageSet of that name instead (never paced;
whether a pool selects them is the test's business: every simulated node follows it), their rows of
that kind, as a shim writes them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import ApiClient, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import new_client_from_config

from shim.cluster import grant
from tests.support.proxy import CountingProxy

SOURCES = {"ImageSet": (("cri-shim.io", "v1", "imagesets"), "images"),  # kind -> (group, version, plural), images
           "PinnedImageSet": (("machineconfiguration.openshift.io", "v1", "pinnedimagesets"), "pinnedImages")}
ACCEPT = ", ".join(("application/vnd.oci.image.manifest.v1+json",
                    "application/vnd.docker.distribution.manifest.v2+json"))


class _Node:
    def __init__(self, name: str, proxy: CountingProxy) -> None:
        self.name = name
        self.proxy = proxy
        self.in_force: Any = None  # the generation applied (started) here
        self.current: Any = None  # the last generation complete here
        self.failed: str = ""  # why the generation started last failed ("" = none)
        self.task: asyncio.Task[None] | None = None
        self.row: dict[str, Any] | None = None  # as last written
        self.pulls: list[tuple[Any, float, float]] = []  # (generation, start, end) of each attempt
        self.started: list[tuple[Any, float]] = []  # (generation, when this node saw its grant)


def merge(spans: list[tuple[float, float]], gap: float = 0.05) -> list[tuple[float, float]]:
    """Request times as fetching spans: requests of one pull follow each other (within ``gap``);
    a longer pause (a retry's wait, the next generation) separates pulls."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def fetch(host: str, ref: str, timeout: float = 60.0) -> None:
    """Fetch an image (manifest and blobs) from ``host``; raises urllib.error.HTTPError (404)."""
    path = ref.split("/", 1)[1]
    repository, _, tag = path.rpartition(":")

    def get(url: str, accept: str = "") -> bytes:
        req = urllib.request.Request(f"http://{host}/v2/{repository}/{url}", headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return bytes(r.read())
    manifest = json.loads(get(f"manifests/{tag}", ACCEPT))
    for blob in [manifest["config"], *manifest.get("layers", [])]:
        get(f"blobs/{blob['digest']}")


class SimFleet:
    def __init__(self, kubeconfig: Path, registry: str, set_name: str, nodes: list[str], *,
                 tick: float = 0.1, retry_seconds: float = 1.0, throttle_bps: int | None = None,
                 kind: str = "ImageSet") -> None:
        self.kubeconfig = kubeconfig
        self.set_name = set_name
        self.kind = kind
        self.tick = tick
        self.retry_seconds = retry_seconds
        self.nodes = {}
        for n in nodes:
            proxy = CountingProxy(registry).start()
            proxy.set_throttle(throttle_bps)
            self.nodes[n] = _Node(n, proxy)
        self.errors: list[str] = []
        self.silent: set[str] = set()  # nodes whose shim is stopped
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="sim-fleet", daemon=True)

    def start(self) -> SimFleet:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the simulated fleet did not stop"
        for n in self.nodes.values():
            n.proxy.stop()

    def intervals(self) -> dict[str, list[tuple[float, float]]]:
        """Per node, when it fetched from the registry: one (first start, last end) per attempt,
        from its proxy's records (the registry side's clock, time.monotonic)."""
        return {name: merge([(r.start, r.end) for r in n.proxy.records()]) for name, n in self.nodes.items()}

    def silence(self, node: str, silent: bool = True) -> None:
        """Stop (or restart) a node's shim: a stopped one reads, writes and fetches nothing; its
        pull in progress is cancelled. Restarted, it goes on from what it had written."""
        def apply() -> None:
            n = self.nodes[node]
            if silent:
                self.silent.add(node)
                if n.task is not None:
                    n.task.cancel()
                n.in_force = n.current  # a restarted shim starts the generation again
            else:
                self.silent.discard(node)
        self._loop.call_soon_threadsafe(apply)

    def requests(self, node: str) -> int:
        return len(self.nodes[node].proxy.records())

    # ------------------------------------------------------------------ the simulation

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        api = await new_client_from_config(config_file=str(self.kubeconfig), persist_config=False)
        custom = CustomObjectsApi(api)
        try:
            while not self._stop.is_set():
                try:
                    await self._step(api, custom)
                except Exception as e:  # noqa: BLE001 - kept for the test to show
                    self.errors.append(f"{type(e).__name__}: {e}")
                try:
                    async with asyncio.timeout(self.tick):
                        await self._stop.wait()
                except TimeoutError:
                    pass
        finally:
            for n in self.nodes.values():
                if n.task is not None:
                    n.task.cancel()
            await asyncio.gather(*(n.task for n in self.nodes.values() if n.task is not None),
                                 return_exceptions=True)
            await api.close()

    async def _step(self, api: ApiClient, custom: CustomObjectsApi) -> None:
        try:
            where, field = SOURCES[self.kind]
            obj = await custom.get_cluster_custom_object(*where, self.set_name)
        except ApiException as e:
            if e.status == 404:
                return
            raise
        gen = obj["metadata"]["generation"]
        refs = [i["name"] for i in obj["spec"].get(field, [])]
        for n in self.nodes.values():
            if n.name in self.silent:
                continue
            if n.in_force != gen and (not grant.paced(obj) or grant.granted(obj, n.name)):
                if n.task is not None:
                    n.task.cancel()
                n.in_force, n.failed = gen, ""
                n.started.append((gen, time.monotonic()))
                n.task = asyncio.get_running_loop().create_task(self._pull(n, gen, refs))
            row: dict[str, Any] = {"name": self.set_name, "kind": self.kind, "source": "cluster",
                                   "desiredGeneration": str(gen)}
            if n.current is not None:
                row["currentGeneration"] = str(n.current)
            if n.in_force != gen:
                row["reason"] = "AwaitingGrant"
                if n.task is not None and not n.task.done() and not n.failed:  # still pulling the one in force
                    row["images"] = {"pulling": 1}
            elif n.failed:
                row.update(failedReasons={"notFound": 1}, error=n.failed, images={"failed": 1})
            if row != n.row:
                body = {"apiVersion": "cri-shim.io/v1", "kind": "NodeImageSetStatus", "metadata": {"name": n.name},
                        "status": {"nodeName": n.name, "sets": [row]}}
                await custom.patch_cluster_custom_object(  # type: ignore[call-arg]
                    "cri-shim.io", "v1", "nodeimagesetstatuses", n.name, body, field_manager="cri-shim", force=True,
                    _content_type="application/apply-patch+yaml")
                n.row = row

    async def _pull(self, n: _Node, gen: Any, refs: list[str]) -> None:
        while True:
            start = time.monotonic()
            try:
                for ref in refs:
                    await asyncio.to_thread(fetch, n.proxy.host, ref)
            except urllib.error.HTTPError as e:
                n.pulls.append((gen, start, time.monotonic()))
                n.failed = f"{ref}: {e.code} {e.reason}"
                await asyncio.sleep(self.retry_seconds)
                continue
            n.pulls.append((gen, start, time.monotonic()))
            n.failed, n.current = "", gen
            return
