"""The image sets' pins kept by the change (shim/imagesets/declared_pins.py): two sets pinning
one name, snapshots that never move, and the same answers across a new base (compaction)."""

from __future__ import annotations

import random

from shim.pins import declared_pins
from shim.pins.declared_pins import DeclaredPins


def test_a_name_two_sets_pin_stays_pinned_until_both_let_go() -> None:
    pins = DeclaredPins()
    pins.add("a", ["r/x:1", "r/y:1"])
    pins.add("b", ["r/y:1", "r/z:1"])
    first = pins.snapshot()
    assert dict(first) == {"r/x:1": "a", "r/y:1": "a", "r/z:1": "b"}
    pins.remove("a", ["r/x:1", "r/y:1"])
    second = pins.snapshot()
    assert dict(second) == {"r/y:1": "b", "r/z:1": "b"}  # b protects y now
    pins.remove("b", ["r/y:1"])
    pins.remove("b", ["r/never:1"])  # not pinned: nothing happens
    assert dict(pins.snapshot()) == {"r/z:1": "b"} and len(pins) == 1
    assert dict(first) == {"r/x:1": "a", "r/y:1": "a", "r/z:1": "b"}  # earlier snapshots do not move
    assert "r/x:1" not in second and second.get("r/x:1") is None and len(second) == 2


def test_snapshots_agree_with_a_plain_dict_across_new_bases(monkeypatch) -> None:
    """Random adds and removes by three sets, with a small compaction threshold: every snapshot
    equals the index recomputed from scratch, and keeps its answers after later changes."""
    monkeypatch.setattr(declared_pins, "COMPACT_MIN", 8)
    rng = random.Random(7)
    names = [f"r/i{i}:1" for i in range(60)]
    pins = DeclaredPins()
    held: dict[str, set[str]] = {"a": set(), "b": set(), "c": set()}
    taken: list[tuple[dict[str, str], object]] = []
    for _ in range(300):
        s = rng.choice("abc")
        if rng.random() < 0.5:
            new = {n for n in rng.sample(names, 5) if n not in held[s]}
            pins.add(s, sorted(new))
            held[s] |= new
        else:
            gone = set(rng.sample(sorted(held[s]), min(5, len(held[s]))))
            pins.remove(s, sorted(gone))
            held[s] -= gone
        snap = pins.snapshot()
        expected = {n for v in held.values() for n in v}
        assert set(snap) == expected and len(snap) == len(expected)
        assert all(n in held[snap[n]] for n in expected)  # each is protected by a set that pins it
        assert all(n not in snap for n in names if n not in expected)
        taken.append((dict(snap), snap))
    assert all(dict(snap) == copy for copy, snap in taken)  # type: ignore[call-overload]
