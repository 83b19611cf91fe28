"""Who may start a pull now: the slot rule, by class of caller (scheduler.py applies it).

Three classes of flight, in the order queued ones start: **trusted** (a CRI client whose uid
is in ``server.trusted_uids``: kubelet, root), **untrusted** (any other local client of the
socket, by uid) and **background** (image-set prefetch). With ``N = pulls.max_parallel``:

* At most ``N`` flights hold a slot (the cap); a flight whose slot lease ended (lease.py)
  goes on upstream without one.
* At most ``2 N`` flights run in the runtime, with a slot or released (the hard bound): at
  the bound nothing new starts, whatever its class.
* Untrusted flights together run at most ``untrusted_slots`` = ``floor(N *
  pulls.untrusted_share)``, at least 1 and at most ``N - 1``; one uid at most
  ``pulls.max_parallel_per_uid`` of those. Background flights run at most
  ``min(image_sets.max_parallel, N - 1)``. Untrusted and background flights together run at
  most ``N - 1``. These count released flights too: a released flight of theirs still holds
  its share, so the lease never lets an untrusted peer or prefetch past it.

* With ``C = pulls.critical_slots`` (default 0), a trusted flight of a pod at
  ``system-cluster-critical`` or above (``CRITICAL``; pod_priority.py) may start while up to
  ``N + C`` flights hold a slot and ``2 N + C`` run: the ``C`` extra slots are kept for critical
  pods, and nothing else takes them. Worst case: ``N + C`` pulls share the link and the runtime
  (each critical pod beyond ``C`` waits as any trusted pull does, first in the queue).

So a trusted pull waits only while other trusted pulls hold the cap (or, released, fill the
hard bound): untrusted peers and prefetch never hold the last slot, whatever they pull and
however slowly. With ``N = 1`` no slot is left for untrusted peers (``untrusted_slots`` 0:
their pulls are refused) nor for prefetch. With ``N = 0`` (no cap) there is no cap, share or
bound: an untrusted uid still runs at most ``pulls.max_parallel_per_uid``, prefetch at most
``image_sets.max_parallel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

CRITICAL = 2000000000  # system-cluster-critical: a pod at or above it may take pulls.critical_slots
HARD_BOUND_FACTOR = 2  # flights running in the runtime, with a slot or released: at most this times the cap


class Priority(IntEnum):
    """A flight's class; a lower value starts first. A flight has the class of its highest caller."""

    FOREGROUND = 0  # a trusted CRI client (kubelet)
    UNTRUSTED = 1  # a CRI client outside server.trusted_uids
    BACKGROUND = 2  # image-set prefetch


@dataclass(frozen=True)
class Slots:
    max_parallel: int  # pulls.max_parallel; 0: no cap
    background_max_parallel: int = 1  # image_sets.max_parallel
    untrusted_share: float = 0.5  # pulls.untrusted_share, in (0, 1]
    max_parallel_per_uid: int = 1  # pulls.max_parallel_per_uid
    critical_slots: int = 0  # pulls.critical_slots: above the cap, for critical pods' pulls only

    @property
    def hard_bound(self) -> int:
        """Flights running in the runtime at most (0: none, without a cap)."""
        return HARD_BOUND_FACTOR * self.max_parallel

    @property
    def background_slots(self) -> int:
        """How many background flights may run: one slot under the cap is always foreground's."""
        if self.max_parallel:
            return min(self.background_max_parallel, self.max_parallel - 1)
        return self.background_max_parallel

    @property
    def untrusted_slots(self) -> int | None:
        """How many untrusted flights may run together (None: no share, without a cap)."""
        n = self.max_parallel
        if not n:
            return None
        return min(n - 1, max(1, math.floor(n * self.untrusted_share)))

    @property
    def per_uid_slots(self) -> int:
        """How many flights one untrusted uid may run."""
        share = self.untrusted_slots
        return self.max_parallel_per_uid if share is None else min(self.max_parallel_per_uid, share)

    def may_start(self, priority: Priority, uid: int | None, rank: int, running: Running) -> bool:
        """May a flight of ``priority`` (charged to ``uid`` if untrusted; ``rank``: a trusted
        flight's pod priority) start now?"""
        n = self.max_parallel
        if n and (running.held >= n or running.total >= self.hard_bound):
            extra = self.critical_slots if priority is Priority.FOREGROUND and rank >= CRITICAL else 0
            if not extra or running.held >= n + extra or running.total >= self.hard_bound + extra:
                return False
        if priority is Priority.FOREGROUND:
            return True
        if n and running.untrusted + running.background >= n - 1:
            return False
        if priority is Priority.BACKGROUND:
            return running.background < self.background_slots
        share = self.untrusted_slots
        if share is not None and running.untrusted >= share:
            return False
        return running.by_uid.get(uid if uid is not None else -1, 0) < self.per_uid_slots

    def describe(self) -> dict[str, int | None]:
        """The bounds, for `cri-shim status`."""
        return {"max_parallel": self.max_parallel, "hard_bound": self.hard_bound or None,
                "untrusted_slots": self.untrusted_slots, "per_uid_slots": self.per_uid_slots,
                "background_slots": self.background_slots, "critical_slots": self.critical_slots}


@dataclass
class Running:
    """The flights running in the runtime now, counted as the slot rule needs them."""

    total: int = 0  # with a slot or released
    held: int = 0  # holding a slot
    trusted: int = 0
    untrusted: int = 0  # with a slot or released, as the rest of the classes
    background: int = 0
    by_uid: dict[int, int] = field(default_factory=dict)  # untrusted flights by the uid they are charged to

    def add(self, priority: Priority, uid: int | None, released: bool) -> None:
        self.total += 1
        self.held += not released
        if priority is Priority.FOREGROUND:
            self.trusted += 1
        elif priority is Priority.BACKGROUND:
            self.background += 1
        else:
            self.untrusted += 1
            u = uid if uid is not None else -1
            self.by_uid[u] = self.by_uid.get(u, 0) + 1

    def describe(self) -> dict[str, object]:
        """For `cri-shim status` and the metric (uids as strings: JSON keys)."""
        return {"trusted": self.trusted, "untrusted": self.untrusted, "background": self.background,
                "released": self.total - self.held,
                "untrusted_by_uid": {str(u): n for u, n in sorted(self.by_uid.items())}}
