"""Which order of queued pulls makes pods wait least: a fluid model, not a measurement.

    python bench/pull_order.py [--slots 2] [--link-mibps 20] [--age-seconds 30]

The shim's queue starts a pull when a slot frees; it cannot pause or reorder what already runs.
This models that queue with ``--slots`` slots over one link shared equally by the running pulls
(each flight gets the link rate divided by the flights running), every flight's waiters arriving
with it, and compares the order queued flights start in:

* ``fifo``: the oldest first (the shim's rule within a class, queue.py);
* ``waiters/byte``: the most waiting pods per byte to fetch first, sizes known in advance (the
  best case for the rule: the shim would have to learn them from the registry), except that a
  flight queued ``--age-seconds`` or longer goes ahead of every younger one, oldest first (the
  aging rule that bounds a big image's wait);
* ``best``: the lower bound of any order, one image at a time at the full link rate, most pods
  per byte first (Smith's rule), arrivals ignored.

Scenarios: ``mixed`` is bench/kubelet_storm.py --mixed (one 200 MiB image for 4 pods, then 1 s
later 5 images of 5 MiB for 4 pods each); ``together`` is the same pods arriving at once, the
big image's pull first by a hair (kubelet's order is whatever its goroutines make it);
``mixed-behind`` is the same storm arriving while two
unrelated 50 MiB pulls hold both slots, so that the big image is queued when the small ones come.
Reported: each order's p50 and max of the time until a pod's image is present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

MiB = 1 << 20


@dataclass
class Flight:
    arrival: float
    size: float  # bytes
    waiters: int
    left: float = 0.0
    done: float | None = None


def simulate(flights: list[Flight], slots: int, rate: float, order: str, age: float) -> list[float]:
    """Each waiting pod's time until present (relative to its flight's arrival), in the model."""
    for f in flights:
        f.left, f.done = f.size, None
    now, running, queued = 0.0, list[Flight](), list[Flight]()
    pending = sorted(flights, key=lambda f: f.arrival)
    while pending or running or queued:
        while pending and pending[0].arrival <= now + 1e-12:
            queued.append(pending.pop(0))
        while queued and len(running) < slots:
            if order == "fifo":
                nxt = min(queued, key=lambda f: f.arrival)
            else:
                nxt = min(queued, key=lambda f: (now - f.arrival < age, f.arrival if now - f.arrival >= age
                                                 else -f.waiters / f.left))
            queued.remove(nxt)
            running.append(nxt)
        share = rate / len(running) if running else 0.0
        step = min([f.left / share for f in running] + [pending[0].arrival - now] if pending else
                   [f.left / share for f in running])
        now += step
        for f in running:
            f.left -= share * step
        for f in [f for f in running if f.left <= 1e-6]:
            f.done = now
            running.remove(f)
    return [f.done - f.arrival for f in flights for _ in range(f.waiters) if f.done is not None]


def best(flights: list[Flight], rate: float) -> list[float]:
    t, out = 0.0, []
    for f in sorted(flights, key=lambda f: f.size / f.waiters):
        t += f.size / rate
        out += [t] * f.waiters
    return out


def scenarios(link: float) -> dict[str, list[Flight]]:
    big = [Flight(0.0, 200 * MiB, 4)]
    small = [Flight(1.0, 5 * MiB, 4) for _ in range(5)]
    others = [Flight(0.0, 50 * MiB, 1), Flight(0.0, 50 * MiB, 1)]
    behind = [Flight(0.5, 200 * MiB, 4)] + small
    together = [Flight(0.0, 200 * MiB, 4)] + [Flight(0.01, 5 * MiB, 4) for _ in range(5)]
    return {"mixed": big + small, "together": together, "mixed-behind": others + behind}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--link-mibps", type=float, default=20.0)
    ap.add_argument("--age-seconds", type=float, default=30.0)
    args = ap.parse_args(argv)
    rate = args.link_mibps * MiB
    print("| scenario | order | present p50 | max |\n| --- | --- | --- | --- |")
    for name, flights in scenarios(rate).items():
        for order in ("fifo", "waiters/byte"):
            t = simulate(flights, args.slots, rate, order, args.age_seconds)
            print(f"| {name} | {order} | {statistics.median(t):.2f} s | {max(t):.2f} s |")
        b = best(flights, rate)
        print(f"| {name} | best (bound) | {statistics.median(b):.2f} s | {max(b):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
