"""A sequence of edits of the cluster's ImageSets ends where applying the final versions from
scratch does (hypothesis state machine).

The cluster source applies an edit by its difference: the objects' sets are parsed once per
version (in the parser child, kept by uid and resourceVersion, an edit normalizing only the
names it adds), unchanged versions stay the same objects, and the reconciler and the pin
ledger see only what changed. The steps are what set authors do: apply a new version of a set
(other images, pin on or off, selecting this node or not), delete it, delete and re-create it
under the same name (a new uid); the apply loop may run after each step (parsed ahead, as the
shim does) or only after several (the informers moved on meanwhile). After every step the node
that lived through the sequence and a node started now, empty, from the same objects, agree:
the same refs pinned, by the same sets, the same sets declared (refs, handlers, pin, generation).
The new versions are handed to the reconciler a few names at a time (as a large first apply
is): no pin that stays goes meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import copy
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shim import config
from shim.cluster.source import ClusterSource
from shim.config import ImageSetsConfig
from shim.imagesets.manager import ImageSets
from shim.imagesets.parse_process import ParseProcess
from shim.observability.metrics import Metrics
from shim.pins.ledger import PinLedger
from shim.pulls.scheduler import PullScheduler
from tests.unit.test_cluster_source import fake_informer, node

NAMES = ["a", "b", "c"]
POOL = [f"registry.local/app{i}:1" for i in range(8)]
images = st.lists(st.tuples(st.sampled_from(POOL), st.sampled_from(["", "kata"])), min_size=0, max_size=6)


def start_node(parser: ParseProcess | None) -> tuple[PinLedger, ImageSets, ClusterSource]:
    ledger = PinLedger("")
    metrics = Metrics()
    sets = ImageSets(ImageSetsConfig(docker_config=(), state_file="", max_images=1000), None,  # type: ignore[arg-type]
                     PullScheduler(4, 2, observers=[metrics]), metrics, on_pins=lambda p: None, ledger=ledger)
    src = ClusterSource(config.ClusterConfig(kubeconfig="x", node_name="n1", state_file=""), sets, Metrics(),
                        parser=parser)
    return ledger, sets, src


def outcome(ledger: PinLedger, sets: ImageSets) -> tuple[set[str], dict[str, Any], dict[str, Any]]:
    """The refs pinned, each set's pins (refs, uid, generation), and the sets declared. (Which set
    protects an image two sets pin is a matter of order, not of the result.)"""
    pins = {e.name: (set(e.refs), e.uid, e.generation) for e in ledger}
    declared = {n: (s.refs, s.handlers, s.pin, s.generation) for n, s in sets.reconciler.sets.items()}
    return set(ledger.snapshot()), pins, declared


class ClusterEdits(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.parser = ParseProcess()
        self.ledger, self.sets, self.src = start_node(self.parser)
        self.src.hand_over_images = 2
        self.objects: dict[str, dict[str, Any]] = {}  # what the API server holds, by name
        self.rv = 0
        self.uids = 0
        self.src.informers = {"node": fake_informer([node({"role": "w"})]), "imagesets": fake_informer([])}

    def teardown(self) -> None:
        self.parser.close()
        self.loop.close()

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _publish(self) -> None:
        """The informer's view: new dicts for what changed, as a watch event brings them."""
        self.src.informers["imagesets"] = fake_informer([copy.deepcopy(o) for o in self.objects.values()])

    def _apply_loop(self, prepared: bool) -> None:
        """As the apply loop does: parse ahead (or not), select, then hand over in steps of at most
        ``hand_over_images`` new names (2 here, so that most selections take several steps)."""
        if prepared:
            self.loop.run_until_complete(self.src.prepare())
        before = set(self.ledger.snapshot())
        self.src.recompute()
        steps = [set(self.ledger.snapshot())]
        while self.src.handing_over:
            self.src.hand_over()
            steps.append(set(self.ledger.snapshot()))
        kept = before & steps[-1]
        assert all(kept <= pinned for pinned in steps), "a pin went and came back while the sets were handed over"

    @rule(name=st.sampled_from(NAMES), imgs=images, pin=st.booleans(), selected=st.booleans(),
          prepared=st.booleans(), now=st.booleans())
    def apply(self, name: str, imgs: list[tuple[str, str]], pin: bool, selected: bool, prepared: bool,
              now: bool) -> None:
        old = self.objects.get(name)
        if old is None:
            self.uids += 1
            meta = {"name": name, "uid": f"uid-{self.uids}", "generation": 1}
        else:
            meta = {**old["metadata"], "generation": old["metadata"]["generation"] + 1}
        meta["resourceVersion"] = self._next_rv()
        spec: dict[str, Any] = {"pin": pin, "images": [{"name": r, **({"runtimeHandler": h} if h else {})}
                                                       for r, h in imgs]}
        spec["nodeSelector"] = {"matchLabels": {"role": "w" if selected else "cp"}}
        self.objects[name] = {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": meta, "spec": spec}
        self._publish()
        if now:
            self._apply_loop(prepared)

    @rule(name=st.sampled_from(NAMES), prepared=st.booleans(), now=st.booleans())
    def delete(self, name: str, prepared: bool, now: bool) -> None:
        self.objects.pop(name, None)
        self._publish()
        if now:
            self._apply_loop(prepared)

    @rule(name=st.sampled_from(NAMES), imgs=images, prepared=st.booleans())
    def recreate(self, name: str, imgs: list[tuple[str, str]], prepared: bool) -> None:
        """Deleted and created again under the same name between two runs of the apply loop."""
        self.objects.pop(name, None)
        self.apply(name, imgs, True, True, prepared, True)

    @invariant()
    def the_same_as_from_scratch(self) -> None:
        self._apply_loop(True)
        ledger, sets, src = start_node(None)
        src.informers = {"node": fake_informer([node({"role": "w"})]),
                         "imagesets": fake_informer([copy.deepcopy(o) for o in self.objects.values()])}
        src.recompute()
        got, want = outcome(self.ledger, self.sets), outcome(ledger, sets)
        assert got == want
        # and what the node declares is what the objects selecting it say, nothing kept from before
        assert set(got[2]) == {n for n, o in self.objects.items()
                               if o["spec"]["nodeSelector"]["matchLabels"]["role"] == "w"}


ClusterEdits.TestCase.settings = settings(max_examples=int(os.environ.get("CRI_SHIM_LEDGER_EXAMPLES", "40")), stateful_step_count=12, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestClusterEdits = ClusterEdits.TestCase


def test_an_edit_parses_the_edited_object_alone_and_keeps_the_others() -> None:
    """Three sets applied, then one edited: one object parsed again, in the parser child; the
    other two are the same sets as before (nothing downstream sees them change)."""
    parser = ParseProcess()
    loop = asyncio.new_event_loop()
    try:
        ledger, sets, src = start_node(parser)

        def obj(name: str, rv: str, *refs: str) -> dict[str, Any]:
            return {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet",
                    "metadata": {"name": name, "uid": f"uid-{name}", "generation": int(rv), "resourceVersion": rv},
                    "spec": {"pin": True, "images": [{"name": r} for r in refs]}}
        objs = [obj("a", "1", POOL[0]), obj("b", "1", POOL[1]), obj("c", "1", POOL[2], POOL[3])]
        src.informers = {"node": fake_informer([node({})]), "imagesets": fake_informer(objs)}
        loop.run_until_complete(src.prepare())
        src.recompute()
        before = dict(sets.reconciler.sets)
        parsed = src.parses.parsed
        src.informers["imagesets"] = fake_informer([objs[0], objs[1], obj("c", "2", POOL[2], POOL[4])])
        loop.run_until_complete(src.prepare())
        src.recompute()
        assert src.parses.parsed == parsed + 1
        after = sets.reconciler.sets
        assert after["a"] is before["a"] and after["b"] is before["b"]
        assert after["c"].refs == (POOL[2], POOL[4]) and after["c"].generation == "2"
        assert set(ledger.snapshot()) == {POOL[0], POOL[1], POOL[2], POOL[4]}
        assert parser.pid is not None  # parsed in the child
    finally:
        parser.close()
        loop.close()
