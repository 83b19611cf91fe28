"""`cri-shim status [--watch] [--json]`: the status document (process/status_document.py), fetched
from the admin socket (process/admin.py) and shown to a person: one line per pull with a
progress bar, then every other section as indented text.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from ..pulls.progress import human_bytes
from .admin import StatusError, fetch_status


def print_status(admin_socket: str, as_json: bool = False, out: TextIO | None = None) -> int:
    """`cri-shim status`: 0 on success, 1 (with a message on stderr) if the shim cannot be asked."""
    out = out or sys.stdout
    try:
        doc = fetch_status(admin_socket)
    except StatusError as e:
        print(f"cri-shim: {e}", file=sys.stderr)
        return 1
    if as_json:
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        out.write(render(doc))
    return 0


def watch_status(admin_socket: str, interval: float = 1.0, as_json: bool = False, out: TextIO | None = None,
                 count: int | None = None) -> int:
    """`cri-shim status --watch`: redraw every ``interval`` seconds until interrupted (or ``count`` times).

    On a terminal the screen is cleared before each view; otherwise views are separated
    by a blank line (for logs). With ``--json``, one JSON document per line.
    """
    out = out or sys.stdout
    clear = out.isatty() and not as_json
    shown = 0
    try:
        while count is None or shown < count:
            try:
                doc = fetch_status(admin_socket)
            except StatusError as e:
                text = f"cri-shim: {e}\n"
            else:
                text = json.dumps(doc) + "\n" if as_json else render(doc)
            if clear:
                out.write("\x1b[H\x1b[2J")
            elif shown and not as_json:
                out.write("\n")
            out.write(time.strftime("%H:%M:%S ") + text if not as_json else text)
            out.flush()
            shown += 1
            if count is None or shown < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0


# --------------------------------------------------------------------------- rendering


def _secs(v: Any) -> str:
    try:
        s = float(v)
    except (TypeError, ValueError):
        return str(v)
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def _pull_line(p: dict[str, Any]) -> str:
    parts = [str(p.get("image", "?"))]
    if p.get("handler"):
        parts.append(f"handler={p['handler']}")
    if p.get("priority") and p["priority"] != "foreground":
        who = f" uid {p['uid']}" if "uid" in p else ""
        parts.append(f"[{p['priority']}{who}]")
    waiters = p.get("waiters", 0)
    parts.append(f"{waiters} waiting" if waiters != 1 else "1 waiting")
    if "running_seconds" in p:
        parts.append(f"running {_secs(p['running_seconds'])}")
        parts.append(f"(queued {_secs(p.get('queued_seconds', 0))})")
        if "slot_released_seconds" in p:
            parts.append(f"no slot for {_secs(p['slot_released_seconds'])} (progress not judged)")
    else:
        parts.append(f"queued {_secs(p.get('queued_seconds', 0))}")
    return "  ".join(parts)


BAR_WIDTH = 24


def progress_line(pr: dict[str, Any]) -> str:
    """``[#########...............]  38%  9.1/24.0 MiB  1/3 layers  3.9 MiB/s  ETA 4s`` (or the phase and why)."""
    phase = pr.get("phase", "unknown")
    if "bytes_total" not in pr:
        return f"[{'?' * BAR_WIDTH}]  {phase}: {pr.get('reason', '')}".rstrip(": ")
    done, total = int(pr.get("bytes_done") or 0), int(pr.get("bytes_total") or 0)
    frac = done / total if total else 1.0
    filled = int(round(frac * BAR_WIDTH))
    parts = [f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {100 * frac:3.0f}%",
             f"{human_bytes(done)} / {human_bytes(total)}",
             f"{pr.get('layers_done', 0)}/{pr.get('layers_total', 0)} layers"]
    if phase == "unpacking":
        parts.append("unpacking")
    else:
        rate = pr.get("bytes_per_second")
        parts.append("- /s" if rate is None else f"{human_bytes(rate)}/s")
        eta = pr.get("eta_seconds")
        parts.append("ETA -" if eta is None else f"ETA {_secs(eta)}")
    return "  ".join(parts)


def _generic(value: Any, indent: int) -> list[str]:
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:")
                lines += _generic(v, indent + 1)
            else:
                lines.append(f"{pad}{k}: {_scalar(v)}")
        return lines
    if isinstance(value, list):
        lines = []
        for item in value:
            if isinstance(item, dict) and all(not isinstance(v, (dict, list)) for v in item.values()):
                lines.append(pad + "- " + "  ".join(f"{k}={_scalar(v)}" for k, v in item.items()))
            elif isinstance(item, (dict, list)):
                lines.append(pad + "-")
                lines += _generic(item, indent + 1)
            else:
                lines.append(f"{pad}- {_scalar(item)}")
        return lines
    return [f"{pad}{_scalar(value)}"]


def _scalar(v: Any) -> str:
    if v is None or v == [] or v == {}:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def refused_lines(doc: dict[str, Any]) -> list[str]:
    """Declarations the shim cannot apply, near the top: their last valid version stays in force."""
    out = []
    for name, r in (doc.get("cluster") or {}).get("refused_sets", {}).items():
        out.append(f"  set {name} generation {r.get('refused_generation')}: {r.get('error')} "
                   f"(in force: generation {r.get('in_force_generation')})")
    for path, err in (doc.get("image_sets") or {}).get("file_errors", {}).items():
        out.append(f"  file {path}: {err} (its previous content stays in force)")
    if not out:
        return []
    return ["refused    image sets the shim cannot apply; the last valid version of each stays in force:", *out]


def pressure_lines(doc: dict[str, Any]) -> list[str]:
    """Prefetch held below kubelet's image GC threshold, near the top, with its numbers."""
    gc = ((doc.get("image_sets") or {}).get("disk") or {}).get("gc_threshold") or {}
    if not gc.get("pressure"):
        return []
    return [f"prefetch   {gc.get('reason', 'DiskPressure')}"]


def render(doc: dict[str, Any]) -> str:
    """The status document for a person."""
    lines = [f"cri-shim {doc.get('version', '?')}  pid {doc.get('pid', '?')}  up {_secs(doc.get('uptime_seconds', 0))}"]
    up = doc.get("upstream", {})
    lines.append(f"upstream   {up.get('target', '?')}  {up.get('state', '?')}")
    pulls = doc.get("pulls", {})
    running, queued = pulls.get("in_flight", []), pulls.get("queued", [])
    cap = pulls.get("max_parallel", 0)
    released = sum(1 for p in running if "slot_released_seconds" in p)
    lines.append(f"pulls      {len(running)} running{f' ({released} without a slot)' if released else ''}, "
                 f"{len(queued)} queued  "
                 f"(max_parallel {cap or 'unlimited'}, collapse {'on' if pulls.get('dedup', True) else 'off'})")
    by_class, slots = pulls.get("running", {}), pulls.get("slots", {})
    if by_class.get("untrusted") or by_class.get("background"):
        lines.append(f"  by class trusted {by_class.get('trusted', 0)}, untrusted {by_class.get('untrusted', 0)} "
                     f"(of {slots.get('untrusted_slots')}; by uid {by_class.get('untrusted_by_uid', {})}), "
                     f"background {by_class.get('background', 0)} (of {slots.get('background_slots')})")
    for label, rows in (("running", running), ("queued", queued)):
        for i, p in enumerate(rows):
            lines.append(f"  {label if i == 0 else '':8} {_pull_line(p)}")
            if "progress" in p:
                lines.append(f"  {'':8}   {progress_line(p['progress'])}")
    lines += refused_lines(doc)
    lines += pressure_lines(doc)
    tracing = doc.get("tracing", {})
    if tracing:
        lines.append("tracing    " + "  ".join(f"{k}={v}" for k, v in tracing.items()))
    known = {"version", "pid", "uptime_seconds", "upstream", "pulls", "tracing"}
    for name, value in doc.items():
        if name in known:
            continue
        lines.append(f"{name}:")
        lines += _generic(value, 1) or ["  -"]
    return "\n".join(lines) + "\n"
