"""A paced set's grant, as this node reads it (the controller's side: shim/controller/grants.py).

A set with ``spec.rollout`` is paced: the controller names the nodes allowed to pull its
generation in the set's status, ``status.rollout.granted`` for ``status.rollout.generation``.
A node reads it from the ImageSet it already watches. What the node does with it (ClusterSource):

* the set is the object, by ``metadata.uid``, not the name: a set deleted and created again (its
  generation starts at 1 again) is a new set, that needs a grant like any new generation;
* granted, or the generation already in force here: the generation applies (a grant is needed
  to start, not to go on: the controller drops a node from the list once it reports the
  generation);
* not granted: the version in force stays in force (never unpinned for want of a grant), and the
  new generation's images are pinned at once where the set pins (an image already present is
  pinned; none is pulled). The node's status row says ``reason: AwaitingGrant``;
* a new generation that declares no image the version in force lacks (a removal, a pin or
  rollout edit) needs no grant: nothing is pulled.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..imagesets.loader import ImageSet


def paced(obj: Mapping[str, Any]) -> bool:
    return isinstance((obj.get("spec") or {}).get("rollout"), Mapping)


def granted(obj: Mapping[str, Any], node: str) -> bool:
    """Whether the set's status grants ``node`` the set's present generation, of this object (a
    rollout written for another object of the same name, by its uid, grants nothing)."""
    rollout = (obj.get("status") or {}).get("rollout") or {}
    meta = obj.get("metadata") or {}
    if not isinstance(rollout, Mapping) or rollout.get("generation") != meta.get("generation"):
        return False
    if rollout.get("uid") and rollout.get("uid") != meta.get("uid"):
        return False
    names = rollout.get("granted") or []
    return isinstance(names, list) and node in names


def adds_images(new: ImageSet, old: ImageSet) -> bool:
    """Whether ``new`` declares an image (with its handler) that ``old`` does not."""
    def keys(s: ImageSet) -> set[tuple[str, str]]:
        return set(zip(s.refs, s.handlers or ("",) * len(s.refs)))
    return not keys(new) <= keys(old)
