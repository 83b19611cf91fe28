"""Which cluster sets apply to this node now: a function of what the API server holds and of
what was applied last, with no I/O (source.py hands the result over and says what changed).

A set whose newest version is refused (an invalid image name, an unreadable field) keeps its
last valid version in force, and the state file keeps that version's object: an invalid edit
never unpins. A paced set's new generation without a grant for this node is held (pinned, not
pulled) while the version in force stays. A pool that cannot be read keeps the
PinnedImageSets it gave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..imagesets.loader import SetFileError
from . import grant, objects
from .objects import Selected


def slim(obj: dict[str, Any]) -> dict[str, Any]:
    """What the state file keeps of an object: no managedFields, no status."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items()
            if k in ("name", "uid", "generation", "resourceVersion", "annotations")}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": meta,
            "spec": obj.get("spec") or {}}


@dataclass(frozen=True)
class Applied:
    """What was applied last: the sets in force and the objects they came from (by name)."""
    selected: dict[str, Selected] = field(default_factory=dict)
    own_raw: dict[str, dict[str, Any]] = field(default_factory=dict)  # ImageSet objects
    pinned_raw: dict[str, dict[str, Any]] = field(default_factory=dict)  # PinnedImageSet objects


@dataclass
class Selection:
    """The outcome of one selection; ``applied`` is what goes in force."""
    applied: Applied
    errors: dict[str, str]  # by object (cluster:Kind/name, MachineConfigPool name)
    refused: dict[str, objects.Refused]  # by set name: its newest version cannot be applied
    held: dict[str, Selected]  # by set name: a paced set's generation waiting for its grant
    kept: set[str]  # in force as applied before, not as read now
    undecided: set[str]  # PinnedImageSets of a pool that cannot be read (kept as they were)


def select_sets(node_name: str, labels: dict[str, str], own: list[dict[str, Any]],
                mco: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None, last: Applied, *,
                gate: bool = True, parse: objects.ParseFn = objects.parse_here) -> Selection:
    """The sets that apply to a node with ``labels``, from its ImageSets ``own`` and (``mco``:
    PinnedImageSets, MachineConfigPools; None keeps the PinnedImageSets applied last) MCO's.
    ``gate``: hold a paced set's generation until granted (not for the state file's sets, all
    in force). ``parse``: how an object's document becomes a set (parses.py keeps them by version)."""
    previous, old_own, old_pinned = last.selected, last.own_raw, last.pinned_raw
    selected, errors = objects.select(labels, own, parse)
    refused: dict[str, objects.Refused] = {}
    own_raw: dict[str, dict[str, Any]] = {}
    by_own = {o["metadata"]["name"]: o for o in own}
    held: dict[str, Selected] = {}
    kept: set[str] = set()
    for name, obj in by_own.items():
        if name in selected:
            if gate and grant.paced(obj) and _hold(node_name, name, obj, previous, old_own, selected, own_raw, held):
                if name in selected:
                    kept.add(name)
                continue
            own_raw[name] = slim(obj)
        elif (err := errors.get(objects.source_of(obj))) is not None:
            kept_generation = _keep(previous, name, "ImageSet", old_own, selected, own_raw)
            kept.add(name)
            refused[name] = objects.Refused(name, "ImageSet", objects.generation_of(obj), err, kept_generation)
    if mco is not None:
        pinned, pools = mco
        listed = objects.pool_sets(pools, labels)
        for err in listed.errors:
            errors[err.split(".spec", 1)[0]] = err
        pinned_objs = [o for o in pinned if o["metadata"]["name"] in listed.names]
        undecided = listed.undecided - listed.names
    else:
        pinned_objs, undecided = list(old_pinned.values()), set()
    pinned_raw: dict[str, dict[str, Any]] = {}
    for name in sorted(undecided):  # a pool that cannot be read keeps what it gave
        _keep(previous, name, "PinnedImageSet", old_pinned, selected, pinned_raw)
        kept.add(name)
    for obj in pinned_objs:
        name = obj["metadata"]["name"]
        if name in selected:  # an ImageSet of that name is in force (a refused one with no valid version is not)
            errors[objects.source_of(obj)] = (f"PinnedImageSet {name}: an ImageSet of the same name applies; "
                                              "ignoring this one")
            continue
        try:
            sel = objects.pinned_set(obj, parse)
        except SetFileError as e:
            errors[objects.source_of(obj)] = str(e)
            kept_generation = _keep(previous, name, "PinnedImageSet", old_pinned, selected, pinned_raw)
            kept.add(name)
            refused[name] = objects.Refused(name, "PinnedImageSet", objects.generation_of(obj), str(e),
                                            kept_generation)
            continue
        selected[name] = sel
        pinned_raw[name] = slim(obj)
    if mco is None:
        kept.update(n for n, s in selected.items() if s.set.kind == "PinnedImageSet")
    return Selection(Applied(selected, own_raw, pinned_raw), errors, refused, held, kept, undecided)


def _hold(node_name: str, name: str, obj: dict[str, Any], previous: dict[str, Selected],
          old_raw: dict[str, dict[str, Any]], selected: dict[str, Selected], raw: dict[str, dict[str, Any]],
          held: dict[str, Selected]) -> bool:
    """A paced set's generation without a grant: keep the version in force (if any) and hold the
    new one (pins only). False when it applies: granted, in force already, or nothing to pull."""
    new, old = selected[name], previous.get(name)
    own_old = old is not None and old.set.kind == "ImageSet" and name in old_raw
    # in force already: the same object (uid: a set deleted and created again is new) and generation
    if grant.granted(obj, node_name) or (old is not None and own_old
                                         and ((old.uid, old.set.generation) == (new.uid, new.set.generation)
                                              or not grant.adds_images(new.set, old.set))):
        return False
    held[name] = new
    if own_old and old is not None:
        selected[name] = old
        raw[name] = old_raw[name]
    else:
        del selected[name]
    return True


def _keep(previous: dict[str, Selected], name: str, kind: str, old_raw: dict[str, dict[str, Any]],
          selected: dict[str, Selected], raw: dict[str, dict[str, Any]]) -> str:
    """Keep the version of ``name`` applied last (when it was of this kind); its generation, or ""."""
    old = previous.get(name)
    if old is None or old.set.kind != kind or name in selected or name not in old_raw:
        return ""
    selected[name] = old
    raw[name] = old_raw[name]
    return old.set.generation
