"""Paced rollouts (spec.rollout) against a real kube-apiserver: `cri-shim controller` processes
grant nodes the generation in the set's status; simulated shims (tests/support/sim_fleet.py,
deciding with the shim's own rule) fetch the images from the registry, each through its own
counting proxy, so what every node fetches, and when, is counted at the registry side. In the
concurrency test one node is a real shim in front of containerd (its fetches are the session
proxy's records)."""

from __future__ import annotations

import json
import time
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from tests.cluster.test_cluster_sets import SHIM, delete, pinned, set_row, shim_config, wait_for
from tests.cluster.test_controller import LEASE, ROUND_TRIPS, _holder, cleanup, conds, counts, set_status, table
from tests.support.controller import STALE_AFTER
from tests.support.kube import Admin
from tests.support.procs import kill
from tests.support.sim_fleet import SimFleet, merge

PULL_BYTES = 384 << 10  # per image; each proxy sends blobs at THROTTLE: about a second per node
THROTTLE = 384 << 10


def paced_set(name: str, refs: list[str], label: str, **rollout: Any) -> dict[str, Any]:
    return {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": {label: "x"}}, "pin": True,
                     "images": [{"name": r} for r in refs], "rollout": rollout}}


def rollout_status(admin: Admin, name: str) -> dict[str, Any]:
    return set_status(admin, name).get("rollout") or {}


def max_overlap(spans: dict[str, list[tuple[float, float]]]) -> tuple[int, float]:
    """The most nodes fetching at one instant, and that instant."""
    events = sorted([(s, 1) for v in spans.values() for s, _ in v] + [(e, -1) for v in spans.values() for _, e in v],
                    key=lambda ev: (ev[0], ev[1]))  # an end before a start at the same instant
    most, at, now = 0, 0.0, 0
    for t, d in events:
        now += d
        if now > most:
            most, at = now, t
    return most, at


def test_canary_with_a_missing_image_halts_and_no_other_node_pulls(control_plane, admin, controllers, registry,
                                                                   make_image) -> None:
    nodes = [f"r1-n{i}" for i in range(1, 6)]
    for n in nodes:
        admin.create_node(n, {"r1-pool": "x"})
    present = make_image()
    missing = f"{registry.host}/r1/not-pushed-yet:v1"
    admin.apply_custom(*SHIM, "imagesets", paced_set("r1-web", [present.ref, missing], "r1-pool",
                                                     maxConcurrentNodes=2, canary={"count": 1}))
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "r1-web", nodes,
                     retry_seconds=0.5).start()
    try:
        wait_for(lambda: all(admin.get_custom(*SHIM, "nodeimagesetstatuses", n) for n in nodes), 30,
                 "every node reports (waiting)")
        controllers("r1-a")
        wait_for(lambda: conds(admin, "r1-web").get("Halted") == "True/NotFound", 30, "Halted, reason NotFound")
        ro = rollout_status(admin, "r1-web")
        assert ro["phase"] == "Halted" and ro["canaryNodes"] == ["r1-n1"] and ro["haltReason"] == "notFound"
        halted = next(c for c in set_status(admin, "r1-web")["conditions"] if c["type"] == "Halted")
        assert "r1-n1" in halted["message"] and "resume" in halted["message"]
        time.sleep(3)  # a few more controller batches: still nobody else
        st = set_status(admin, "r1-web")
        assert (st["selected"], st["failing"], st["waiting"], st["current"]) == (5, 1, 4, 0), st
        assert fleet.requests("r1-n1") >= 2  # the canary fetched (and retries the missing image)
        assert {n: fleet.requests(n) for n in nodes[1:]} == {n: 0 for n in nodes[1:]}  # no other node fetched
        row = next(r["cells"] for r in table(control_plane)["rows"] if r["cells"][0] == "r1-web")
        print(f"\nkubectl get imagesets (halted): {row}")
        assert row[1:8] == [5, 0, 0, 4, 1, 0, "Halted"], row

        # the image is pushed: the canary turns current, the halt stays until an operator resumes
        make_image(name="r1/not-pushed-yet", tag="v1")
        wait_for(lambda: counts(admin, "r1-web")[1] == 1, 30, "the canary current")
        time.sleep(2)
        assert rollout_status(admin, "r1-web")["phase"] == "Halted" and fleet.requests("r1-n2") == 0
        admin.custom("patch", *SHIM, "imagesets", "r1-web", {"metadata": {"annotations": {
            "cri-shim.io/resume-rollout": "after-push"}}}, _content_type="application/merge-patch+json")
        wait_for(lambda: conds(admin, "r1-web").get("Available") == "True/AllNodesCurrent", 60, "every node current")
        ro = rollout_status(admin, "r1-web")
        assert ro["phase"] == "Complete" and ro["resumedWith"] == "after-push" and ro["granted"] == []
        assert conds(admin, "r1-web")["Halted"] == "False/NotHalted"
        most, _ = max_overlap({n: s for n, s in fleet.intervals().items() if n != "r1-n1"})
        assert most <= 2, most
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        cleanup(admin, "r1-web", nodes)


