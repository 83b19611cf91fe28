"""NodeImageSetStatus stays bounded whatever the number of sets (shim/cluster/aggregate.py), the
controller reads the aggregate (shim/controller/truth.py), and Events are bounded per node as
kubelet's recorder bounds them (shim/cluster/events.py)."""

from __future__ import annotations

import json
from typing import Any

from shim import config
from shim.cluster import aggregate
from shim.cluster.events import COMBINED, EventRecorder
from shim.controller import truth

T0 = 1_800_000_000.0


def row(name: str, gen: str = "1", current: str | None = "1", **kw: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"name": name, "kind": "ImageSet", "source": "cluster", "desiredGeneration": gen,
                         "images": {"declared": 3, "present": 3, "pulling": 0, "queued": 0, "failed": 0}, **kw}
    if current is not None:
        r["currentGeneration"] = current
    return r


def many(n: int) -> list[dict[str, Any]]:
    rows = [row(f"set-{i:05d}") for i in range(n)]
    rows[1700] = row("set-01700", "2", "1")  # progressing
    rows[2100] = row("set-02100", failedReasons={"auth": 2}, error="registry.local/a:1: 401")
    rows[2200] = row("set-02200", "3", "1", reason="InvalidSet", error="images[0]: upper case")
    rows[2300] = row("set-02300", reason="PullSecretUnavailable", error="secret ns/x: forbidden")
    return rows


def test_rows_are_capped_problems_first_and_the_rest_counted() -> None:
    rows = many(2500)
    kept, agg = aggregate.bound(rows, 100)
    names = [r["name"] for r in kept]
    assert len(kept) == 100 and names == sorted(names)
    assert {"set-02200", "set-02100", "set-02300", "set-01700"} <= set(names)  # problems and progressing kept
    assert names[:3] == ["set-00000", "set-00001", "set-00002"]  # then current ones, by name
    assert agg["setStates"] == {"current": 2496, "progressing": 1, "failing": 1, "invalid": 1,
                                "pullSecretUnavailable": 1}
    assert agg["omitted"]["sets"] == 2400 and agg["omitted"]["current"] == 2400 and "worst" not in agg
    assert agg["omitted"]["imageSets"] == aggregate.digest((r["name"], r["desiredGeneration"]) for r in rows)
    again, agg2 = aggregate.bound(list(reversed(rows)), 100)
    assert again == kept and agg2 == agg  # stable: the same rows whatever the order sets come in


def test_problem_sets_beyond_the_cap_are_the_worst_list() -> None:
    rows = [row(f"bad-{i:03d}", failedReasons={"notFound": 1}, error="x" * 1024) for i in range(30)]
    rows += [row(f"inv-{i}", "2", "1", reason="InvalidSet", error="bad") for i in range(3)]
    rows += [row("ok")]
    kept, agg = aggregate.bound(rows, 5)
    assert [r["name"] for r in kept] == ["bad-000", "bad-001", "inv-0", "inv-1", "inv-2"]
    worst = agg["worst"]
    assert len(worst) == aggregate.WORST and worst[0]["name"] == "bad-002"
    assert worst[0]["failedReasons"] == {"notFound": 1} and len(worst[0]["error"]) == aggregate.WORST_ERROR
    assert "images" not in worst[0]
    assert agg["omitted"] == {"sets": 29, "current": 1, "imageSets": agg["omitted"]["imageSets"],
                              "pinnedImageSets": aggregate.digest([])}  # no PinnedImageSet on this node


def test_worst_case_object_stays_under_256_kib_at_the_largest_cap() -> None:
    """Rows of 253-character names with 1,024-character errors and every field set."""
    def big(i: int) -> dict[str, Any]:
        return row(f"{i:05d}".ljust(253, "n"), "123456789", "123456788", lastFailedGeneration="123456789",
                   reason="InvalidSet", error="e" * 1024, failedReasons={r: 99999 for r in
                                                                           ("auth", "notFound", "noSpace", "stalled",
                                                                            "other")},
                   bytesDone=10**12, bytesTotal=10**12)
    kept, agg = aggregate.bound([big(i) for i in range(5000)], config.MAX_STATUS_ROWS)
    status = {"nodeName": "n" * 253, "sets": kept, "summary": {k: 10**9 for k in range(7)}, **agg,
              "conditions": [{"type": "Ready", "status": "False", "reason": "x" * 20, "message": "m" * 2048,
                              "lastTransitionTime": "2026-01-01T00:00:00Z"}] * 3}
    size = len(json.dumps({"apiVersion": "cri-shim.io/v1", "kind": "NodeImageSetStatus",
                           "metadata": {"name": "n" * 253}, "status": status}))
    assert size < 256 * 1024, size
    assert config.from_dict({}).cluster.status_max_rows == 100


