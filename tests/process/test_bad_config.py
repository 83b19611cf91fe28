"""Bad config met by a real ``cri-shim serve`` process: it exits with one line naming the key
(a sample of the generated cases, one per top-level key), and values that parse but cannot be
used on this machine are refused at start the same way. (Every case, in-process, and reloads:
tests/unit/test_bad_config.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.shim import REPO_ROOT
from tests.unit.test_bad_config import CASES, Case, write


def one_per_section() -> list[Case]:
    """The last case of each top-level key (the explicit ones come last)."""
    return list({str(c.path[0]): c for c in CASES}.values())


def test_serve_process_exits_with_one_line(tmp_path: Path) -> None:
    """As an operator runs it: a real process per top-level key, at once."""
    procs = []
    for i, case in enumerate(one_per_section()):
        d = tmp_path / str(i)
        d.mkdir()
        path = write(d, case)
        procs.append((case, subprocess.Popen(
            [sys.executable, "-m", "shim", "serve", "--config", str(path), "--listen", f"unix://{d}/s.sock",
             "--upstream", f"unix://{d}/rt.sock"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)))
    for case, p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode != 0, case
        assert err.count("\n") == 1 and case.key in err and "Traceback" not in err, err
        print(f"\n{case.id}: exit {p.returncode}: {err.strip()}")


def test_startup_failures_are_one_line(tmp_path: Path) -> None:
    """Values that parse but cannot be used on this machine: refused at start, one line, no traceback."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "live.sock"))
    live.listen()
    (tmp_path / "file").write_text("")
    cases = [
        ({"metrics": {"address": f"127.0.0.1:{taken.getsockname()[1]}"}}, "s1.sock", "metrics.address"),
        ({}, "live.sock", "is already serving on"),
        ({}, "file/s.sock", "cannot create the directory of"),
    ]
    procs = []
    for i, (data, sock, message) in enumerate(cases):
        path = tmp_path / f"config{i}.yaml"
        path.write_text(yaml.safe_dump({"server": {"admin_socket": ""}, **data}))
        procs.append((message, subprocess.Popen(
            [sys.executable, "-m", "shim", "serve", "--config", str(path), "--listen", f"unix://{tmp_path}/{sock}",
             "--upstream", f"unix://{tmp_path}/rt.sock"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)))
    try:
        for message, p in procs:
            _, err = p.communicate(timeout=30)
            lines = [line for line in err.splitlines() if not line.startswith("time=")]  # log lines
            print(f"\nexit {p.returncode}: {lines}")
            assert p.returncode == 1
            assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    finally:
        taken.close()
        live.close()