def test_max_concurrent_nodes_2_over_10_nodes(control_plane, admin, controllers, registry, proxy, make_image,
                                              shim_factory, tmp_path) -> None:
    """9 simulated nodes and node-a, a real shim in front of containerd (pulling through the session proxy)."""
    sims = [f"r2-n{i:02}" for i in range(1, 10)]
    for n in sims:
        admin.create_node(n, {"r2-pool": "x"})
    admin.set_node_labels("node-a", {"r2-pool": "x"})
    images = [make_image(filler_bytes=PULL_BYTES) for _ in range(2)]
    proxy.set_throttle(THROTTLE)
    shim = shim_factory(shim_config(control_plane, tmp_path, "node-a"), log_level="info")
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "r2-web", sims,
                     throttle_bps=THROTTLE).start()
    try:
        admin.apply_custom(*SHIM, "imagesets", paced_set("r2-web", [i.ref for i in images], "r2-pool",
                                                         maxConcurrentNodes=2))
        wait_for(lambda: all(admin.get_custom(*SHIM, "nodeimagesetstatuses", n) for n in [*sims, "node-a"]), 30,
                 "every node reports")
        time.sleep(2)  # nobody fetches before the controller runs: no grant
        assert proxy.stats().manifest_requests == 0 and all(fleet.requests(n) == 0 for n in sims)
        st = set_status(admin, "r2-web")
        assert st.get("rollout") is None  # no controller yet
        started = time.monotonic()
        controllers("r2-a")
        samples: list[tuple[int, int, int]] = []

        def done() -> bool:
            c = counts(admin, "r2-web")
            ro = rollout_status(admin, "r2-web")
            samples.append((c[1], c[2], len(ro.get("granted", []))))
            return c[:2] == (10, 10)
        wait_for(done, 120, "10 of 10 current", interval=0.2)
        took = time.monotonic() - started
        spans = fleet.intervals()
        spans["node-a"] = merge([(r.start, r.end) for r in proxy.records()])
        assert all(spans[n] for n in spans), spans  # every node fetched, counted at the registry side
        most, at = max_overlap(spans)
        print(f"\n10 nodes, maxConcurrentNodes 2: all current after {took:.1f} s; at most {most} nodes fetching "
              f"at once (registry side); progressing/granted samples: {sorted(set(s[1:] for s in samples))}")
        assert most <= 2, (most, at, spans)
        assert most == 2  # and it does use both slots
        ro = rollout_status(admin, "r2-web")
        assert ro["phase"] == "Complete" and ro["maxConcurrentNodes"] == 2 and ro["inFlight"] == 0
        assert max(s[1] for s in samples) <= 2  # never more than 2 progressing in the set's status either
        assert all(pinned(shim).get(i.image_id) for i in images)  # the real node: pulled once granted, pinned
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        admin.set_node_labels("node-a", {"r2-pool": None})
        cleanup(admin, "r2-web", sims)


