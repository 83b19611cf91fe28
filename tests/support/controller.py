"""`cri-shim controller` as a process for the cluster suite, with the rights of
deploy/cluster/controller.yaml (ControlPlane.controller_kubeconfig)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.apiserver import ControlPlane
from tests.support.procs import terminate

STALE_AFTER = 4.0  # --stale-after for the tests (default 120)


class ControllerProc:
    def __init__(self, cp: ControlPlane, tmp: Path, identity: str, *extra: str) -> None:
        self.identity = identity
        self.log_path = tmp / f"controller-{identity}.log"
        self._log = open(self.log_path, "wb")
        kubeconfig = cp.controller_kubeconfig(tmp / "controller.kubeconfig")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shim", "controller", "--kubeconfig", str(kubeconfig), "--identity", identity,
             "--stale-after", str(STALE_AFTER), *extra],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        terminate(self.proc, timeout=10)
        self._log.close()
