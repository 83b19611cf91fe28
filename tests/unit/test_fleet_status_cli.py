"""`cri-shim fleet status` as an operator runs it, against an in-process fake API server
(tests/support/fake_kube.py): a 429 (``storage is (re)initializing`` just after the report CRD is
installed) is waited out as Retry-After asks; any other error is one line on stderr and status 1."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from tests.support.fake_kube import FakeKube
from tests.unit.test_cluster_api import kube  # noqa: F401

SETS = "/apis/cri-shim.io/v1/imagesets"
REPORTS = "/apis/cri-shim.io/v1/pinnedimagesetreports"


def kubeconfig(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": url}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "secret-token-never-printed"}}]}))
    return path


async def fleet(config: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "shim", "fleet", "status", "--kubeconfig",
                                                str(config), *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_429_is_waited_out(kube: FakeKube, tmp_path: Path) -> None:  # noqa: F811
    status: dict[str, Any] = {"observedGeneration": 1, "selected": 2, "current": 2}
    kube.put(SETS, {"metadata": {"name": "warm", "generation": 1}, "spec": {}, "status": status})
    kube.put(REPORTS, {"metadata": {"name": "mco-set"}, "status": status})
    kube.fail(REPORTS, 429, times=2, headers={"Retry-After": "1"})
    rc, out, err = await fleet(kubeconfig(tmp_path, kube.url), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["warm"]["current"] == 2 and doc["PinnedImageSet/mco-set"]["selected"] == 2
    assert kube.count(REPORTS) == 3  # two 429s, then the list


async def test_an_error_is_one_line_not_a_traceback(kube: FakeKube, tmp_path: Path) -> None:  # noqa: F811
    kube.fail(SETS, 403)
    rc, out, err = await fleet(kubeconfig(tmp_path, kube.url))
    assert rc == 1 and out == ""
    assert err.startswith("cri-shim fleet status: the API server answered HTTP 403") and "Traceback" not in err
    assert "secret-token" not in err


async def test_a_rollout_says_why_it_halted_or_cannot_grant(kube: FakeKube, tmp_path: Path) -> None:  # noqa: F811
    def paced(name: str, halted: tuple[str, str]) -> dict[str, Any]:
        return {"metadata": {"name": name, "generation": 2}, "spec": {"rollout": {"maxConcurrentNodes": 1}},
                "status": {"observedGeneration": 2, "selected": 3, "current": 1, "waiting": 2,
                           "rollout": {"phase": "Halted" if halted[0] == "True" else "Rolling", "inFlight": 0,
                                       "maxConcurrentNodes": 1},
                           "conditions": [{"type": "Halted", "status": halted[0], "reason": halted[1]}]}}
    kube.put(SETS, paced("canary", ("True", "CanaryMatchesNoNode")))
    kube.put(SETS, paced("stuck", ("False", "NoNodeToGrant")))
    kube.put(SETS, paced("fine", ("False", "NotHalted")))
    kube.collections[REPORTS]  # noqa: B018  (served, none)
    rc, out, err = await fleet(kubeconfig(tmp_path, kube.url))
    assert rc == 0, err
    assert "rollout: Halted (CanaryMatchesNoNode), 2 waiting for a grant, 0 of 1 in flight" in out
    assert "rollout: Rolling (NoNodeToGrant), 2 waiting" in out
    assert "rollout: Rolling, 2 waiting" in out