def test_leader_killed_mid_rollout_goes_on_within_the_lease(control_plane, admin, controllers, registry,
                                                            make_image) -> None:
    nodes = [f"r3-n{i}" for i in range(1, 7)]
    for n in nodes:
        admin.create_node(n, {"r3-pool": "x"})
    image = make_image(filler_bytes=PULL_BYTES * 2)
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "r3-web", nodes,
                     throttle_bps=THROTTLE).start()
    try:
        admin.apply_custom(*SHIM, "imagesets", paced_set("r3-web", [image.ref], "r3-pool", maxConcurrentNodes=1))
        a, b = controllers("r3-a"), controllers("r3-b")
        wait_for(lambda: counts(admin, "r3-web")[1] >= 2, 60, "2 nodes current")
        leader, standby = (a, b) if _holder(admin) == "r3-a" else (b, a)
        kill(leader.proc)  # SIGKILL: no release, the standby waits out the lease
        killed = time.monotonic()
        old_grants = set(rollout_status(admin, "r3-web")["granted"])  # the killed leader's last word

        def next_grant() -> float | None:  # a node starting that the killed leader had not granted
            return next((t for n in nodes if n not in old_grants for _, t in fleet.nodes[n].started if t > killed),
                        None)
        # the node in flight at the kill finishes on its own; the next grant needs the new leader
        granted_at = wait_for(next_grant, 40, "a grant after the kill", interval=0.05)
        took = granted_at - killed
        print(f"\nleader killed mid-rollout; next grant after {took:.2f} s (lease {LEASE:.0f} s)")
        # the standby takes the Lease within the lease duration of the kill, its first batch grants at once
        # (test_controller.py: ROUND_TRIPS); the simulated node reads its grant within its tick
        assert took <= LEASE + ROUND_TRIPS + fleet.tick, took
        assert "became leader" in standby.log_text()
        wait_for(lambda: counts(admin, "r3-web")[:2] == (6, 6), 90, "6 of 6 current")
        most, at = max_overlap(fleet.intervals())
        assert most == 1, (most, at)  # one at a time, across the takeover too
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        cleanup(admin, "r3-web", nodes)


def test_a_granted_node_gone_silent_frees_its_slot_and_the_rollout_finishes(control_plane, admin, controllers,
                                                                           registry, make_image) -> None:
    nodes = [f"r5-n{i}" for i in range(1, 5)]
    for n in nodes:
        admin.create_node(n, {"r5-pool": "x"})
    image = make_image()
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "r5-web", nodes).start()
    try:
        admin.apply_custom(*SHIM, "imagesets", paced_set("r5-web", [image.ref], "r5-pool", maxConcurrentNodes=1))
        wait_for(lambda: all(admin.get_custom(*SHIM, "nodeimagesetstatuses", n) for n in nodes), 30,
                 "every node reports (waiting)")
        fleet.silence("r5-n1")  # its shim stops before its grant (the first, by name)
        controllers("r5-a")
        wait_for(lambda: counts(admin, "r5-web") == (4, 3, 0, 0, 1, 0), STALE_AFTER + 60,
                 "3 current, the silent granted node stale")
        st, ro = set_status(admin, "r5-web"), rollout_status(admin, "r5-web")
        print(f"\nsilent granted node: rollout {ro}, Progressing: "
              f"{next(c['message'] for c in st['conditions'] if c['type'] == 'Progressing')}")
        assert st["staleNodes"] == ["r5-n1"] and fleet.requests("r5-n1") == 0
        # it keeps its grant, holds no slot, and the status says so
        assert ro["granted"] == ["r5-n1"] and ro["staleGranted"] == ["r5-n1"] and ro["inFlight"] == 0, ro
        assert ro["phase"] == "Rolling"
        row = next(r["cells"] for r in table(control_plane)["rows"] if r["cells"][0] == "r5-web")
        assert row[1:8] == [4, 3, 0, 0, 0, 1, "Rolling"], row
        most, at = max_overlap(fleet.intervals())
        assert most == 1, (most, at)

        fleet.silence("r5-n1", False)  # its shim is back: it pulls with the grant it kept
        wait_for(lambda: conds(admin, "r5-web").get("Available") == "True/AllNodesCurrent", 30, "every node current")
        ro = rollout_status(admin, "r5-web")
        assert ro["phase"] == "Complete" and ro["granted"] == [] and "staleGranted" not in ro, ro
        assert fleet.requests("r5-n1") > 0
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        cleanup(admin, "r5-web", nodes)


