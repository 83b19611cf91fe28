"""Which nodes an MCO ``PinnedImageSet`` selects, as MCO and the node's shim decide it
(shim/cluster/objects.py ``pool_sets``): every ``MachineConfigPool`` listing it in
``spec.pinnedImageSets[].name`` selects the nodes its ``spec.nodeSelector`` matches (a pool without
a selector, none). The set selects the union. Pure: no I/O."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..cluster.aggregate import digest
from ..cluster.objects import MACHINE_CONFIG_POOL, generation_of, pool_listed, pool_sets
from .truth import Selection


def listing(name: str, pools: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pools listing the PinnedImageSet ``name``, by pool name."""
    return sorted((p for p in pools if name in pool_listed(p.get("spec") or {})),
                  key=lambda p: str((p.get("metadata") or {}).get("name")))


def selection(pools: Iterable[Mapping[str, Any]]) -> Selection:
    """The nodes the pools (``listing``'s) select together."""
    return Selection(tuple((f"{MACHINE_CONFIG_POOL.kind} {(p.get('metadata') or {}).get('name')}.spec.nodeSelector",
                            (p.get("spec") or {}).get("nodeSelector")) for p in pools), none_selects_all=False)


def sets_selecting(pools: Iterable[Mapping[str, Any]], labels: Mapping[str, str]) -> set[str]:
    """The PinnedImageSets that the pools selecting a node with these labels list (a pool whose
    selector cannot be read counts: its sets are recomputed, and say why)."""
    out = pool_sets(list(pools), labels)
    return out.names | out.undecided


def spec_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> bool:
    """Whether a pool event changes what it selects or lists (MCO writes its status often)."""
    def part(p: Mapping[str, Any] | None) -> tuple[Any, Any]:
        spec = (p or {}).get("spec") or {}
        return spec.get("nodeSelector"), sorted(pool_listed(spec))
    return old is None or new is None or part(old) != part(new)


def expected_digest(sets: Mapping[str, Mapping[str, Any]], pools: Iterable[Mapping[str, Any]],
                    labels: Mapping[str, str]) -> str:
    """The ``omitted.pinnedImageSets`` digest a node with these labels writes once it has seen
    every PinnedImageSet its pools list (shim/cluster/aggregate.py)."""
    return digest((name, generation_of(sets[name])) for name in sets_selecting(pools, labels) if name in sets)
