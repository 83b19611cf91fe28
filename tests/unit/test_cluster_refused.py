"""A set whose newest version cannot be applied keeps its last valid version, for every source
(ImageSet, PinnedImageSet through its pool, files), across a restart (the state file), and is
reported: status row, Degraded InvalidSet, a rate-limited Event, a metric, `cri-shim status`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shim import config
from shim.cluster import objects
from shim.cluster.source import ClusterSource
from shim.cluster.node_report import NodeReport
from shim.observability.metrics import Metrics
from shim.process.status_render import render
from tests.unit.test_cluster_source import FakeSets, fake_informer, node, own, pis, pool
from tests.unit.test_imagesets import image_sets, reconciled, store, write  # noqa: F401  (store: a fixture)
from tests.unit.test_imagesets import own as own_file

UPPER = "host:5000/Team/App:v1"
LONG = "registry.local/" + "a" * 280 + ":v1"
GOOD = ["reg/a:1", "reg/b:1", "reg/c:1"]


def informer(items: list[dict[str, Any]] | None) -> Any:
    inf = fake_informer(items)
    inf.lists, inf.watches, inf.error = 1, 1, ""
    return inf


def source(tmp_path: Path, sets: Any = None, metrics: Metrics | None = None) -> tuple[ClusterSource, Any]:
    cfg = config.ClusterConfig(kubeconfig="x", node_name="n1", state_file=str(tmp_path / "state.json"))
    sets = sets if sets is not None else FakeSets()
    return ClusterSource(cfg, sets, metrics if metrics is not None else Metrics()), sets


def versioned(obj: dict[str, Any], generation: int, rv: str = "") -> dict[str, Any]:
    obj["metadata"]["generation"] = generation
    obj["metadata"]["resourceVersion"] = rv or str(generation)
    return obj


def test_bad_edit_keeps_last_valid_version_in_force_and_in_the_state_file(tmp_path: Path) -> None:
    metrics = Metrics()
    src, sets = source(tmp_path, metrics=metrics)
    labels = {"zone": "a"}
    src.informers = {"node": informer([node(labels)]),
                     "imagesets": informer([versioned(own("keep", GOOD, pin=True), 1)])}
    assert src.recompute()
    src.save_state()
    assert sets.sources["cluster"]["keep"].generation == "1"

    for bad in (UPPER, LONG):
        src.informers["imagesets"] = informer([versioned(own("keep", [*GOOD, bad], pin=True), 2, bad)])
        src.recompute()
        src.save_state()
        kept = sets.sources["cluster"]["keep"]
        assert (kept.generation, kept.pin, len(kept.refs)) == ("1", True, 3)
        r = src.refused["keep"]
        assert (r.kind, r.generation, r.kept) == ("ImageSet", "2", "1")
        assert "spec.images[3].name" in r.error
        assert ("must be lowercase" in r.error) if bad == UPPER else ("longer than 255" in r.error)
        saved = json.loads((tmp_path / "state.json").read_text())
        assert [o["metadata"]["generation"] for o in saved["imageSets"]] == [1]
        assert metrics.registry.get_sample_value("cri_shim_image_set_invalid", {"source": "cluster"}) == 1
        status = src.status()["refused_sets"]["keep"]
        assert status["in_force_generation"] == "1" and status["refused_generation"] == "2"

    # a restart: the state file gives generation 1; the API still says 2 (refused): 1 stays
    src2, sets2 = source(tmp_path)
    src2.load_state()
    assert sets2.sources["cluster"]["keep"].generation == "1"
    src2.informers = {"node": informer([node(labels)]),
                      "imagesets": informer([versioned(own("keep", [*GOOD, UPPER], pin=True), 2)])}
    src2.recompute()
    assert sets2.sources["cluster"]["keep"].generation == "1" and src2.refused["keep"].kept == "1"

    # fixed: generation 3 applies, nothing refused
    src2.informers["imagesets"] = informer([versioned(own("keep", [*GOOD, "host:5000/team/app:v1"],
                                                               pin=True), 3)])
    assert src2.recompute()
    assert sets2.sources["cluster"]["keep"].generation == "3" and src2.refused == {}


def test_refused_without_a_valid_version_applies_nothing_and_is_reported(tmp_path: Path) -> None:
    src, sets = source(tmp_path)
    src.informers = {"node": informer([node({})]),
                     "imagesets": informer([versioned(own("new", [UPPER]), 1),
                                                 versioned(own("other", ["reg/x:1"]), 1)])}
    src.recompute()
    assert list(sets.sources["cluster"]) == ["other"]
    assert src.refused["new"].kept == "" and src.refused["new"].generation == "1"


def test_unselected_or_deleted_set_still_goes(tmp_path: Path) -> None:
    """Only a read that no longer selects a set removes it, invalid or not."""
    src, sets = source(tmp_path)
    sel = {"matchLabels": {"zone": "a"}}
    src.informers = {"node": informer([node({"zone": "a"})]),
                     "imagesets": informer([versioned(own("s", GOOD, sel, pin=True), 1)])}
    src.recompute()
    src.informers["imagesets"] = informer([versioned(own("s", [UPPER], sel, pin=True), 2)])
    src.recompute()
    assert "s" in sets.sources["cluster"]
    src.informers["node"] = informer([node({"zone": "b"})])  # the selector no longer matches
    src.recompute()
    assert "s" not in sets.sources["cluster"] and src.refused == {}
    src.informers["node"] = informer([node({"zone": "a"})])
    src.informers["imagesets"] = informer([])  # deleted
    src.recompute()
    assert "s" not in sets.sources["cluster"]


def test_pinned_image_set_bad_edit_and_unreadable_pool_keep_it(tmp_path: Path) -> None:
    src, sets = source(tmp_path)
    labels = {"node-role.kubernetes.io/worker": ""}
    worker = pool("worker", {"matchLabels": labels}, ["w"])
    src.informers = {"node": informer([node(labels)]), "imagesets": informer([]),
                     "pinnedimagesets": informer([versioned(pis("w", GOOD), 1)]),
                     "machineconfigpools": informer([worker])}
    src.recompute()
    src.save_state()
    assert sets.sources["cluster"]["w"].generation == "1"

    src.informers["pinnedimagesets"] = informer([versioned(pis("w", [*GOOD, UPPER]), 2)])
    src.recompute()
    src.save_state()
    assert sets.sources["cluster"]["w"].generation == "1" and len(sets.sources["cluster"]["w"].refs) == 3
    assert src.refused["w"].kind == "PinnedImageSet" and src.refused["w"].generation == "2"
    saved = json.loads((tmp_path / "state.json").read_text())
    assert [o["metadata"]["generation"] for o in saved["pinnedImageSets"]] == [1]

    # a pool whose selector cannot be read: whether it selects the node is unknown, its sets stay
    broken = pool("worker", {"matchExpressions": [{"key": "x", "operator": "Near"}]}, ["w"])
    broken["metadata"]["resourceVersion"] = "2"
    src.informers["machineconfigpools"] = informer([broken])
    src.recompute()
    assert sets.sources["cluster"]["w"].generation == "1"
    assert "MachineConfigPool worker" in src.errors


async def test_status_row_degraded_and_rate_limited_event(runtime, store, tmp_path) -> None:  # noqa: F811
    store.add(*GOOD)
    sets_dir = tmp_path / "sets"
    sets_dir.mkdir()
    async with image_sets(runtime, sets_dir) as h:
        src, _ = source(tmp_path, h.sets, h.metrics)
        src.informers = {"node": informer([node({})]),
                         "imagesets": informer([versioned(own("keep", GOOD, pin=True), 1)])}
        src.recompute()
        await reconciled(h, "keep", 3)
        clock = [0.0]
        st = NodeReport(src, h.sets, None, interval=1, event_interval=300, event_namespace="default",
                        request_timeout=5, clock=lambda: clock[0])
        doc = st.document()
        assert {c["type"]: c["status"] for c in doc["status"]["conditions"]}["Degraded"] == "False"

        src.informers["imagesets"] = informer([versioned(own("keep", [*GOOD, UPPER], pin=True), 2),
                                                    versioned(own("never", [UPPER]), 1)])
        src.recompute()
        await reconciled(h, "keep", 3)
        assert h.set_status("keep")["pinned"] == 3
        status = st.document()["status"]
        rows = {r["name"]: r for r in status["sets"]}
        row = rows["keep"]
        assert (row["currentGeneration"], row["desiredGeneration"], row["lastFailedGeneration"]) == ("1", "2", "2")
        assert row["reason"] == "InvalidSet" and "Team/App" in row["error"] and "lowercase" in row["error"]
        assert row["images"]["present"] == 3
        assert rows["never"]["reason"] == "InvalidSet" and "currentGeneration" not in rows["never"]
        conds = {c["type"]: c for c in status["conditions"]}
        assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "InvalidSet")
        assert conds["Ready"]["status"] == "False"

        sent: list[dict[str, Any]] = []

        class Core:
            async def create_namespaced_event(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
                sent.append(body)

        st.written(st.document(), "uid-1")
        for _ in range(3):  # every status write asks; one Event per set and reason per event_interval
            await st.events(Core())  # type: ignore[arg-type]
        assert sorted(e["metadata"]["generateName"] for e in sent) == ["n1.", "n1."]
        keep = next(e for e in sent if "keep" in e["message"])
        assert keep["reason"] == "ImageSetInvalid" and keep["type"] == "Warning"
        assert "generation 2 refused; generation 1 stays in force" in keep["message"]
        clock[0] = 301
        await st.events(Core())  # type: ignore[arg-type]
        assert len(sent) == 4

        text = render({"cluster": src.status(), "image_sets": h.sets.status()})
        assert "refused" in text and "set keep generation 2" in text and "in force: generation 1" in text


async def test_a_refusal_fixed_before_the_next_status_write_is_still_the_last_failed_generation(
        runtime, store, tmp_path) -> None:  # noqa: F811
    """Refused and fixed between two status documents (a restart, a quick edit): the row still says
    which generation was refused last (the source remembers it, not the status writer's sampling)."""
    store.add(*GOOD)
    sets_dir = tmp_path / "sets"
    sets_dir.mkdir()
    async with image_sets(runtime, sets_dir) as h:
        src, _ = source(tmp_path, h.sets, h.metrics)
        src.informers = {"node": informer([node({})]), "imagesets": informer([versioned(own("keep", GOOD), 1)])}
        src.recompute()
        st = NodeReport(src, h.sets, None, interval=1, event_interval=300, event_namespace="default",
                        request_timeout=5)
        src.informers["imagesets"] = informer([versioned(own("keep", [*GOOD, UPPER]), 2)])
        src.recompute()
        src.informers["imagesets"] = informer([versioned(own("keep", GOOD[:2]), 3)])
        src.recompute()
        assert not src.refused
        await reconciled(h, "keep", 2)
        row = next(r for r in st.document()["status"]["sets"] if r["name"] == "keep")
        assert (row["currentGeneration"], row["lastFailedGeneration"]) == ("3", "2") and "reason" not in row
        src.informers["imagesets"] = informer([])  # deleted: nothing of it remembered
        src.recompute()
        assert "keep" not in src.last_refused


async def test_file_with_a_bad_set_keeps_every_set_of_it_and_is_reported(runtime, store, tmp_path) -> None:  # noqa: F811
    """The file source: the file's previous content (each of its sets' last valid version) stays."""
    store.add(*GOOD)
    f = tmp_path / "sets.yaml"
    f.write_text(own_file("one", GOOD[:2], pin=True) + "---\n" + own_file("two", GOOD[2:], pin=True))
    async with image_sets(runtime, tmp_path) as h:
        await reconciled(h, "one", 2)
        await reconciled(h, "two", 1)
        write(f, own_file("one", GOOD[:2], pin=True) + "---\n" + own_file("two", [*GOOD[2:], UPPER], pin=True))
        await reconciled(h, "two", 1)
        from tests.support.wait import wait_for
        await wait_for(lambda: str(f) in h.status()["file_errors"])
        assert h.set_status("one")["pinned"] == 2 and h.set_status("two")["pinned"] == 1
        assert h.metrics.registry.get_sample_value("cri_shim_image_set_invalid", {"source": "file"}) == 1
        assert "must be lowercase" in h.status()["file_errors"][str(f)]
        assert "file " + str(f) in render({"image_sets": h.status()})
    # image_sets.dir removed on a reload: the stopped ImageSets leaves no count behind
    assert h.metrics.registry.get_sample_value("cri_shim_image_set_invalid", {"source": "file"}) == 0


def test_secret_errors_name_the_set(tmp_path: Path) -> None:
    src, sets = source(tmp_path)
    src.informers = {"node": informer([node({})]),
                     "imagesets": informer([versioned(own("s", GOOD, imagePullSecrets=[
                         {"namespace": "ns", "name": "gone"}]), 1)])}
    src.recompute()

    class Secrets:
        errors = {objects.SecretRef("ns", "gone"): "Secret ns/gone: HTTP 404: Not Found"}
        by_set: dict[str, Any] = {}

    src.secrets = Secrets()  # type: ignore[assignment]
    assert src.secret_errors() == {"s": "Secret ns/gone: HTTP 404: Not Found"}
    assert "s" in sets.sources["cluster"]


def test_too_many_pull_secrets_refused_on_the_node_too(tmp_path: Path) -> None:
    """imagePullSecrets is bounded by the CRD (maxItems); a CRD older than that is checked here."""
    src, sets = source(tmp_path)
    many = [{"namespace": "ns", "name": f"s{i}"} for i in range(objects.MAX_PULL_SECRETS + 1)]
    src.informers = {"node": informer([node({})]), "imagesets": informer([versioned(own("s", GOOD), 1)])}
    src.recompute()
    src.informers["imagesets"] = informer([versioned(own("s", GOOD, imagePullSecrets=many), 2)])
    src.recompute()
    assert sets.sources["cluster"]["s"].generation == "1"
    assert f"at most {objects.MAX_PULL_SECRETS}" in src.refused["s"].error


async def test_a_stopped_or_new_cluster_source_leaves_no_stale_invalid_count(tmp_path: Path) -> None:
    """cluster.kubeconfig removed (or cluster.* changed) on a reload: the source that counted a
    refused set is stopped; its count must not stay in the gauge (an alert firing forever)."""
    metrics = Metrics()
    src, sets = source(tmp_path, metrics=metrics)
    src.informers = {"node": informer([node({})]),
                     "imagesets": informer([versioned(own("bad", [UPPER]), 1)])}
    src.recompute()

    def invalid() -> float | None:
        return metrics.registry.get_sample_value("cri_shim_image_set_invalid", {"source": "cluster"})

    assert invalid() == 1
    await src.stop()
    assert invalid() == 0
    src.report()
    ClusterSource(src.cfg, sets, metrics)  # a reload that changed cluster.*: nothing applied yet
    assert invalid() == 0