def test_the_api_server_refuses_a_bad_rollout_with_a_readable_message(control_plane, admin) -> None:
    """The CRD's CEL rules on spec.rollout (dry run: nothing is stored)."""
    def apply(**rollout: Any) -> str:
        body = paced_set("r4-web", ["registry.example/app:v1"], "r4-pool", **rollout)
        try:
            admin.custom("patch", *SHIM, "imagesets", "r4-web", body, field_manager="test", force=True,
                         dry_run="All", _content_type="application/apply-patch+yaml")
        except ApiException as e:
            assert e.status == 422, e
            return str(json.loads(e.body)["message"])
        return ""
    for ok in ({"maxConcurrentNodes": 2}, {"maxConcurrentNodes": "10%"}, {"maxConcurrentNodes": "100%"},
               {"maxConcurrentNodes": 1, "canary": {"count": 1}, "failureThreshold": 3},
               {"maxConcurrentNodes": 1, "canary": {"nodeSelector": {"matchLabels": {"canary": "yes"}}}}):
        assert apply(**ok) == "", ok
    for bad, says in (({"maxConcurrentNodes": 0}, "a count >= 1 or a percentage"),
                      ({"maxConcurrentNodes": "0%"}, "a count >= 1 or a percentage"),
                      ({"maxConcurrentNodes": "150%"}, "a count >= 1 or a percentage"),
                      ({"maxConcurrentNodes": "ten"}, "a count >= 1 or a percentage"),
                      ({"failureThreshold": 1}, "maxConcurrentNodes: Required value"),
                      ({"maxConcurrentNodes": 1, "canary": {}}, "exactly one of count or nodeSelector"),
                      ({"maxConcurrentNodes": 1, "canary": {"count": 1, "nodeSelector": {}}},
                       "exactly one of count or nodeSelector"),
                      ({"maxConcurrentNodes": 1, "failureThreshold": 0}, "failureThreshold")):
        message = apply(**bad)
        assert says in message, (bad, message)
    print(f"\n422 from the API server: {message}")


def halted_message(admin: Admin, name: str) -> str:
    return next((c["message"] for c in set_status(admin, name).get("conditions", []) if c["type"] == "Halted"), "")


def test_failure_threshold_above_max_concurrent_nodes_halts(control_plane, admin, controllers, registry) -> None:
    """Issue 45: failureThreshold 3, maxConcurrentNodes 2, the image missing everywhere. A failing
    node frees its slot once its failure is counted: the third failure is reached and halts; the
    nodes never granted never fetch."""
    nodes = [f"r6-n{i}" for i in range(1, 7)]
    for n in nodes:
        admin.create_node(n, {"r6-pool": "x"})
    missing = f"{registry.host}/r6/never-pushed:v1"
    admin.apply_custom(*SHIM, "imagesets", paced_set("r6-web", [missing], "r6-pool", maxConcurrentNodes=2,
                                                     failureThreshold=3))
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "r6-web", nodes,
                     retry_seconds=0.5).start()
    try:
        wait_for(lambda: all(admin.get_custom(*SHIM, "nodeimagesetstatuses", n) for n in nodes), 30,
                 "every node reports (waiting)")
        started = time.monotonic()
        controllers("r6-a")
        wait_for(lambda: conds(admin, "r6-web").get("Halted") == "True/NotFound", 40, "Halted, reason NotFound")
        took = time.monotonic() - started
        time.sleep(2)  # a few more batches: nobody new
        st, ro = set_status(admin, "r6-web"), rollout_status(admin, "r6-web")
        row = next(r["cells"] for r in table(control_plane)["rows"] if r["cells"][0] == "r6-web")
        print(f"\nfailureThreshold 3 > maxConcurrentNodes 2: halted {took:.1f} s after the controller started; "
              f"kubectl get imagesets: {row}")
        assert ro["phase"] == "Halted" and ro["haltReason"] == "notFound" and st["failing"] >= 3, (st, ro)
        assert "reached failureThreshold" in halted_message(admin, "r6-web")
        fetched = [n for n in nodes if fleet.requests(n)]
        assert 3 <= len(fetched) <= 4 and st["waiting"] == 6 - len(fetched), (fetched, st)
        assert row[7] == "Halted", row
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        cleanup(admin, "r6-web", nodes)


