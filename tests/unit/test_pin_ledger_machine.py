"""The pin ledger's rule, driven by random sequences (hypothesis state machine).

The system is what a shim process holds for pins: the ledger (loaded from its file), the
image sets of a directory (real files, read by ``ImageSets.rescan``) and the cluster source
(``ClusterSource`` over fake informers, with its state file). The steps are what operators
and outages do: write a valid, invalid or too-big (``max_images``) version of a file set,
delete it; apply, break, delete or move (nodeSelector) a cluster set, delete and re-create it
with a new uid; an API outage and its end; a restart (from the ledger and state files, the
API down or up); a reload that changes ``image_sets.state_file`` (new image sets, the same
ledger). One image is in several sets, or twice in one (two runtime handlers).

The model is the rule itself: a set's pins are the refs of its last valid version that fitted
(a version beyond ``max_images`` alone never does); only a newer such version or the
confirmed deletion of the set (file gone, object gone or no longer selecting the node, seen
by a successful read) changes them. After every step, once the sources are read: the pins in
force (the ledger's, and what the image service was handed) are exactly the union of the
model's, each protected by a set that declares it, and a fresh PinSet refuses every one of
them by name and by any spelling of it.

CI runs a bounded number of sequences; the soak (tests/soak) runs it for longer
(``CRI_SHIM_LEDGER_EXAMPLES``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shim import config
from shim.cluster.source import ClusterSource
from shim.config import ImageSetsConfig
from shim.images.pin_set import PinSet
from shim.imagesets.loader import SetDirectory, parse_here
from shim.imagesets.manager import ImageSets
from shim.observability.metrics import Metrics
from shim.pins.declared_pins import PinsSnapshot
from shim.pins.ledger import PinLedger
from shim.pulls.scheduler import PullScheduler
from tests.unit.test_cluster_source import fake_informer

IMAGES = [f"registry.local/app{i}:1" for i in range(5)]
SPELLED = {ref: ref.replace("registry.local", "REGISTRY.local", 1) for ref in IMAGES}  # the same image, spelled otherwise
FILE_SETS = ["f0", "f1", "f2"]
CLUSTER_SETS = ["c0", "c1"]
MAX_IMAGES = 20  # every set of the machine fits (5 sets of at most 4 images) but a too-big one
TOO_BIG = [f"registry.local/big{i}:1" for i in range(MAX_IMAGES + 1)]  # refused whatever else is declared
EXAMPLES = int(os.environ.get("CRI_SHIM_LEDGER_EXAMPLES", "60"))

images = st.lists(st.tuples(st.sampled_from(IMAGES), st.sampled_from(["", "kata"])), min_size=1, max_size=4)


def _set_doc(name: str, imgs: list[tuple[str, str]], pin: bool) -> dict[str, Any]:
    return {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name},
            "spec": {"pin": pin, "images": [{"name": i, **({"runtimeHandler": h} if h else {})} for i, h in imgs]}}


class Node:
    """One shim process's pin machinery, built as process/app.py builds it."""

    def __init__(self, root: Path, runner: asyncio.Runner, state_file: str) -> None:
        self.root, self.runner = root, runner
        self.published: list[PinsSnapshot] = []
        self.ledger = PinLedger(str(root / "pins.json"))
        self.ledger.load()
        self.sets = self._image_sets(state_file)
        self.cluster = self._cluster()

    def _image_sets(self, state_file: str) -> ImageSets:
        cfg = ImageSetsConfig(dir=str(self.root / "sets"), docker_config=(), state_file=state_file,
                              max_images=MAX_IMAGES)
        metrics = Metrics()
        sets = ImageSets(cfg, None, PullScheduler(4, 2, observers=[metrics]), metrics,  # type: ignore[arg-type]
                         on_pins=self.published.append, ledger=self.ledger)
        sets.directory = SetDirectory(cfg.dir, cfg.max_file_bytes, parse_here)  # no parser process here
        sets.load_state()
        return sets

    def _cluster(self) -> ClusterSource:
        ccfg = config.ClusterConfig(kubeconfig="x", node_name="n1", state_file=str(self.root / "cluster-sets.json"))
        src = ClusterSource(ccfg, self.sets, Metrics())
        src.load_state()
        return src

    def reload_state_file(self, state_file: str) -> None:
        """SIGHUP with a new image_sets.state_file: new image sets (and cluster source), the same ledger."""
        self.sets = self._image_sets(state_file)
        self.cluster = self._cluster()

    def read(self, labels: dict[str, str] | None, objects: dict[str, dict[str, Any]] | None) -> None:
        """The directory rescanned; the API read (``objects`` None: down, nothing is read)."""
        self.runner.run(self.sets.rescan())
        if objects is not None and labels is not None:
            node = {"metadata": {"name": "n1", "labels": labels, "resourceVersion": str(len(labels))}}
            self.cluster.informers = {"node": fake_informer([node]),
                                      "imagesets": fake_informer(list(objects.values()))}
            if self.cluster.recompute():
                self.cluster.save_state()  # as its apply loop does after an apply
        else:
            self.cluster.informers = {"node": fake_informer(None), "imagesets": fake_informer(None)}

    def stop(self) -> None:
        """SIGTERM: the ledger's save finishes, the cluster state file is written."""
        self.runner.run(self.ledger.flush())
        if self.cluster.labels is not None:
            self.cluster.save_state()


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="ledger-machine-"))
        (self.tmp / "sets").mkdir()
        self.runner = asyncio.Runner()
        self.state_file = str(self.tmp / "file-sets.json")
        self.node = Node(self.tmp, self.runner, self.state_file)
        self.api_up = True
        self.labels = {"zone": "a"}
        self.objects: dict[str, dict[str, Any]] = {}  # what the API server holds
        self.uids = 0
        self.expected: dict[str, set[str]] = {}  # set -> the refs it pins (the model)
        self.file_valid: dict[str, bool] = {}  # file set -> whether its file holds a valid version now
        self.read()

    def teardown(self) -> None:
        self.runner.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def read(self) -> None:
        self.node.read(self.labels if self.api_up else None, self.objects if self.api_up else None)

    # ------------------------------------------------------------------ the directory

    @rule(name=st.sampled_from(FILE_SETS), imgs=images, pin=st.booleans())
    def write_file(self, name: str, imgs: list[tuple[str, str]], pin: bool) -> None:
        (self.tmp / "sets" / f"{name}.yaml").write_text(yaml.safe_dump(_set_doc(name, imgs, pin)))
        self.file_valid[name] = True
        self._declare(name, {i for i, _ in imgs}, pin)
        self.read()

    @rule(name=st.sampled_from(FILE_SETS))
    def break_file(self, name: str) -> None:
        (self.tmp / "sets" / f"{name}.yaml").write_text("kind: ImageSet\nspec: [broken\n")
        self.file_valid[name] = False  # its last valid version, if any, stays
        self.read()

    @rule(name=st.sampled_from(FILE_SETS))
    def oversize_file(self, name: str) -> None:
        (self.tmp / "sets" / f"{name}.yaml").write_text(yaml.safe_dump(_set_doc(name, [(i, "") for i in TOO_BIG], True)))
        self.file_valid[name] = True  # valid, but refused (max_images): its last version that fitted stays
        self.read()

    @rule(name=st.sampled_from(FILE_SETS))
    def delete_file(self, name: str) -> None:
        path = self.tmp / "sets" / f"{name}.yaml"
        if path.exists():
            path.unlink()
            self.expected.pop(name, None)
        self.file_valid.pop(name, None)
        self.read()

    # ------------------------------------------------------------------ the API server

    def _object(self, name: str, spec: dict[str, Any], *, new_uid: bool = False) -> None:
        old = self.objects.get(name)
        if old is None or new_uid:
            self.uids += 1
            meta = {"name": name, "uid": f"uid-{self.uids}", "generation": 1}
        else:
            meta = {**old["metadata"], "generation": old["metadata"]["generation"] + 1}
        meta["resourceVersion"] = str(self.uids * 1000 + meta["generation"])
        self.objects[name] = {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": meta, "spec": spec}

    @rule(name=st.sampled_from(CLUSTER_SETS), imgs=images, pin=st.booleans(), selects=st.booleans(),
          recreate=st.booleans())
    def apply_object(self, name: str, imgs: list[tuple[str, str]], pin: bool, selects: bool, recreate: bool) -> None:
        spec = _set_doc(name, imgs, pin)["spec"]
        if not selects:
            spec["nodeSelector"] = {"matchLabels": {"zone": "elsewhere"}}
        self._object(name, spec, new_uid=recreate)
        if self.api_up:
            self._declare(name, {i for i, _ in imgs}, pin and selects)
        self.read()

    @rule(name=st.sampled_from(CLUSTER_SETS))
    def break_object(self, name: str) -> None:
        self._object(name, {"pin": True, "images": "not a list"})  # refused: its last valid version stays
        self.read()

    @rule(name=st.sampled_from(CLUSTER_SETS))
    def delete_object(self, name: str) -> None:
        if self.objects.pop(name, None) is not None and self.api_up:
            self.expected.pop(name, None)
        self.read()

    @rule()
    def api_down(self) -> None:
        self.api_up = False
        self.read()

    @precondition(lambda self: not self.api_up)
    @rule()
    def api_back(self) -> None:
        """The informers list again: every object as it is now decides."""
        self.api_up = True
        self._model_api()
        self.read()

    def _model_api(self) -> None:
        for name in CLUSTER_SETS:
            obj = self.objects.get(name)
            if obj is None:
                self.expected.pop(name, None)
                continue
            spec = obj["spec"]
            if not isinstance(spec.get("images"), list):
                continue  # invalid: no change
            selects = "nodeSelector" not in spec
            self._declare(name, {i["name"] for i in spec["images"]}, spec["pin"] and selects)

    # ------------------------------------------------------------------ the process

    @rule(api_at_start=st.booleans())
    def restart(self, api_at_start: bool) -> None:
        self.node.stop()
        self.node = Node(self.tmp, self.runner, self.state_file)
        if not api_at_start and self.api_up:
            self.api_up = False
        self.read()

    @rule(which=st.sampled_from(["", "a", "b"]))
    def reload_with_another_state_file(self, which: str) -> None:
        """A state file used before holds an older version: it never replaces a newer pin."""
        self.state_file = str(self.tmp / f"file-sets-{which}.json") if which else ""
        self.node.reload_state_file(self.state_file)
        self.read()

    # ------------------------------------------------------------------ the model and the check

    def _declare(self, name: str, refs: set[str], pin: bool) -> None:
        if pin:
            self.expected[name] = refs
        else:
            self.expected.pop(name, None)

    @invariant()
    def pins_are_exactly_the_last_valid_versions(self) -> None:
        want: dict[str, set[str]] = {}
        for name, refs in self.expected.items():
            for ref in refs:
                want.setdefault(ref, set()).add(name)
        pins = self.node.ledger.snapshot()
        assert set(pins) == set(want), f"pinned {sorted(pins)}, the sets declare {sorted(want)}"
        for ref, names in want.items():
            assert pins[ref] in names, f"{ref} said to be pinned by {pins[ref]}, declared by {sorted(names)}"
        if self.node.published:  # what the image service holds is the ledger's, once the directory is read
            assert dict(self.node.published[-1]) == dict(pins)
        pin_set = PinSet.build((), pins)
        for ref in want:
            assert pin_set.match_image("", [SPELLED[ref]], []) is not None  # as the runtime reports another spelling
            assert pin_set.match([ref]) is not None


LedgerMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=25, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_pin_ledger = LedgerMachine.TestCase


def _run(*steps: tuple[str, dict[str, Any]]) -> None:
    """One named sequence through the machine, the invariant checked after every step."""
    m = LedgerMachine()
    try:
        m.pins_are_exactly_the_last_valid_versions()
        for step, kwargs in steps:
            getattr(m, step)(**kwargs)
            m.pins_are_exactly_the_last_valid_versions()
    finally:
        m.teardown()


def test_a_stale_state_file_never_replaces_a_newer_pin() -> None:
    """State file ``a`` keeps version 1 of a file; version 2 is applied with state file ``b``; the
    file turns invalid; a reload back to ``a`` restores version 1 in force: the pins stay version 2's."""
    v1, v2 = [(IMAGES[0], "")], [(IMAGES[1], "")]
    _run(("write_file", {"name": "f0", "imgs": v1, "pin": True}),
         ("reload_with_another_state_file", {"which": "a"}),
         ("reload_with_another_state_file", {"which": "b"}),
         ("write_file", {"name": "f0", "imgs": v2, "pin": True}),
         ("break_file", {"name": "f0"}),
         ("reload_with_another_state_file", {"which": "a"}))


def test_the_issue_sequences() -> None:
    """The sequences issue 44 reported: a reload that changes the state file while a file is
    invalid; an image listed twice (two handlers) in one set and in another, then the edit and
    the deletion that must unpin it; a re-created object during an outage."""
    _run(("write_file", {"name": "f0", "imgs": [(IMAGES[0], "")], "pin": True}),
         ("break_file", {"name": "f0"}),
         ("reload_with_another_state_file", {"which": "a"}))
    _run(("write_file", {"name": "f0", "imgs": [(IMAGES[0], ""), (IMAGES[0], "kata")], "pin": True}),
         ("write_file", {"name": "f1", "imgs": [(IMAGES[0], "")], "pin": True}),
         ("write_file", {"name": "f0", "imgs": [(IMAGES[1], "")], "pin": True}),
         ("delete_file", {"name": "f1"}))
    _run(("apply_object", {"name": "c0", "imgs": [(IMAGES[2], "")], "pin": True, "selects": True, "recreate": False}),
         ("api_down", {}),
         ("apply_object", {"name": "c0", "imgs": [(IMAGES[3], "")], "pin": True, "selects": True, "recreate": True}),
         ("restart", {"api_at_start": False}),
         ("api_back", {}))
