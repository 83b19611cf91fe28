"""A failed pull's typed reason from real runtimes' errors, never from the image's name.

Each runtime pulls from a registry that answers 401, 403, 404, 429 or 5xx the ways registries do
(tests/support/fault_registry.py), by tag and by digest, with "401"/"403" in every reference; and
the shim's image sets pull a few hundred missing images whose digests hold "401" or "403" from
docker-registry: ``cri-shim status`` counts every one ``notFound``, none ``auth``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc
import pytest

from tests.support import cri
from tests.support.fault_registry import FaultRegistry
from tests.support.fixtures import RUNTIMES, CriRuntime
from tests.support.missing_set import wait_all_failed, write_set
from shim.pulls.failure import PullFailure

# (marked e2e by the folder, the CRI-O case crio: tests/conftest.py)

EXPECTED = {
    "basic401": "auth", "token401": "auth", "token403": "auth", "denied403": "auth", "plain403": "auth",
    "manifest404": "notFound", "name404": "notFound", "plain404": "notFound",
    "toomany429": "other", "server500": "other", "unavailable503": "other",
}
TAILS = ("x401/app:v403", "app@sha256:" + "4031" * 16)
MISSING = 300


@pytest.fixture
def faults(cri_runtime: CriRuntime) -> Iterator[FaultRegistry]:
    """The fault registry, a plain-HTTP host of ``cri_runtime``."""
    reg = FaultRegistry().start()
    try:
        rt = cri_runtime.instance
        if cri_runtime.name.startswith("containerd-2"):  # no skip_verify: 2.x would try TLS first
            d = Path(rt.dir) / "certs.d" / reg.host
            d.mkdir(parents=True)
            (d / "hosts.toml").write_text(f'server = "http://{reg.host}"\n\n[host."http://{reg.host}"]\n'
                                          '  capabilities = ["pull", "resolve"]\n')
        else:
            rt.add_registry_host(reg.host)
        yield reg
    finally:
        reg.stop()


@pytest.mark.parametrize("cri_runtime", RUNTIMES, indirect=True)
def test_registry_errors_typed_from_each_runtime(cri_runtime: CriRuntime, faults: FaultRegistry) -> None:
    got: dict[str, str] = {}
    texts: dict[str, str] = {}
    for fault in EXPECTED:
        for tail in TAILS:
            res = cri.call(cri_runtime.socket, "PullImage", cri.pull_image_request(faults.ref(fault, tail)), timeout=60)
            assert res.code is not grpc.StatusCode.OK
            key = f"{fault} {tail}"
            got[key] = PullFailure(res.code, res.details or "").reason
            texts[key] = f"{res.code.name}: {res.details}"
    want = {f"{fault} {tail}": EXPECTED[fault] for fault in EXPECTED for tail in TAILS}
    wrong = {k: (got[k], texts[k]) for k in want if got[k] != want[k]}
    assert not wrong, wrong


def test_missing_digests_holding_401_403_are_not_found(containerd, registry, shim_factory, tmp_path) -> None:
    sets = tmp_path / "sets"
    sets.mkdir()
    write_set(str(sets / "missing.yaml"), "missing", registry.host, MISSING)
    shim = shim_factory({"image_sets": {"dir": str(sets), "max_parallel": 4, "retry_initial_seconds": 600,
                                        "retry_max_seconds": 600}, "pulls": {"max_parallel": 8}},
                        log_level="info")
    row, _ = wait_all_failed(shim.config["server"]["admin_socket"], "missing", MISSING, timeout=120)
    assert row["failed_reasons"] == {"notFound": MISSING}, row