def test_a_canary_selector_matching_no_node_is_a_halt_with_its_reason(control_plane, admin, controllers,
                                                                    registry, make_image) -> None:
    nodes = [f"r7-n{i}" for i in range(1, 4)]
    for n in nodes:
        admin.create_node(n, {"r7-pool": "x"})
    image = make_image()
    admin.apply_custom(*SHIM, "imagesets", paced_set("r7-web", [image.ref], "r7-pool", maxConcurrentNodes=3,
                                                     canary={"nodeSelector": {"matchLabels": {"r7-canary": "yes"}}}))
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "r7-web", nodes).start()
    try:
        wait_for(lambda: all(admin.get_custom(*SHIM, "nodeimagesetstatuses", n) for n in nodes), 30,
                 "every node reports (waiting)")
        controllers("r7-a")
        wait_for(lambda: conds(admin, "r7-web").get("Halted") == "True/CanaryMatchesNoNode", 30,
                 "Halted, reason CanaryMatchesNoNode")
        message = halted_message(admin, "r7-web")
        print(f"\ncanary matching no node: Halted: {message}")
        assert "spec.rollout.canary.nodeSelector matches none of the 3 selected node(s)" in message
        time.sleep(2)
        ro = rollout_status(admin, "r7-web")
        assert ro["phase"] == "Halted" and ro["granted"] == [] and ro["haltReason"] == "canaryMatchesNoNode", ro
        assert {n: fleet.requests(n) for n in nodes} == {n: 0 for n in nodes}  # the canary is not dropped

        admin.set_node_labels("r7-n2", {"r7-canary": "yes"})  # a canary now: it goes first, alone
        wait_for(lambda: conds(admin, "r7-web").get("Available") == "True/AllNodesCurrent", 60, "every node current")
        first = {n: fleet.nodes[n].started[0][1] for n in nodes}
        assert first["r7-n2"] < min(first["r7-n1"], first["r7-n3"]), first
        assert conds(admin, "r7-web")["Halted"] == "False/NotHalted"
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        cleanup(admin, "r7-web", nodes)


