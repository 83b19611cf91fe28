"""`cri-shim fleet status`: per ImageSet, the truth `cri-shim controller` wrote to its status
(selected, current, progressing, failing, stale, missing nodes; failing nodes with their reason;
the rollout's time; a paced set's phase, waiting nodes and grants in flight). Read-only: one
list of the ImageSets. A set whose status is absent or behind its generation says so: no
controller is running, or it has not caught up.

MCO's PinnedImageSets too, from the PinnedImageSetReports the controller writes for them (one more
list), as ``PinnedImageSet/<name>``; their generation is the one the report is for (the
PinnedImageSets themselves are not read).

A 429 (APF throttling, or ``storage is (re)initializing`` just after a CRD is installed or the API
server restarts) is waited out as its Retry-After asks, for up to ``THROTTLED_MAX_SECONDS``; any
other error is one line on stderr and exit status 1, never a traceback."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import aiohttp

from .objects import IMAGE_SET, PINNED_REPORT, Kind
from .reachability import describe, retry_after

COUNTS = ("selected", "current", "progressing", "failing", "stale", "missing")
THROTTLED_MAX_SECONDS = 30.0  # how long 429s are waited out before the command gives up


def summarize(items: list[dict[str, Any]], reports: tuple[dict[str, Any], ...] | list[dict[str, Any]] = ()
              ) -> dict[str, dict[str, Any]]:
    """By ImageSet name, then by ``PinnedImageSet/<name>`` (``reports``: PinnedImageSetReports)."""
    out: dict[str, dict[str, Any]] = {}
    objs = [(str(o["metadata"]["name"]), o, o["metadata"].get("generation")) for o in items]
    objs += [(f"PinnedImageSet/{o['metadata']['name']}", o, (o.get("status") or {}).get("observedGeneration"))
             for o in reports]
    for name, obj, gen in sorted(objs, key=lambda t: (t[0].startswith("PinnedImageSet/"), t[0])):
        st = obj.get("status") or {}
        row: dict[str, Any] = {"generation": gen, "observedGeneration": st.get("observedGeneration"),
                               **{k: st.get(k) for k in COUNTS}}
        if not st:
            row["note"] = "no status: is `cri-shim controller` running?"
        elif st.get("observedGeneration") != gen:
            row["note"] = f"status is for generation {st.get('observedGeneration')}; the controller has not caught up"
        for k in ("waiting", "rollout", "failedReasons", "failingNodes", "staleNodes", "missingNodes",
                  "rolloutSeconds", "machineConfigPools"):
            if k in st:
                row[k] = st[k]
        row["conditions"] = {c["type"]: {"status": c.get("status"), "reason": c.get("reason", "")}
                             for c in st.get("conditions") or []}
        out[name] = row
    return out


async def _list(kubeconfig: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ImageSets, and the PinnedImageSetReports (none where that CRD is not installed)."""
    from kubernetes_asyncio.client import CustomObjectsApi
    from kubernetes_asyncio.client.exceptions import ApiException
    from kubernetes_asyncio.config import new_client_from_config

    api = await new_client_from_config(config_file=kubeconfig, persist_config=False)

    loop = asyncio.get_running_loop()
    give_up = loop.time() + THROTTLED_MAX_SECONDS

    async def items(kind: Kind) -> list[dict[str, Any]]:
        while True:
            try:
                resp = await CustomObjectsApi(api).list_cluster_custom_object(kind.group, kind.version, kind.plural,
                                                                              _request_timeout=60)
                return list(resp.get("items") or [])
            except ApiException as e:
                if e.status != 429:
                    raise
                wait = retry_after(e, 5.0) or 1.0
                if loop.time() + wait > give_up:
                    raise
                await asyncio.sleep(wait)
    try:
        sets = await items(IMAGE_SET)
        try:
            reports = await items(PINNED_REPORT)
        except ApiException as e:
            if e.status != 404:
                raise
            reports = []
        return sets, reports
    finally:
        await api.close()


def _n(v: Any) -> str:
    return "-" if v is None else str(v)


def print_fleet(kubeconfig: str, *, as_json: bool = False) -> int:
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        summary = summarize(*asyncio.run(_list(kubeconfig)))
    except ApiException as e:
        print(f"cri-shim fleet status: the API server answered {describe(e)}", file=sys.stderr)
        return 1
    except (TimeoutError, OSError, aiohttp.ClientError) as e:
        print(f"cri-shim fleet status: cannot reach the API server: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{'SET':<32} {'GEN':>4} {'SELECTED':>8} {'CURRENT':>7} {'PROGRESSING':>11} {'FAILING':>7} {'STALE':>5} "
          f"{'MISSING':>7}  DEGRADED")
    for name, s in summary.items():
        degraded = s["conditions"].get("Degraded", {})
        print(f"{name:<32} {_n(s['generation']):>4} " + " ".join(f"{_n(s[k]):>{w}}" for k, w in
              (("selected", 8), ("current", 7), ("progressing", 11), ("failing", 7), ("stale", 5), ("missing", 7)))
              + f"  {degraded.get('reason', '-') if degraded.get('status') == 'True' else '-'}")
        if "note" in s:
            print(f"  {s['note']}")
        if "machineConfigPools" in s:
            print(f"  pools: {', '.join(s['machineConfigPools']) or 'none lists it'}")
        if "rollout" in s:  # a paced set
            ro, halted = s["rollout"], s["conditions"].get("Halted", {})
            # halted, or not halted with nothing to grant (NoNodeToGrant): the reason, and why
            why = (f" ({halted.get('reason')})"
                   if halted.get("status") == "True" or halted.get("reason") == "NoNodeToGrant" else "")
            print(f"  rollout: {ro.get('phase')}{why}, {s.get('waiting', 0)} waiting for a grant, "
                  f"{ro.get('inFlight', 0)} of {ro.get('maxConcurrentNodes')} in flight")
        for f in s.get("failingNodes", []):
            print(f"  {f['node']}: {f.get('reasons', '')}: {f.get('error', '')[:160]}")
        for key, what in (("staleNodes", "stale"), ("missingNodes", "missing")):
            if s.get(key):
                print(f"  {what}: {', '.join(s[key])}")
    return 0
