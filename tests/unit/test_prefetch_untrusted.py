"""Prefetch beside an untrusted local client (issue 44): it never waits in that client's pulls,
and each prefetch waits for its pull at most ``image_sets.pull_timeout_seconds``.

The untrusted client is a scheduler caller of class UNTRUSTED (uid 65534) whose pulls go to the
fake runtime like any other; the process test (tests/process/test_pull_fairness.py) does the
same through the socket as another uid."""

from __future__ import annotations

import asyncio
import logging

from shim.proto.runtime.v1 import api_pb2
from shim.pulls.key import pull_key
from shim.pulls.slots import Priority
from tests.support.wait import wait_for
from tests.unit.test_imagesets import image_sets, own, reconciled, store  # noqa: F401

NOBODY = 65534
DECLARED = ["reg.local/a:1", "reg.local/b:1", "reg.local/c:1"]


def failed(h, name: str) -> int:
    return h.status()["sets"].get(name, {}).get("failed", 0)


def untrusted_pull(h, image: str) -> asyncio.Future:
    """A pull by uid 65534 through the node's scheduler, as its PullImage would be."""
    req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image))

    async def run() -> bytes:
        return await h.upstream.unary("/runtime.v1.ImageService/PullImage", req.SerializeToString())
    return asyncio.ensure_future(h.scheduler.pull(pull_key(req, ""), run, priority=Priority.UNTRUSTED, uid=NOBODY))


async def test_declared_images_arrive_while_an_untrusted_uid_holds_slow_pulls_of_them(runtime, store,
                                                                                      tmp_path) -> None:
    """uid 65534 holds its one slot with a pull that never ends and queues pulls of two of the
    three declared images behind it. Prefetch starts its own pulls: all three arrive while the
    uid's pulls still wait (at main, prefetch joined them and waited in the uid's lane)."""
    store.hold("reg.local/slow:1")
    for ref in DECLARED[:2]:
        store.hold(ref)  # the uid's pulls of them would never finish either
    async with image_sets(runtime, tmp_path) as h:
        slow = untrusted_pull(h, "reg.local/slow:1")
        await wait_for(lambda: store.pulls == ["reg.local/slow:1"])
        queued = [untrusted_pull(h, ref) for ref in DECLARED[:2]]
        await wait_for(lambda: h.scheduler.queued == 2)
        for ref in DECLARED[:2]:
            store.gates.pop(ref)  # from now on the registry answers: the prefetch's own pulls finish
        (tmp_path / "sets.yaml").write_text(own("warm", DECLARED))
        await reconciled(h, "warm", 3)
        assert not slow.done() and not any(q.done() for q in queued)  # still queued behind the uid's own
        assert sorted(store.pulls[1:]) == DECLARED  # prefetch's own requests
        for t in (slow, *queued):
            t.cancel()
        await asyncio.gather(slow, *queued, return_exceptions=True)


async def test_a_prefetch_waits_at_most_pull_timeout_seconds_then_fails_naming_the_key_and_is_retried(
        runtime, store, tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="cri_shim")
    gate = store.hold("reg.local/hung:1")
    (tmp_path / "sets.yaml").write_text(own("warm", ["reg.local/hung:1"]))
    async with image_sets(runtime, tmp_path, pull_timeout_seconds=0.3) as h:
        await wait_for(lambda: failed(h, "warm") == 1, what="the hung prefetch to fail")
        await wait_for(lambda: "reg.local/hung:1" in store.cancelled,  # nobody else waited for it
                         what="the runtime's pull cancelled")
        error = h.set_status("warm")["last_error"]
        assert "DEADLINE_EXCEEDED" in error and "image_sets.pull_timeout_seconds" in error
        logged = [r.fields for r in caplog.records  # type: ignore[attr-defined]
                  if r.getMessage() == "image set pull failed; will retry"]
        assert logged[0]["code"] == "DEADLINE_EXCEEDED"
        assert logged[0]["error"].endswith("(image_sets.pull_timeout_seconds: 0.3 s)")
        gate.set()  # the registry answers again: the retry brings it
        await reconciled(h, "warm", 1)
        assert store.pulls.count("reg.local/hung:1") >= 2


async def test_a_kubelet_pull_sharing_a_prefetch_outlives_the_prefetchs_deadline(runtime, store, tmp_path) -> None:
    """The deadline is the prefetch's own wait: a pod's pull that joined it goes on to its answer."""
    gate = store.hold("reg.local/big:1")
    (tmp_path / "sets.yaml").write_text(own("warm", ["reg.local/big:1"]))
    async with image_sets(runtime, tmp_path, pull_timeout_seconds=0.3) as h:
        await wait_for(lambda: store.pulls == ["reg.local/big:1"])
        req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="reg.local/big:1"))

        async def never() -> bytes:
            raise AssertionError("kubelet's pull must join the running prefetch")
        kubelet = asyncio.ensure_future(h.scheduler.pull(pull_key(req, ""), never, priority=Priority.FOREGROUND))
        await wait_for(lambda: failed(h, "warm") == 1, what="the prefetch's deadline")
        await asyncio.sleep(0.2)  # a cancel would have reached the runtime by now
        assert store.cancelled == [] and not kubelet.done()
        gate.set()
        outcome = await asyncio.wait_for(kubelet, 5)
        assert outcome.joined and store.finished[:1] == ["reg.local/big:1"]


async def test_an_untrusted_pull_of_a_declared_image_does_not_join_the_prefetch(runtime, store, tmp_path) -> None:
    """Nobody but prefetch (and kubelet) waits in prefetch's pulls: the uid's is its own, and
    dropping the image from its set cancels the prefetch's pull."""
    gate = store.hold("reg.local/a:1")
    f = tmp_path / "sets.yaml"
    f.write_text(own("warm", ["reg.local/a:1"]))
    async with image_sets(runtime, tmp_path) as h:
        await wait_for(lambda: store.pulls == ["reg.local/a:1"])
        theirs = untrusted_pull(h, "reg.local/a:1")
        await wait_for(lambda: store.pulls == ["reg.local/a:1"] * 2, what="the uid's own pull upstream")
        f.write_text(own("warm", []))
        await wait_for(lambda: store.cancelled == ["reg.local/a:1"], what="the dropped prefetch cancelled")
        assert not theirs.done()
        gate.set()
        await asyncio.wait_for(theirs, 5)

