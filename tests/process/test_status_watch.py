"""`cri-shim status --watch` ends on Ctrl-C (SIGINT), also when it was started with SIGINT
ignored, as a shell without job control starts `cmd &` (bench/pull_storm.py's watcher in
`bash scripts/demo.sh &` went on printing after its SIGINT: issue 36)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.support.shim import REPO_ROOT, shim_env


def test_watch_ends_on_sigint_even_when_started_with_sigint_ignored(short_tmp: Path) -> None:
    admin = short_tmp / "admin.sock"  # nothing listens: every view says so, the watch goes on
    # sh ignores SIGINT, then execs the watch (the ignored disposition survives exec)
    watch = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$@"', "sh", sys.executable, "-m", "shim", "status",
                              "--watch", "--interval", "0.2", "--admin-socket", str(admin)],
                             cwd=REPO_ROOT, env=shim_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watch.stdout is not None
        first = watch.stdout.readline()  # the first view is out: the watch is running
        assert f"no admin socket at {admin}" in first, first
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=10)
        assert watch.returncode == 0, (watch.returncode, err)
        assert "Traceback" not in err, err
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
