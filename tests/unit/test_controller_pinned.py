"""MCO PinnedImageSets in the controller: the nodes a set selects through the pools listing it
(shim/controller/pools.py), its truth from the nodes' rows of kind PinnedImageSet (truth.py) and
the PinnedImageSetReport written for it (report.py); `fleet status` lists the reports."""

from __future__ import annotations

from functools import partial
from typing import Any

from shim.cluster import aggregate
from shim.cluster.fleet import summarize
from shim.controller import pools, report, truth

T0 = 1_800_000_000.0


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


def pool(name: str, selector: dict[str, Any] | None, *sets: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"pinnedImageSets": [{"name": s} for s in sets]}
    if selector is not None:
        spec["nodeSelector"] = selector
    return {"metadata": {"name": name}, "spec": spec, "status": {"machineCount": 3}}


def nis(name: str, *rows: dict[str, Any], **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "managedFields": [{"manager": "cri-shim", "time": truth.format_time(T0)}]},
            "status": {"sets": list(rows), **status}}


def row(desired: str, current: str | None, kind: str = "PinnedImageSet", **kw: Any) -> dict[str, Any]:
    return {"name": "warm", "kind": kind, "desiredGeneration": desired,
            **({"currentGeneration": current} if current else {}), **kw}


PIS = {"apiVersion": "machineconfiguration.openshift.io/v1", "kind": "PinnedImageSet",
       "metadata": {"name": "warm", "generation": 3, "uid": "u-1"}, "spec": {"pinnedImages": [{"name": "r/a:1"}]}}
WORKER = {"matchLabels": {"node-role.kubernetes.io/worker": ""}}
INFRA = {"matchExpressions": [{"key": "role", "operator": "In", "values": ["infra"]}]}
POOLS = [pool("worker", WORKER, "warm", "other"), pool("infra", INFRA, "warm"), pool("master", {}, "other"),
         pool("bare", None, "warm")]
NODES = {n["metadata"]["name"]: n for n in [
    node("w1", **{"node-role.kubernetes.io/worker": ""}), node("w2", **{"node-role.kubernetes.io/worker": ""}),
    node("i1", role="infra"), node("i2", role="infra"), node("m1", role="master"), node("x1")]}


def compute(statuses: list[dict[str, Any]], ps: list[dict[str, Any]] = POOLS, now: float = T0 + 10) -> truth.Truth:
    return truth.compute(PIS, NODES, {s["metadata"]["name"]: s for s in statuses}, now=now, changed_at=T0,
                         stale_after=120, selection=pools.selection(pools.listing("warm", ps)))


def test_the_nodes_of_every_pool_listing_the_set_and_no_other() -> None:
    listing = pools.listing("warm", POOLS)
    assert [p["metadata"]["name"] for p in listing] == ["bare", "infra", "worker"]
    sel = pools.selection(listing)
    # a pool without a nodeSelector selects no node (MCO); "master" selects every node but does not list it
    assert sorted(n for n, o in NODES.items() if sel.selects(truth.node_labels(o))) == ["i1", "i2", "w1", "w2"]
    assert not pools.selection([]).selects({"any": "x"})  # listed by no pool: no node
    assert pools.sets_selecting(POOLS, {"role": "infra"}) == {"warm", "other"}  # "master" ({}) selects every node
    assert pools.sets_selecting(POOLS[:2], {"role": "db"}) == set()


def test_counts_from_rows_of_kind_pinned_image_set() -> None:
    t = compute([nis("w1", row("3", "3")),
                 nis("w2", row("3", "2", failedReasons={"notFound": 1}, error="r/a:1: NOT_FOUND")),
                 nis("i1", row("3", "3", kind="ImageSet")),  # an ImageSet of that name: not this set's row
                 nis("m1", row("3", "3"))])  # not selected
    assert (t.selected, t.current, t.progressing, t.failing, t.stale, t.missing) == (4, 1, 1, 1, 0, 1)
    assert t.missing_nodes == ["i2"] and t.failed_reasons == {"notFound": 1}
    assert t.next_due == T0 + 120  # i1 has no row for the set: stale once its shim stays silent
    assert compute([nis("i1", row("3", "3", kind="ImageSet"))], now=T0 + 121).stale_nodes == ["i1"]


def test_an_aggregated_node_without_a_row_is_behind_not_current() -> None:
    """An ImageSets digest never implies a PinnedImageSet current (nor does a shim writing no
    PinnedImageSets digest, as shims before it did)."""
    agg = {"omitted": {"sets": 150, "current": 150, "imageSets": "sha256:x"}}
    t = truth.compute(PIS, {"w1": NODES["w1"]}, {"w1": nis("w1", **agg)}, now=T0 + 10, changed_at=T0,
                      stale_after=120, selection=pools.selection(pools.listing("warm", POOLS)),
                      expected=lambda n: "sha256:x")
    assert (t.current, t.progressing) == (0, 1)
    worst = nis("w1", worst=[row("3", "2", failedReasons={"auth": 1})], **agg)  # its worst entry is read
    t = compute([worst])
    assert (t.failing, t.failed_reasons) == (1, {"auth": 1})


