"""The cluster source's decisions without an API server: selection, overrides, the state file,
keeping sets while a resource cannot be read, failure typing and backoff."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shim import config
from shim.cluster import objects, state
from shim.cluster.informer import backoff
from shim.cluster.source import ClusterSource
from shim.observability.metrics import Metrics
from tests.support.wait import wait_for


def own(name: str, images: list[str], selector: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"images": [{"name": i} for i in images], **spec}
    if selector is not None:
        s["nodeSelector"] = selector
    return {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet",
            "metadata": {"name": name, "generation": 3, "uid": "u-" + name, "resourceVersion": "1"}, "spec": s}


def pis(name: str, images: list[str], version: str = "v1") -> dict[str, Any]:
    return {"apiVersion": f"machineconfiguration.openshift.io/{version}", "kind": "PinnedImageSet",
            "metadata": {"name": name, "generation": 1, "resourceVersion": "1"},
            "spec": {"pinnedImages": [{"name": i} for i in images]}}


def pool(name: str, selector: dict[str, Any] | None, sets: list[str]) -> dict[str, Any]:
    spec: dict[str, Any] = {"pinnedImageSets": [{"name": s} for s in sets]}
    if selector is not None:
        spec["nodeSelector"] = selector
    return {"apiVersion": "machineconfiguration.openshift.io/v1", "kind": "MachineConfigPool",
            "metadata": {"name": name, "resourceVersion": "1"}, "spec": spec}


@pytest.mark.parametrize("selector,labels,expected", [
    ({}, {}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"b": "1"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"b": "1"}, True),
])
def test_label_selector(selector: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert objects.selects(selector, labels, none_selects_all=False) is expected


def test_selection_own_sets_pools_and_name_clash(tmp_path: Path) -> None:
    labels = {"node-role.kubernetes.io/worker": "", "zone": "a"}
    src, sets = source(tmp_path)
    src.informers = {
        "node": fake_informer([node(labels)]),
        "imagesets": fake_informer([own("gpu", ["reg/x:1"], {"matchLabels": {"zone": "a"}}, pin=True),
                                    own("other-zone", ["reg/y:1"], {"matchLabels": {"zone": "b"}}),
                                    own("everywhere", ["reg/z:1"]),
                                    own("clash", ["reg/c:1"])]),
        "pinnedimagesets": fake_informer([pis("worker-set", ["reg/w@sha256:" + "a" * 64]),
                                          pis("master-set", ["reg/m:1"]), pis("clash", ["reg/d:1"])]),
        "machineconfigpools": fake_informer([
            pool("worker", {"matchExpressions": [{"key": "node-role.kubernetes.io/worker", "operator": "Exists"}]},
                 ["worker-set", "clash"]),
            pool("master", {"matchLabels": {"node-role.kubernetes.io/master": ""}}, ["master-set"]),
            pool("no-selector", None, ["master-set"])]),
    }
    assert src.recompute()
    sel = src.selected
    assert sorted(sel) == sorted(sets.sources["cluster"]) == ["clash", "everywhere", "gpu", "worker-set"]
    assert sel["gpu"].set.pin is True and sel["gpu"].set.generation == "3"
    assert sel["everywhere"].set.pin is False
    assert sel["worker-set"].set.kind == "PinnedImageSet" and sel["worker-set"].set.pin is True
    assert sel["clash"].set.kind == "ImageSet"
    assert "same name" in src.errors["cluster:PinnedImageSet/clash"]
    assert sel["gpu"].set.ignored == ()  # nodeSelector is used here, not ignored


def test_bad_set_reported_others_applied() -> None:
    sel, errors = objects.select({}, [own("bad", ["reg/*:1"]), own("good", ["reg/a:1"])])
    assert list(sel) == ["good"]
    assert "globs" in errors["cluster:ImageSet/bad"]


def test_role_overrides_and_secrets() -> None:
    obj = own("cp", ["reg/a:1"], None, imagePullSecrets=[{"namespace": "ns", "name": "pull"}],
              roleOverrides=[{"nodeSelector": {"matchLabels": {"node-role.kubernetes.io/control-plane": ""}},
                              "maxParallel": 1, "cooldownSeconds": 30},
                             {"nodeSelector": {"matchLabels": {"pool": "edge"}}, "maxParallel": 3}])
    sel = objects.own_set(obj, {"node-role.kubernetes.io/control-plane": ""})
    assert sel is not None
    assert sel.secrets == (objects.SecretRef("ns", "pull"),)
    assert sel.overrides == (objects.RoleOverride(1, 30.0),)
    worker = objects.own_set(obj, {})
    assert worker is not None and worker.overrides == ()


class FakeSets:
    def __init__(self) -> None:
        self.sources: dict[str, dict[str, Any]] = {}
        self.overrides: dict[str, Any] = {}
        self.retries = 0

    def set_source(self, name: str, sets: dict[str, Any], *, held: dict[str, Any] | None = None,
                   **ledger_facts: Any) -> None:
        self.sources[name] = sets
        self.held = held or {}
        self.ledger_facts = ledger_facts  # uids, fresh, present, decided: what the pin ledger reads

    def set_overrides(self, **o: Any) -> None:
        self.overrides = o

    def retry_failed(self) -> None:  # a pull Secret changed
        self.retries += 1


def fake_informer(items: list[dict[str, Any]] | None) -> SimpleNamespace:
    """None: never read (API down from the start)."""
    return SimpleNamespace(synced=items is not None, items={o["metadata"]["name"]: o for o in items or []},
                           lists=int(items is not None), watches=0, throttled=0, error="")


def node(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "labels": labels, "resourceVersion": "1"}}


def source(tmp_path: Path) -> tuple[ClusterSource, FakeSets]:
    cfg = config.ClusterConfig(kubeconfig="x", node_name="n1", state_file=str(tmp_path / "state.json"))
    sets = FakeSets()
    return ClusterSource(cfg, sets, Metrics()), sets  # type: ignore[arg-type]


def test_state_file_restores_sets_and_never_drops_while_unreadable(tmp_path: Path) -> None:
    src, sets = source(tmp_path)
    src.informers = {"node": fake_informer([node({"zone": "a"})]),
                     "imagesets": fake_informer([own("a", ["reg/a:1"], {"matchLabels": {"zone": "a"}}, pin=True)]),
                     "pinnedimagesets": fake_informer([pis("w", ["reg/w:1"])]),
                     "machineconfigpools": fake_informer([pool("worker", {"matchLabels": {"zone": "a"}}, ["w"])])}
    assert src.recompute()
    src.save_state()
    assert sorted(sets.sources["cluster"]) == ["a", "w"]
    saved = json.loads((tmp_path / "state.json").read_text())
    assert saved["labels"] == {"zone": "a"} and [o["metadata"]["name"] for o in saved["imageSets"]] == ["a"]

    # the MCO resources become unreadable (informers not synced): what they gave stays
    src.informers["pinnedimagesets"] = fake_informer(None)
    src.informers["node"] = fake_informer([node({"zone": "a", "new": "label"})])
    assert src.recompute()
    assert sorted(sets.sources["cluster"]) == ["a", "w"]

    # a new process, nothing readable yet: the state file gives the same sets before any API call
    src2, sets2 = source(tmp_path)
    src2.load_state()
    assert src2.loaded_from_state and sorted(sets2.sources["cluster"]) == ["a", "w"]
    assert sets2.sources["cluster"]["a"].pin is True
    src2.informers = {"node": fake_informer(None), "imagesets": fake_informer(None)}
    assert not src2.recompute()
    assert sorted(sets2.sources["cluster"]) == ["a", "w"]

    # labels read again and no longer selecting: that (successful) read removes the set
    src2.informers = {"node": fake_informer([node({"zone": "b"})]), "imagesets": fake_informer(None)}
    assert src2.recompute()
    assert sorted(sets2.sources["cluster"]) == ["w"]


def test_state_file_not_writable_is_an_error_in_log_status_and_metrics(tmp_path: Path, caplog) -> None:
    """Said once at start (before serving), then on every failed save, in the log, in
    `cri-shim status` and in metrics; the first save that works clears it."""
    caplog.set_level(logging.INFO, logger="cri_shim")
    blocker = tmp_path / "var-lib"
    blocker.write_text("")  # the state file's directory cannot be made: as unwritable as a read-only /var/lib
    src, sets = source(tmp_path)
    src.cfg = dataclasses.replace(src.cfg, state_file=str(blocker / "cri-shim" / "state.json"))

    def metric(name: str) -> float | None:
        return src.events.registry.get_sample_value(name)

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

    src.load_state()
    assert not src.loaded_from_state
    assert [m for m in errors() if "cluster state file cannot be written" in m and "StateDirectory=cri-shim" in m]
    assert src.status()["state_error"].startswith(f"{src.cfg.state_file}: cannot write: ")
    assert src.status()["state_write_failures"] == 1
    assert (metric("cri_shim_cluster_state_write_failures_total"), metric("cri_shim_cluster_state_file_error")) \
        == (1.0, 1.0)

    src.informers = {"node": fake_informer([node({"zone": "a"})]),
                     "imagesets": fake_informer([own("a", ["reg/a:1"], {"matchLabels": {"zone": "a"}}, pin=True)])}
    assert src.recompute()
    for n in (2, 3):  # every failed save: one more error line, counted
        src.save_state()
        assert len([m for m in errors() if "cannot save the cluster state file" in m]) == n - 1
        assert metric("cri_shim_cluster_state_write_failures_total") == n and src.status()["state_write_failures"] == n
        assert metric("cri_shim_cluster_state_file_error") == 1.0
    assert sorted(sets.sources["cluster"]) == ["a"]  # the sets are applied all the same

    blocker.unlink()  # writable now (e.g. the unit fixed): the next save works and clears the error
    src.save_state()
    assert json.loads(Path(src.cfg.state_file).read_text())["labels"] == {"zone": "a"}
    assert "state_error" not in src.status() and metric("cri_shim_cluster_state_file_error") == 0.0
    assert metric("cri_shim_cluster_state_write_failures_total") == 3.0
    assert any(r.getMessage().startswith("cluster state file saved again") for r in caplog.records)

    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    src.cfg = dataclasses.replace(src.cfg, state_file=str(unwritable / "state.json"))
    src.save_state()  # cannot write again
    assert metric("cri_shim_cluster_state_file_error") == 1.0
    ClusterSource(src.cfg, sets, src.events)  # type: ignore[arg-type]  # a reload that changed cluster.*
    assert metric("cri_shim_cluster_state_file_error") == 0.0  # the new source starts clean


async def test_a_failed_save_is_tried_again(tmp_path: Path) -> None:
    """Nothing else changes after a failed save: the apply loop saves again after backoff_max_seconds."""
    blocker = tmp_path / "var-lib"
    blocker.write_text("")
    src, _ = source(tmp_path)
    src.cfg = dataclasses.replace(src.cfg, state_file=str(blocker / "state.json"), backoff_initial_seconds=0.1,
                                  backoff_max_seconds=0.1)
    src.informers = {"node": fake_informer([node({"zone": "a"})]), "imagesets": fake_informer([own("a", ["reg/a:1"])])}
    loop = asyncio.create_task(src.apply_loop())
    try:
        src.mark_changed()
        await wait_for(lambda: src.state_write_failures >= 2)  # the save after the change, then a retry
        blocker.unlink()
        await wait_for(lambda: not src.state_error)
        assert Path(src.cfg.state_file).exists()
        n = src.state_write_failures
        await asyncio.sleep(0.3)
        assert src.state_write_failures == n  # saved: no more retries
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_an_apply_that_raises_keeps_the_sets_and_is_tried_again(tmp_path: Path, caplog) -> None:
    """An object no rule foresaw makes recompute raise: the apply loop logs it, keeps the sets in force
    and applies the same inputs again later, instead of ending silently."""
    src, sets = source(tmp_path)
    src.cfg = dataclasses.replace(src.cfg, backoff_max_seconds=0.05)
    src.informers = {"node": fake_informer([node({"zone": "a"})]), "imagesets": fake_informer([own("a", ["reg/a:1"])])}
    real, calls = src.recompute, []

    def flaky() -> bool:
        calls.append(1)
        if len(calls) == 1:
            real()  # remembers its inputs, then fails part-way
            raise KeyError("name")
        return real()
    src.recompute = flaky  # type: ignore[method-assign]
    loop = asyncio.create_task(src.apply_loop())
    try:
        src.mark_changed()
        await wait_for(lambda: len(calls) >= 2 and Path(src.cfg.state_file).exists())
        assert "a" in src.selected
        assert any(r.getMessage().startswith("cluster image sets not applied") for r in caplog.records)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


def test_node_status_changes_do_not_reselect(tmp_path: Path) -> None:
    src, sets = source(tmp_path)
    src.informers = {"node": fake_informer([node({"zone": "a"})]), "imagesets": fake_informer([own("a", ["reg/a:1"])])}
    assert src.recompute()
    n = node({"zone": "a"})
    n["metadata"]["resourceVersion"] = "2"  # a kubelet heartbeat: same labels
    src.informers["node"] = fake_informer([n])
    assert not src.recompute()


def test_overrides_narrowest_wins(tmp_path: Path) -> None:
    src, sets = source(tmp_path)
    cp = {"nodeSelector": {"matchLabels": {"cp": ""}}}
    src.informers = {"node": fake_informer([node({"cp": ""})]),
                     "imagesets": fake_informer([own("a", ["reg/a:1"], roleOverrides=[{**cp, "maxParallel": 2}]),
                                                 own("b", ["reg/b:1"], roleOverrides=[{**cp, "maxParallel": 1,
                                                                                       "cooldownSeconds": 30}])])}
    src.recompute()
    assert sets.overrides == {"max_parallel": 1, "cooldown_seconds": 30.0}


def test_state_file_rejects_foreign_content(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text('{"version": 99}')
    with pytest.raises(ValueError, match="not a cri-shim cluster state file"):
        state.load(str(p))
    assert state.load(str(tmp_path / "missing.json")) is None


def test_backoff_full_jitter_bounds() -> None:
    assert backoff(1, 1.0, 60.0, rng=lambda: 1.0) == 1.0
    assert backoff(10, 1.0, 60.0, rng=lambda: 1.0) == 60.0
    assert backoff(10, 1.0, 60.0, rng=lambda: 0.0) == 0.1  # never zero: no tight loop
    assert backoff(3, 1.0, 60.0, rng=lambda: 0.5) == 2.0


def test_config_cluster_keys() -> None:
    with pytest.raises(config.ConfigError, match="cluster.status_interval_seconds"):
        config.from_dict({"cluster": {"status_interval_seconds": 0.5}})
    with pytest.raises(config.ConfigError, match="cluster.kubeconfig"):
        config.from_dict({"cluster": {"kubeconfig": "/no/such/kubeconfig"}})
    with pytest.raises(config.ConfigError, match="cluster.nope"):
        config.from_dict({"cluster": {"nope": 1}})


def test_fleet_summary_reads_the_sets_status() -> None:
    from shim.cluster.fleet import summarize

    done = {"metadata": {"name": "b", "generation": 2},
            "status": {"observedGeneration": 2, "selected": 3, "current": 1, "progressing": 0, "failing": 1,
                       "stale": 0, "missing": 1, "failedReasons": {"auth": 1},
                       "failingNodes": [{"node": "c", "reasons": "auth", "error": "x: 401"}],
                       "conditions": [{"type": "Degraded", "status": "True", "reason": "AuthFailed"}]}}
    out = summarize([done, {"metadata": {"name": "a", "generation": 1}},
                     {"metadata": {"name": "c", "generation": 3}, "status": {"observedGeneration": 2}}])
    assert list(out) == ["a", "b", "c"]
    b = out["b"]
    assert (b["selected"], b["current"], b["failing"], b["missing"]) == (3, 1, 1, 1)
    assert b["failingNodes"] == [{"node": "c", "reasons": "auth", "error": "x: 401"}]
    assert b["conditions"]["Degraded"] == {"status": "True", "reason": "AuthFailed"} and "note" not in b
    assert "controller" in out["a"]["note"] and "not caught up" in out["c"]["note"]