def test_status_max_rows_is_bounded() -> None:
    import pytest
    with pytest.raises(config.ConfigError, match="cluster.status_max_rows: must be <= 120"):
        config.from_dict({"cluster": {"status_max_rows": 121}})
    assert config.from_dict({"cluster": {"status_max_rows": 0}}).cluster.status_max_rows == 0


# ---------------------------------------------------------------- the controller reads the aggregate

def test_controller_counts_an_omitted_set_current_only_when_the_digest_matches() -> None:
    sets = {f"s{i}": {"metadata": {"name": f"s{i}", "generation": 1}, "spec": {}} for i in range(5)}
    node = {"metadata": {"name": "a", "labels": {}}}
    rows = [row(f"s{i}") for i in range(5)]
    kept, agg = aggregate.bound(rows, 2)
    status = {"metadata": {"name": "a", "managedFields": [{"manager": "cri-shim", "time": truth.format_time(T0)}]},
              "status": {"sets": kept, **agg}}

    def compute(name: str, expected: Any) -> truth.Truth:
        return truth.compute(sets[name], {"a": node}, {"a": status}, now=T0 + 10, changed_at=T0, stale_after=120,
                             expected=expected)
    assert "s4" not in {r["name"] for r in kept}
    assert compute("s4", lambda n: truth.expected_digest(sets, {})).current == 1
    assert compute("s4", None).progressing == 1  # nothing to compare with: behind, not current
    sets["s4"]["metadata"]["generation"] = 2  # the node has not seen generation 2 yet
    assert compute("s4", lambda n: truth.expected_digest(sets, {})).progressing == 1


def test_controller_reads_a_worst_entry_as_a_failing_row() -> None:
    sets = {"bad": {"metadata": {"name": "bad", "generation": 1}, "spec": {}}}
    rows = [row(f"a{i}", current=None, failedReasons={"auth": 1}, error="401") for i in range(3)]
    rows.append(row("bad", current=None, failedReasons={"notFound": 1}, error="404"))
    kept, agg = aggregate.bound(rows, 1)
    status = {"metadata": {"name": "a"}, "status": {"sets": kept, **agg}}
    t = truth.compute(sets["bad"], {"a": {"metadata": {"name": "a"}}}, {"a": status}, now=T0, changed_at=T0,
                      stale_after=120, expected=lambda n: "")
    assert (t.failing, t.failed_reasons) == (1, {"notFound": 1}) and t.failing_nodes[0]["error"] == "404"


# ---------------------------------------------------------------- Events, as client-go's correlator

class Core:
    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []
        self.patched: list[tuple[str, dict[str, Any]]] = []

    async def create_namespaced_event(self, namespace: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.created.append(body)
        return {"metadata": {"name": f"n1.{len(self.created)}"}}

    async def patch_namespaced_event(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> None:
        self.patched.append((name, body))


async def test_events_per_node_are_a_token_bucket_series_and_aggregate() -> None:
    clock = [0.0]
    rec = EventRecorder("n1", "default", burst=25, interval=300, request_timeout=5, clock=lambda: clock[0])
    core = Core()
    for i in range(2500):  # 2,500 sets failing at once
        await rec.record(core, "Warning", "ImageSetNotFound", f"image set s{i}: 1 image(s) failed")  # type: ignore[arg-type]
    assert len(core.created) == 11 and rec.dropped == 2475
    assert sum(1 for e in core.created if e["message"].startswith(COMBINED)) == 1  # past 10 similar ones
    assert len(core.patched) == 14 and core.patched[-1][1]["message"] == COMBINED + "image set s24: 1 image(s) failed"
    core.patched.clear()
    assert core.created[0]["count"] == 1 and core.created[0]["involvedObject"]["kind"] == "NodeImageSetStatus"
    clock[0] = 300  # one token more: the combined Event is counted again, not created again
    await rec.record(core, "Warning", "ImageSetNotFound", "image set s9999: 1 image(s) failed")  # type: ignore[arg-type]
    assert len(core.created) == 11 and len(core.patched) == 1 and core.patched[0][1]["count"] == 16
    await rec.record(core, "Warning", "ImageSetNotFound", "again")  # type: ignore[arg-type]
    assert rec.dropped == 2476
    clock[0] = 300 + 601 + 300 * 30  # a quiet hour refills the burst, the similar window is over
    await rec.record(core, "Warning", "ImageSetNotFound", "image set s1: 1 image(s) failed")  # type: ignore[arg-type]
    assert len(core.patched) == 2  # equal to the first one sent: its count, not a new Event
    assert rec.status() == {"created": 11, "count_updates": 16, "dropped": 2476, "errors": 0}