def test_an_aggregated_node_is_current_at_a_pinned_set_when_its_digest_matches_the_pools() -> None:
    """A node with more sets than rows writes a digest of its PinnedImageSets (name, generation):
    the controller calls a set without a row current there only when that digest equals the one
    it computes from the sets the node's pools list, at their generations."""
    sets = {"warm": PIS, "other": {"kind": "PinnedImageSet", "metadata": {"name": "other", "generation": 1}}}
    rows = [{"name": n, "kind": "PinnedImageSet", "source": "cluster", "desiredGeneration": g, "currentGeneration": g}
            for n, g in (("warm", "3"), ("other", "1"))]
    rows += [{"name": f"is{i}", "kind": "ImageSet", "source": "cluster", "desiredGeneration": "1",
              "currentGeneration": "1"} for i in range(3)]
    kept, agg = aggregate.bound(rows, 2)  # the two PinnedImageSets sort after is0, is1: no row
    assert {r["name"] for r in kept} == {"is0", "is1"} and agg["omitted"]["sets"] == 3
    status = nis("w1", *kept, **agg)

    def current(ps: list[dict[str, Any]], s: dict[str, Any]) -> int:
        expected = partial(lambda node, sets: pools.expected_digest(sets, ps, truth.node_labels(NODES[node])),
                           sets={**sets, "warm": s})
        return truth.compute(s, {"w1": NODES["w1"]}, {"w1": status}, now=T0 + 10, changed_at=T0, stale_after=120,
                             selection=pools.selection(pools.listing("warm", ps)), expected=expected).current
    assert current(POOLS, PIS) == 1  # worker lists warm and other; the node has both at their generations
    assert current(POOLS, {**PIS, "metadata": {**PIS["metadata"], "generation": 4}}) == 0  # not seen yet
    assert current([pool("worker", WORKER, "warm")], PIS) == 0  # the node has one the controller does not expect


def test_a_pool_selector_that_cannot_be_read_is_named() -> None:
    bad = [pool("odd", {"matchExpressions": [{"key": "k", "operator": "Near"}]}, "warm"), *POOLS]
    t = compute([nis("w1", row("3", "3"))], ps=bad)
    assert t.selected == 0 and "MachineConfigPool odd.spec.nodeSelector" in t.selector_error
    st = report.status_of(PIS, t, started=T0, now=T0)
    assert {c["type"]: c["reason"] for c in st["conditions"]}["Degraded"] == "InvalidSelector"


def test_pool_events_that_change_nothing_selected_are_ignored() -> None:
    w = pool("worker", WORKER, "warm")
    assert not pools.spec_changed(w, {**w, "status": {"machineCount": 4}})
    assert pools.spec_changed(w, pool("worker", WORKER, "warm", "new"))
    assert pools.spec_changed(w, pool("worker", INFRA, "warm")) and pools.spec_changed(None, w)


def test_the_report_object_and_fleet_status() -> None:
    t = compute([nis(n, row("3", "3")) for n in ("w1", "w2", "i1", "i2")])
    st = report.status_of(PIS, t, started=T0, now=T0 + 10)
    body = report.pinned_report_body(PIS, st, ["infra", "worker"])
    assert body["apiVersion"] == "cri-shim.io/v1" and body["kind"] == "PinnedImageSetReport"
    assert body["metadata"] == {"name": "warm", "ownerReferences": [
        {"apiVersion": "machineconfiguration.openshift.io/v1", "kind": "PinnedImageSet", "name": "warm", "uid": "u-1"}]}
    got = body["status"]
    assert (got["selected"], got["current"], got["observedGeneration"], got["rolloutSeconds"]) == (4, 4, 3, 10)
    assert got["machineConfigPools"] == ["infra", "worker"] and "rollout" not in got and "waiting" not in got
    assert {c["type"]: c["status"] for c in got["conditions"]} == {"Available": "True", "Progressing": "False",
                                                                    "Degraded": "False", "DiskPressure": "False"}
    out = summarize([{"metadata": {"name": "warm", "generation": 1}, "status": {"observedGeneration": 1}}],
                    [{"metadata": {"name": "warm", "generation": 7}, "status": got}])
    assert list(out) == ["warm", "PinnedImageSet/warm"]  # an ImageSet of the same name stays apart
    pis = out["PinnedImageSet/warm"]
    assert (pis["generation"], pis["selected"], pis["current"]) == (3, 4, 4) and "note" not in pis
    assert pis["machineConfigPools"] == ["infra", "worker"]
