"""`cri-shim fleet status`: per set, over every node's NodeImageSetStatus, how many nodes it
selects, how many are done (current generation = desired), progressing and failing, and which
nodes fail with what reason (a pull's typed reason, or the set's: ``InvalidSet``,
``PullSecretUnavailable``). Read-only: one list of the status objects."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any

from .objects import NODE_STATUS


def summarize(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    sets: dict[str, dict[str, Any]] = defaultdict(lambda: {"selected": 0, "done": 0, "progressing": 0, "failing": 0,
                                                           "generations": set(), "failures": []})
    for obj in items:
        node = obj["metadata"]["name"]
        for row in (obj.get("status") or {}).get("sets", []):
            s = sets[row["name"]]
            s["selected"] += 1
            s["generations"].add(row.get("desiredGeneration", ""))
            images = row.get("images") or {}
            if images.get("failed") or row.get("failedReasons") or row.get("reason"):
                s["failing"] += 1
                reasons = ",".join(sorted({*(row.get("failedReasons") or {}), *([row["reason"]] if row.get("reason")
                                                                                  else [])})) or "other"
                s["failures"].append({"node": node, "reasons": reasons, "error": row.get("error", "")})
            elif row.get("currentGeneration") == row.get("desiredGeneration"):
                s["done"] += 1
            else:
                s["progressing"] += 1
    return {name: {**s, "generations": sorted(s["generations"])} for name, s in sorted(sets.items())}


async def _list(kubeconfig: str) -> list[dict[str, Any]]:
    from kubernetes_asyncio.client import CustomObjectsApi
    from kubernetes_asyncio.config import new_client_from_config

    api = await new_client_from_config(config_file=kubeconfig, persist_config=False)
    try:
        resp = await CustomObjectsApi(api).list_cluster_custom_object(NODE_STATUS.group, NODE_STATUS.version,
                                                                      NODE_STATUS.plural, _request_timeout=60)
        return list(resp.get("items") or [])
    finally:
        await api.close()


def print_fleet(kubeconfig: str, *, as_json: bool = False) -> int:
    summary = summarize(asyncio.run(_list(kubeconfig)))
    if as_json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{'SET':<32} {'GENERATION':<12} {'SELECTED':>8} {'DONE':>6} {'PROGRESSING':>11} {'FAILING':>7}")
    for name, s in summary.items():
        print(f"{name:<32} {','.join(s['generations']):<12} {s['selected']:>8} {s['done']:>6} "
              f"{s['progressing']:>11} {s['failing']:>7}")
        for f in s["failures"][:20]:
            print(f"  {f['node']}: {f['reasons']}: {f['error'][:160]}")
    return 0