def test_a_resume_grants_again_or_says_why_not(control_plane, admin, controllers, registry, make_image) -> None:
    """maxConcurrentNodes 1, the failing node in the only slot: a resume grants the next node. A
    failing canary: a resume says why it does not pass it, and once the canary is current the
    rollout goes on."""
    nodes = [f"r8-n{i}" for i in range(1, 4)]
    for n in nodes:
        admin.create_node(n, {"r8-pool": "x"})
    missing = f"{registry.host}/r8/not-pushed-yet:v1"
    admin.apply_custom(*SHIM, "imagesets", paced_set("r8-web", [missing], "r8-pool", maxConcurrentNodes=1))
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "r8-web", nodes,
                     retry_seconds=0.5).start()

    def resume(value: str) -> None:
        admin.custom("patch", *SHIM, "imagesets", "r8-web", {"metadata": {"annotations": {
            "cri-shim.io/resume-rollout": value}}}, _content_type="application/merge-patch+json")
    try:
        wait_for(lambda: all(admin.get_custom(*SHIM, "nodeimagesetstatuses", n) for n in nodes), 30,
                 "every node reports (waiting)")
        controllers("r8-a")
        wait_for(lambda: conds(admin, "r8-web").get("Halted") == "True/NotFound", 30, "Halted, reason NotFound")
        assert [n for n in nodes if fleet.requests(n)] == ["r8-n1"]
        resume("one")
        wait_for(lambda: fleet.requests("r8-n2"), 20, "the next node granted after the resume")
        wait_for(lambda: rollout_status(admin, "r8-web").get("halted"), 20, "halted again: one more failure")
        ro = rollout_status(admin, "r8-web")
        assert ro["resumedWith"] == "one" and ro["toleratedFailures"] == 1 and fleet.requests("r8-n3") == 0, ro

        # a canary: edit the set (a new generation, a new rollout) to pick one, still failing
        body = paced_set("r8-web", [missing], "r8-pool", maxConcurrentNodes=1, canary={"count": 1})
        admin.apply_custom(*SHIM, "imagesets", body)
        def halted_at_2() -> bool:  # one read of the status: its condition and its rollout together
            st = set_status(admin, "r8-web")
            ro = st.get("rollout") or {}
            return ro.get("generation") == 2 and ro.get("halted") is True and ro.get("haltReason") == "notFound"
        wait_for(halted_at_2, 30, "generation 2 halted: its canary failing")
        canary = rollout_status(admin, "r8-web")["canaryNodes"]
        resume("early")
        wait_for(lambda: conds(admin, "r8-web").get("Halted") == "True/CanaryFailing", 20,
                 "the resume says why it does not pass the canary")
        message = halted_message(admin, "r8-web")
        print(f"\nresume while the canary fails: Halted: {message}")
        assert f"canary node(s) failing: {canary[0]}" in message and "a resume does not pass" in message
        time.sleep(2)
        started = {n: [g for g, _ in fleet.nodes[n].started if g == 2] for n in nodes if n not in canary}
        assert started == {n: [] for n in started}, started  # nobody else started generation 2
        make_image(name="r8/not-pushed-yet", tag="v1")  # fixed: the canary turns current, the rollout goes on
        wait_for(lambda: conds(admin, "r8-web").get("Available") == "True/AllNodesCurrent", 60, "every node current")
        assert rollout_status(admin, "r8-web")["phase"] == "Complete"
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        cleanup(admin, "r8-web", nodes)


def test_an_edit_mid_rollout_never_lets_more_than_max_concurrent_nodes_fetch(control_plane, admin, controllers,
                                                                          registry, make_image) -> None:
    """Issue 45: maxConcurrentNodes 2, an edit while two nodes pull generation 1 (two before them by
    name are current): those two still fetch and hold the slots (they are granted generation 2
    first); counted at the registry, never more than 2 nodes fetch at once, across the edit."""
    nodes = [f"r9-n{i}" for i in range(1, 7)]
    for n in nodes:
        admin.create_node(n, {"r9-pool": "x"})
    first, second = make_image(filler_bytes=PULL_BYTES * 3), make_image(filler_bytes=PULL_BYTES)
    admin.apply_custom(*SHIM, "imagesets", paced_set("r9-web", [first.ref], "r9-pool", maxConcurrentNodes=2))
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "r9-web", nodes,
                     throttle_bps=THROTTLE).start()
    try:
        wait_for(lambda: all(admin.get_custom(*SHIM, "nodeimagesetstatuses", n) for n in nodes), 30,
                 "every node reports (waiting)")
        controllers("r9-a")
        # the first two current, the next two pulling generation 1 (they come after them by name)
        wait_for(lambda: sum(1 for n in nodes if fleet.nodes[n].started) == 4, 60, "two more nodes pulling")
        time.sleep(0.5)
        admin.apply_custom(*SHIM, "imagesets", paced_set("r9-web", [first.ref, second.ref], "r9-pool",
                                                         maxConcurrentNodes=2))
        wait_for(lambda: counts(admin, "r9-web")[:2] == (6, 6) and set_status(admin, "r9-web")["observedGeneration"]
                 == 2, 120, "6 of 6 current at generation 2", interval=0.2)
        most, at = max_overlap(fleet.intervals())
        print(f"\nedit mid-rollout, maxConcurrentNodes 2: at most {most} nodes fetching at once (registry side)")
        assert most <= 2, (most, at, fleet.intervals())
        assert all(fleet.requests(n) for n in nodes)
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        cleanup(admin, "r9-web", nodes)


