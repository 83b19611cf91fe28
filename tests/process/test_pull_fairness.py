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

- A reference spelled otherwise (issue 44): nobody keeps ``LOCALHOST:5000/app:v1`` queued behind
  its own hung pull; root's ``localhost:5000/app:v1`` is answered at once with the image, as
  without nobody (the scripted runtime refuses a host spelled in upper case as containerd does:
  its ``certs.d`` and localhost checks are case-sensitive). Same for ``Docker.io/library/nginx``
  against kubelet's ``nginx:latest``.
- Prefetch (issue 44): nobody holds its slot with a hung pull and queues pulls of 2 of the 3
  declared images behind it; the three arrive within the bound they take alone.

main @ f24ec3f: a root pull failed with DEADLINE_EXCEEDED after 150 s behind 4 trickling pulls
(issue 33), and with a 5 s lease it waited 48 s, then 40 pulls ran in the runtime at once.
main @ 500d405 (issue 44): root's pull joined nobody's queued flight and failed at once with the
runtime's ``failed to resolve reference "LOCALHOST:…"``; the declared images came only when
nobody's pulls ended (their deadline, 12 s here).
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
from tests.support.prefetch_store import FakeImages
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


class CaseSensitiveRuntime(Runtime):
    """As Runtime, and a registry host spelled with an upper-case letter is refused at once, as
    containerd does (``hosts.toml``/``certs.d`` and its localhost check compare the host as
    spelled: ``LOCALHOST:5000`` is neither ``localhost:5000`` nor a local registry, and is tried
    over HTTPS)."""

    def __init__(self) -> None:
        super().__init__()
        self.pulled: list[str] = []

    async def __call__(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[override]
        image = api_pb2.PullImageRequest.FromString(request).image.image
        self.pulled.append(image)
        host = image.partition("/")[0]
        if "/" in image and host != host.lower():
            await context.abort(grpc.StatusCode.UNKNOWN, f'failed to pull and unpack image "{image}": failed to '
                                f'resolve reference "{image}": failed to do request: http: server gave HTTP '
                                "response to HTTPS client")
        return await super().__call__(request, context)


async def queued_pulls(admin: Path) -> list[dict]:
    return (await asyncio.to_thread(fetch_status, str(admin)))["pulls"]["queued"]


@pytest.mark.parametrize(("theirs", "roots"), [("LOCALHOST:5000/app:v1", "localhost:5000/app:v1"),
                                               ("Docker.io/library/nginx:latest", "nginx:latest")])
async def test_root_pull_succeeds_whatever_an_untrusted_uid_queued_first(tmp_path: Path, theirs: str,
                                                                         roots: str) -> None:
    require_root()
    rt = CaseSensitiveRuntime()
    with shared_dir() as d:
        fake = await FakeRuntime(socket_in(str(d), "rt.sock")).start()
        fake.unary[PULL] = rt
        admin = d / "admin.sock"
        settings = {"server": {"socket_group": str(NOBODY), "admin_socket": str(admin)}}
        shim = await start_shim(fake.endpoint, tmp_path, settings, listen_path=f"{d}/shim.sock")
        try:
            hold = asyncio.ensure_future(asyncio.to_thread(run_as, NOBODY, hold_pulls, shim.path,
                                                           ["hang.example/u0:1"], HOLD_S, timeout=HOLD_S + 30))
            await wait_for(lambda: rt.hung == 1, 15.0, "nobody's hung pull reaches the runtime")
            spelled = asyncio.ensure_future(asyncio.to_thread(run_as, NOBODY, hold_pulls, shim.path, [theirs],
                                                              HOLD_S, timeout=HOLD_S + 30))
            end = time.monotonic() + 15
            while not await queued_pulls(admin):  # behind nobody's own pull: its one slot is taken
                assert time.monotonic() < end, "nobody's second pull never queued"
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            async with grpc.aio.insecure_channel(f"unix://{shim.path}") as ch:
                raw = await ch.unary_unary(PULL)(pull_request(roots), timeout=60)
            waited = time.monotonic() - t0
            queued = await queued_pulls(admin)
            codes = await hold, await spelled
        finally:
            await shim.astop()
            await fake.stop()
    print(f"\n  nobody queued {theirs} behind its hung pull: root's {roots} answered in {waited:.3f} s; "
          f"runtime pulled {rt.pulled}; nobody's pulls: {codes}")
    assert api_pb2.PullImageResponse.FromString(raw).image_ref.startswith("sha256:")
    assert waited < ROOT_BOUND_S
    assert rt.pulled[:2] == ["hang.example/u0:1", roots]  # root's request, as root spelled it
    assert [(r["priority"], r.get("uid")) for r in queued] == [("untrusted", NOBODY)]  # nobody's still waits
    assert codes == ({"DEADLINE_EXCEEDED": 1}, {"UNKNOWN": 1})  # its own, in its own turn, with its own answer


DECLARED = ["reg.local/a:1", "reg.local/b:1", "reg.local/c:1"]
DECLARED_BOUND_S = 3.0  # alone they take well under a second (the shim reads the set and pulls)


def image_set(images: list[str]) -> str:
    return ("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: warm}\nspec:\n  images:\n"
            + "".join(f"  - name: {i}\n" for i in images))


async def prefetch_scenario(tmp_path: Path, nobody_holds: bool) -> tuple[float, dict, list[str]]:
    """The declared images, with or without nobody holding its slot with a hung pull and
    pulls of two of them queued behind it -> (seconds until all three are in the runtime,
    nobody's codes, what the runtime was asked to pull)."""
    require_root()
    with shared_dir() as d:
        fake = await FakeRuntime(socket_in(str(d), "rt.sock")).start()
        store = FakeImages(fake).install()
        store.hold("hang.example/u0:1")  # never answered while nobody waits
        sets = tmp_path / "sets"
        sets.mkdir(parents=True)
        admin = d / "admin.sock"
        settings = {"server": {"socket_group": str(NOBODY), "admin_socket": str(admin)},
                    "image_sets": {"dir": str(sets), "state_file": ""}}
        shim = await start_shim(fake.endpoint, tmp_path, settings, listen_path=f"{d}/shim.sock")
        tasks = []
        try:
            if nobody_holds:
                tasks.append(asyncio.ensure_future(asyncio.to_thread(
                    run_as, NOBODY, hold_pulls, shim.path, ["hang.example/u0:1"], HOLD_S, timeout=HOLD_S + 30)))
                await wait_for(lambda: store.active == 1, 15.0, "nobody's hung pull reaches the runtime")
                tasks.append(asyncio.ensure_future(asyncio.to_thread(
                    run_as, NOBODY, hold_pulls, shim.path, DECLARED[:2], HOLD_S, timeout=HOLD_S + 30)))
                end = time.monotonic() + 15
                while len(await queued_pulls(admin)) < 2:
                    assert time.monotonic() < end, "nobody's pulls of the declared images never queued"
                    await asyncio.sleep(0.05)
            t0 = time.monotonic()
            (sets / "warm.yaml").write_text(image_set(DECLARED))
            await wait_for(lambda: all(store.has(i) for i in DECLARED), 30, "the declared images are present")
            took = time.monotonic() - t0
            codes = [await t for t in tasks]
        finally:
            await shim.astop()
            await fake.stop()
    return took, {k: v for c in codes for k, v in c.items()}, store.pulls


async def test_declared_images_arrive_in_their_time_alone_while_an_untrusted_uid_holds_slow_pulls_of_them(
        tmp_path: Path) -> None:
    alone, _, _ = await prefetch_scenario(tmp_path / "alone", nobody_holds=False)
    took, codes, pulls = await prefetch_scenario(tmp_path / "held", nobody_holds=True)
    print(f"\n  3 declared images: present in {alone:.3f} s alone, {took:.3f} s while nobody held a hung pull "
          f"and queued 2 of them; nobody's pulls: {codes}; runtime pulls: {pulls}")
    assert alone < DECLARED_BOUND_S and took < DECLARED_BOUND_S
    # prefetch pulled all three itself while nobody's two still waited behind its hung pull (their
    # deadline ended them, or they ran once it did: either way after the images were present)
    assert sorted(pulls[1:4]) == DECLARED
