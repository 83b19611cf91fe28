"""Pull slots between peers, with the shim as a process (relay engine) in front of a scripted
runtime whose pulls of ``hang.example/...`` never finish (as a registry that trickles or hangs),
and a client of another uid (``nobody``, in ``server.socket_group``) holding such pulls.

- Every slot an untrusted uid may take, filled with pulls that never end: a root pull of a
  small image is answered within ``ROOT_BOUND_S`` (README "Limits": untrusted peers hold at
  most ``pulls.untrusted_share`` of the slots, never the last one).
- The lease regime (progress not judged: CRI-O, or ``pulls.progress_interval_seconds: 0``):
  40 hung untrusted pulls, their leases ending every 2 s. The root pull's wait stays under
  the same bound, and the runtime never sees more untrusted pulls than their share (released
  ones count against it), nor more pulls in all than twice ``pulls.max_parallel``.

main @ f24ec3f: a root pull failed with DEADLINE_EXCEEDED after 150 s behind 4 trickling pulls
(issue 33), and with a 5 s lease it waited 48 s, then 40 pulls ran in the runtime at once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from shim.process.admin import fetch_status
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.other_uid import NOBODY, require_root, run_as, shared_dir
from tests.support.shim import start_shim
from tests.support.slow_pulls import PULL, hold_pulls, pull_request
from tests.support.wait import wait_for

ROOT_BOUND_S = 2.0  # docs/pulls.md "Fair between peers": the root pull does not wait for any untrusted one
CAP = 4
SHARE = 2  # pulls.untrusted_share 0.5 of 4
HOLD_S = 12.0  # how long the untrusted client keeps its pulls (its deadline)


class Runtime:
    """PullImage: ``hang.example/...`` never answers; anything else at once. Counts concurrency."""

    def __init__(self) -> None:
        self.current = self.max = self.hung = self.max_hung = 0

    async def __call__(self, request: bytes, context: object) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        hangs = image.startswith("hang.example/")
        self.current += 1
        self.hung += hangs
        self.max, self.max_hung = max(self.max, self.current), max(self.max_hung, self.hung)
        try:
            if hangs:
                await asyncio.Event().wait()
            return api_pb2.PullImageResponse(image_ref=f"sha256:{'a' * 64}").SerializeToString()
        finally:
            self.current -= 1
            self.hung -= hangs


async def root_pull(path: str) -> float:
    """A root pull of a small image, as kubelet's (no deadline of its own): seconds until answered."""
    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
        await ch.unary_unary(PULL)(pull_request("registry.example/small:1"), timeout=60)
    return time.monotonic() - t0


async def scenario(tmp_path: Path, pulls: dict, n: int, watch_s: float) -> tuple[Runtime, float, dict, dict, str]:
    """``n`` hung pulls by nobody; ``watch_s`` later a root pull. -> (runtime, root's wait,
    nobody's codes, the status's pull counts while they were held, the shim's log)."""
    require_root()
    rt = Runtime()
    with shared_dir() as d:
        fake = await FakeRuntime(socket_in(str(d), "rt.sock")).start()
        fake.unary[PULL] = rt
        admin = d / "admin.sock"
        settings = {"server": {"socket_group": str(NOBODY), "admin_socket": str(admin)}, "pulls": pulls}
        shim = await start_shim(fake.endpoint, tmp_path, settings, listen_path=f"{d}/shim.sock")
        try:
            refs = [f"hang.example/u{i}:1" for i in range(n)]
            attacker = asyncio.ensure_future(asyncio.to_thread(run_as, NOBODY, hold_pulls, shim.path, refs, HOLD_S,
                                                               timeout=HOLD_S + 30))
            per_uid = pulls.get("max_parallel_per_uid", 1)
            await wait_for(lambda: rt.hung >= min(n, SHARE, per_uid), 15.0, "the untrusted pulls reach the runtime")
            await asyncio.sleep(watch_s)
            waited = await root_pull(shim.path)
            running = (await asyncio.to_thread(fetch_status, str(admin)))["pulls"]["running"]
            codes = await attacker
            log = shim.logs()
        finally:
            await shim.astop()
            await fake.stop()
    return rt, waited, codes, running, log


async def test_an_untrusted_uid_in_every_slot_it_may_take_does_not_hold_back_a_root_pull(tmp_path: Path) -> None:
    """The uid may take the whole share (max_parallel_per_uid 4): it gets 2 of the 4 slots."""
    rt, waited, codes, running, _ = await scenario(tmp_path, {"max_parallel": CAP, "max_parallel_per_uid": 4},
                                                   n=4, watch_s=1.0)
    print(f"\n  4 hung pulls by nobody: root pull answered in {waited:.3f} s; runtime saw at most {rt.max_hung} "
          f"hung pulls, {rt.max} in all; status {running}; nobody's pulls: {codes}")
    assert waited < ROOT_BOUND_S
    assert rt.max_hung == SHARE and rt.max <= SHARE + 1
    assert running["untrusted"] == SHARE and running["untrusted_by_uid"] == {str(NOBODY): SHARE}
    assert codes == {"DEADLINE_EXCEEDED": 4}  # their own deadline: the shim ended none of them


@pytest.mark.parametrize("per_uid", [1, 2])
async def test_in_the_lease_regime_hung_untrusted_pulls_keep_to_their_share(tmp_path: Path, per_uid: int) -> None:
    """Progress off, 2 s leases: 40 hung untrusted pulls are released one lease after the other,
    and still no more of them run than their share (one uid: its own part)."""
    pulls = {"max_parallel": CAP, "progress_interval_seconds": 0, "no_progress_timeout_seconds": 2,
             "max_parallel_per_uid": per_uid}
    rt, waited, codes, running, log = await scenario(tmp_path, pulls, n=40, watch_s=7.0)
    print(f"\n  40 hung pulls by nobody, 2 s leases, {per_uid} per uid: root pull answered in {waited:.3f} s; runtime "
          f"saw at most {rt.max_hung} hung pulls, {rt.max} in all; status {running}; nobody's pulls: {codes}")
    assert "without a pull slot" in log  # the leases ended: this is the lease regime
    assert waited < ROOT_BOUND_S
    assert rt.max_hung == min(per_uid, SHARE)
    assert rt.max <= 2 * CAP and rt.max <= SHARE + 1
    assert running["untrusted"] == min(per_uid, SHARE) and running["released"] == min(per_uid, SHARE)
    assert codes == {"DEADLINE_EXCEEDED": 40}