def test_a_set_created_again_is_paced_and_counted_as_new(control_plane, admin, controllers, make_image, shim_factory,
                                                         tmp_path) -> None:
    """Issue 45: a paced set deleted and created again (generation 1 again) while node-a's shim is
    stopped: the controller does not count node-a's old row (1/1) as current on the new object;
    the restarted shim applies the new object only with a grant (its new image not pulled before),
    its row waiting for it; granted, it pulls and is current."""
    first, added = make_image(), make_image()
    admin.set_node_labels("node-a", {"r10-pool": "x"})
    cfg = shim_config(control_plane, tmp_path, "node-a")
    try:
        admin.apply_custom(*SHIM, "imagesets", paced_set("r10-web", [first.ref], "r10-pool", maxConcurrentNodes=1))
        shim = shim_factory(cfg, log_level="info")
        ctl = controllers("r10-a")
        wait_for(lambda: conds(admin, "r10-web").get("Available") == "True/AllNodesCurrent", 60, "node-a current")
        old_uid = admin.get_custom(*SHIM, "imagesets", "r10-web")["metadata"]["uid"]
        assert set_row(admin, "node-a", "r10-web")["uid"] == old_uid

        def created_again() -> dict[str, Any]:
            delete(admin, *SHIM, "imagesets", "r10-web")
            wait_for(lambda: admin.get_custom(*SHIM, "imagesets", "r10-web") is None, 30, "the set deleted")
            admin.apply_custom(*SHIM, "imagesets", paced_set("r10-web", [first.ref, added.ref], "r10-pool",
                                                             maxConcurrentNodes=1))
            obj = admin.get_custom(*SHIM, "imagesets", "r10-web")
            assert obj["metadata"]["generation"] == 1 and obj["metadata"]["uid"] != old_uid
            return obj

        shim.stop()
        new = created_again()
        # the stopped node's old row (1/1, the old uid) is not current on the new object
        wait_for(lambda: (set_status(admin, "r10-web").get("rollout") or {}).get("uid") == new["metadata"]["uid"],
                 30, "the new object's status")
        time.sleep(2)
        st = set_status(admin, "r10-web")
        assert st["current"] == 0 and conds(admin, "r10-web")["Available"] == "False/NodesNotCurrent", st
        ctl.stop()  # and once more, with no controller to grant it while the shim comes back
        new = created_again()

        shim2 = shim_factory(cfg, log_level="info")
        row = wait_for(lambda: (r := set_row(admin, "node-a", "r10-web")) and r.get("uid") == new["metadata"]["uid"]
                       and r, 30, "node-a's row for the new object")
        print(f"\nnode-a's row for the set created again, before its grant: {row}")
        assert (row["reason"], row["desiredGeneration"], row["currentUid"]) == ("AwaitingGrant", "1", old_uid), row
        time.sleep(2)
        assert added.image_id not in pinned(shim2)  # not pulled without a grant
        assert pinned(shim2).get(first.image_id) is True  # the version in force stays pinned

        controllers("r10-b")
        wait_for(lambda: conds(admin, "r10-web").get("Available") == "True/AllNodesCurrent", 60,
                 "node-a current on the new object once granted")
        assert pinned(shim2).get(added.image_id) is True
        row = set_row(admin, "node-a", "r10-web")
        assert row["uid"] == new["metadata"]["uid"] and "currentUid" not in row, row
    finally:
        delete(admin, *SHIM, "imagesets", "r10-web")
        admin.set_node_labels("node-a", {"r10-pool": None})
