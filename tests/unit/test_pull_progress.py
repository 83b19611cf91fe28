"""Pull progress arithmetic and the stall guard, driven by a fake clock (no I/O, no sleeps)."""

from __future__ import annotations

import json

import pytest

from shim.pulls.progress import (COPY_QUANTUM, Blob, FlightProgress, Manifest, Stall, StoredManifest, Unresolved,
                                 human_bytes, ingest_digest, parse_manifest, resolve, stall_message, stall_window)

MiB = 1 << 20
D = {name: "sha256:" + (c * 64) for name, c in (("cfg", "c"), ("l1", "1"), ("l2", "2"), ("l3", "3"), ("m", "a"),
                                                 ("m2", "b"), ("idx", "d"), ("x", "e"))}


def manifest(*layer_sizes: int, config: int = 1000) -> Manifest:
    layers = tuple(Blob(D[f"l{i + 1}"], n, "layer") for i, n in enumerate(layer_sizes))
    return Manifest(D["m"], (Blob(D["cfg"], config, "config"), *layers))


def progress(m: Manifest, started: float = 0.0) -> FlightProgress:
    p = FlightProgress("reg/app:v1", started)
    p.set_manifest(m)
    return p


# --------------------------------------------------------------------------- runtime records


@pytest.mark.parametrize("ref", [
    f"layer-{D['l1']}",                          # containerd 1.6 and 2.x
    f"config-{D['l1']}",
    f"manifest-{D['l1']}",
    f"index-{D['l1']}",
    f"layer-reg.example/app:v1@{D['l1']}",       # a descriptor with an OCI ref-name annotation
    f"unknown-{D['l1']}",
])
def test_ingest_refs_of_both_containerd_generations_give_the_blob_digest(ref: str) -> None:
    assert ingest_digest(ref) == D["l1"]


def test_an_ingest_ref_without_a_digest_is_not_a_blob_of_any_pull() -> None:
    assert ingest_digest("push-upload-1234") is None


def test_manifest_parsing_gives_config_and_layers_with_sizes() -> None:
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"digest": D["cfg"], "size": 10}, "layers": [{"digest": D["l1"], "size": 5 * MiB},
                                                                  {"digest": D["l2"], "size": 7}]}
    m = parse_manifest(D["m"], json.dumps(doc).encode())
    assert m is not None and m.total == 10 + 5 * MiB + 7
    assert [b.digest for b in m.layers] == [D["l1"], D["l2"]]


@pytest.mark.parametrize("data", [b"not json", b"[]", json.dumps({"manifests": []}).encode(),
                                  json.dumps({"config": {"digest": "x"}, "layers": []}).encode()])
def test_an_index_or_garbage_is_not_taken_for_a_manifest(data: bytes) -> None:
    assert parse_manifest(D["m"], data) is None


# --------------------------------------------------------------------------- bytes, layers, rate, ETA, steps


def test_bytes_layers_rate_and_eta_follow_the_ingests() -> None:
    p = progress(manifest(10 * MiB, 10 * MiB))
    total = 1000 + 20 * MiB
    assert p.observe(0.0, {}, set(), set()) == []
    assert p.view(0.0)["bytes_done"] == 0 and p.view(0.0)["bytes_total"] == total
    p.observe(1.0, {D["l1"]: 2 * MiB, D["l2"]: 2 * MiB}, {D["cfg"]}, {D["l1"], D["l2"]})
    p.observe(2.0, {D["l1"]: 4 * MiB, D["l2"]: 4 * MiB}, {D["cfg"]}, ())
    v = p.view(2.0)
    assert v["bytes_done"] == 1000 + 8 * MiB
    assert v["layers_done"] == 0 and v["layers_total"] == 2
    assert v["bytes_per_second"] == round((8 * MiB + 1000) / 2)  # since the first sample, 2 s ago
    assert v["eta_seconds"] == round((total - v["bytes_done"]) / v["bytes_per_second"], 1)
    p.observe(3.0, {D["l2"]: 6 * MiB}, {D["cfg"], D["l1"]}, ())
    v = p.view(3.0)
    assert v["layers_done"] == 1 and v["bytes_done"] == 1000 + 16 * MiB
    assert v["phase"] == "downloading"


def test_rate_is_over_the_last_ten_seconds() -> None:
    p = progress(manifest(100 * MiB))
    p.observe(0.0, {D["l1"]: 0}, {D["cfg"]}, {D["l1"]})
    p.observe(10.0, {D["l1"]: 50 * MiB}, {D["cfg"]}, ())  # fast at first
    for t in range(11, 21):
        p.observe(float(t), {D["l1"]: 50 * MiB + (t - 10) * MiB}, {D["cfg"]}, ())  # then 1 MiB/s
    assert p.rate(20.0) == pytest.approx(MiB)


def test_the_first_rate_is_what_the_pull_downloaded_since_it_started() -> None:
    p = progress(manifest(10 * MiB), started=0.0)
    p.observe(2.0, {D["l1"]: 2 * MiB}, {D["cfg"]}, {D["l1"]})  # the config was there already
    assert p.rate(2.0) == MiB and p.eta(2.0) == pytest.approx(8.0)


def test_each_step_is_reported_once_when_crossed() -> None:
    p = progress(manifest(100, config=0))
    assert p.observe(0.0, {D["l1"]: 10}, set(), ()) == []
    assert p.observe(1.0, {D["l1"]: 60}, set(), ()) == [25, 50]
    assert p.observe(2.0, {D["l1"]: 60}, set(), ()) == []
    assert p.observe(3.0, {D["l1"]: 99}, set(), ()) == [75]
    assert p.observe(4.0, {}, {D["cfg"], D["l1"]}, ()) == [100]
    assert p.observe(5.0, {}, {D["cfg"], D["l1"]}, ()) == []


def test_blobs_already_in_the_store_count_as_done_but_not_as_downloaded() -> None:
    p = progress(manifest(4 * MiB, 6 * MiB))
    p.observe(0.0, {D["l2"]: MiB}, {D["cfg"], D["l1"]}, {D["l2"]})  # l1 was there before the pull
    p.observe(1.0, {D["l2"]: 3 * MiB}, {D["cfg"], D["l1"]}, ())
    assert p.bytes_done == 1000 + 7 * MiB
    assert p.downloaded == 3 * MiB
    p.observe(2.0, {}, {D["cfg"], D["l1"], D["l2"]}, ())
    assert p.downloaded == 6 * MiB and p.layers_done == 2


def test_a_resumed_ingest_counts_only_what_this_pull_adds() -> None:
    p = progress(manifest(8 * MiB))
    p.observe(0.0, {D["l1"]: 5 * MiB}, {D["cfg"]}, ())  # left by an earlier, cancelled pull
    p.observe(1.0, {D["l1"]: 6 * MiB}, {D["cfg"]}, ())
    assert p.downloaded == MiB


def test_all_blobs_committed_means_unpacking_with_no_rate_and_no_eta() -> None:
    p = progress(manifest(MiB))
    p.observe(0.0, {D["l1"]: 0}, {D["cfg"]}, {D["l1"]})
    p.observe(1.0, {}, {D["cfg"], D["l1"]}, ())
    v = p.view(1.0)
    assert v["phase"] == "unpacking" and v["percent"] == 100.0 and v["eta_seconds"] is None


def test_unknown_and_resolving_pulls_show_why_and_no_numbers() -> None:
    p = FlightProgress("reg/app:v1", 0.0)
    assert p.view(0.0) == {"phase": "resolving", "reason": "resolving the manifest"}
    p.unknown = "the runtime has no containerd content API (e.g. CRI-O)"
    assert p.view(0.0) == {"phase": "unknown", "reason": p.unknown}
    assert p.stall(100.0, 5, 65536) is None


# --------------------------------------------------------------------------- stall guard


def test_stall_window_is_at_least_one_copy_step_at_the_minimum_rate() -> None:
    assert stall_window(0, 65536) == 0
    assert stall_window(60, 65536) == 60
    assert stall_window(5, 65536) == COPY_QUANTUM / 65536 == 16
    assert stall_window(5, 0) == 5


def trickle(p: FlightProgress, bps: float, until: float, step: float = 1.0, start: float = 0.0,
            quantum: int = 1) -> Stall | None:
    """Feed ``bps`` into layer 1 (offsets in ``quantum`` steps, like containerd's copy buffer)
    and return the first stall seen (timeout 5 s, 64 KiB/s)."""
    t = start
    while t <= until:
        written = int(bps * t) // quantum * quantum
        p.observe(t, {D["l1"]: written}, {D["cfg"]}, {D["l1"]})
        s = p.stall(t, 5, 65536)
        if s is not None:
            return Stall(s.moved, t)  # when it was seen
        t += step
    return None


def test_a_trickle_stalls_once_the_whole_window_is_below_the_minimum() -> None:
    p = progress(manifest(100 * MiB))
    seen = trickle(p, 2000, until=60)
    assert seen is not None
    assert seen.window == 16  # seen at t=16: the first moment a whole 16 s window exists
    assert seen.moved == 32000


def test_no_stall_before_the_pull_has_downloaded_for_a_whole_window() -> None:
    p = progress(manifest(100 * MiB))
    assert trickle(p, 0, until=15) is None


def test_a_slow_pull_above_the_minimum_is_not_a_stall_although_its_offset_moves_a_mib_at_a_time() -> None:
    p = progress(manifest(100 * MiB))
    assert trickle(p, 100_000, until=300, quantum=COPY_QUANTUM) is None


def test_a_pull_slowing_down_below_the_minimum_stalls() -> None:
    p = progress(manifest(100 * MiB))
    assert trickle(p, 1 * MiB, until=10) is None
    base = p.bytes_done
    t = 11.0
    while p.stall(t, 5, 65536) is None:
        p.observe(t, {D["l1"]: base - 1000 + int(100 * (t - 10))}, {D["cfg"]}, ())
        t += 1
        assert t < 40
    assert 26 <= t <= 28  # 16 s after the slowdown, give or take a poll


def test_unpacking_never_stalls_and_a_new_download_starts_a_fresh_window() -> None:
    p = progress(manifest(MiB))
    p.observe(0.0, {D["l1"]: MiB}, {D["cfg"]}, {D["l1"]})
    for t in range(1, 100):
        p.observe(float(t), {}, {D["cfg"], D["l1"]}, ())  # all committed, runtime unpacking
        assert p.stall(float(t), 5, 65536) is None
    assert p.phase == "unpacking"


def test_stall_guard_off_never_stalls() -> None:
    p = progress(manifest(100 * MiB))
    for t in range(0, 100):
        p.observe(float(t), {D["l1"]: 0}, {D["cfg"]}, {D["l1"]})
        assert p.stall(float(t), 0, 65536) is None


def test_the_stall_message_says_what_moved_over_which_window() -> None:
    assert stall_message("reg/app:v1", Stall(9 * 1024, 60.0), 65536) == (
        "cri-shim: pull of reg/app:v1 stalled: 9 KiB in the last 60 s (< 64 KiB/s); cancelled")
    assert human_bytes(447) == "447 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(24 * MiB) == "24 MiB"


# --------------------------------------------------------------------------- which manifest is the pull's


def stored(digest: str, touched: float, repos=("app",), blobs=(D["l1"],), children=()) -> StoredManifest:
    return StoredManifest(digest, frozenset(repos), frozenset(blobs), frozenset(children), touched)


def test_labels_of_a_stored_manifest_are_read_like_containerd_writes_them() -> None:
    labels = {"containerd.io/distribution.source.reg.example": "other,team/app",
              "containerd.io/gc.ref.content.config": D["cfg"], "containerd.io/gc.ref.content.l.0": D["l1"]}
    m = StoredManifest.from_labels(D["m"], labels, 5.0, "reg.example")
    assert m.repos == {"other", "team/app"} and m.blobs == {D["cfg"], D["l1"]} and not m.is_index


def test_a_tag_pull_gets_the_one_manifest_of_its_repository_touched_since_it_started() -> None:
    ms = [stored(D["m"], 105.0), stored(D["m2"], 50.0, blobs=(D["l2"],)), stored(D["x"], 106.0, repos=("else",))]
    assert resolve("app", None, 100.0, {}, ms, (), {}, "reg/app:v1") == D["m"]


def test_an_old_manifest_whose_blobs_are_downloading_now_is_the_pulls() -> None:
    """A retry after a cancelled pull: the manifest was committed long ago."""
    ms = [stored(D["m"], 5.0), stored(D["m2"], 6.0, blobs=(D["l2"],))]
    assert resolve("app", None, 100.0, {}, ms, {D["l1"]}, {}, "reg/app:v1") == D["m"]


def test_nothing_fetched_yet_is_unresolved() -> None:
    assert resolve("app", None, 100.0, {}, [stored(D["m"], 5.0)], (), {}, "reg/app:v1") == \
        Unresolved("manifest not fetched yet")


def test_two_tags_of_one_repository_at_once_stay_unknown_until_the_other_is_known() -> None:
    ms = [stored(D["m"], 105.0), stored(D["m2"], 106.0, blobs=(D["l2"],))]
    v2 = {"reg/app:v2": 100.0}  # started with v1
    assert isinstance(resolve("app", None, 100.0, v2, ms, (), {}, "reg/app:v1"), Unresolved)
    assert resolve("app", None, 100.0, v2, ms, (), {D["m2"]: "reg/app:v2"}, "reg/app:v1") == D["m"]


def test_a_manifest_touched_before_the_other_tag_started_is_the_earlier_pulls() -> None:
    ms = [stored(D["m"], 101.0), stored(D["m2"], 104.0, blobs=(D["l2"],))]
    # v1 started at 100, v2 at 103: only v1 can have touched a manifest at 101
    assert resolve("app", None, 100.0, {"reg/app:v2": 103.0}, ms, (), {}, "reg/app:v1") == D["m"]
    # v2 sees v1 known, sets its manifest aside, and is left with one candidate
    assert resolve("app", None, 103.0, {"reg/app:v1": 100.0}, ms, (), {D["m"]: "reg/app:v1"}, "reg/app:v2") == D["m2"]
    # but while v1 is unknown, v2 cannot tell (v1 may have touched the manifest at 104)
    assert isinstance(resolve("app", None, 103.0, {"reg/app:v1": 100.0}, ms, (), {}, "reg/app:v2"), Unresolved)


def test_a_digest_pull_of_a_manifest_or_of_an_index() -> None:
    assert resolve("app", D["m"], 100.0, {}, [stored(D["m"], 1.0)], (), {}, "reg/app@" + D["m"]) == D["m"]
    index = stored(D["idx"], 101.0, blobs=(), children=(D["m"], D["m2"]))
    ms = [index, stored(D["m"], 102.0), stored(D["m2"], 3.0, blobs=(D["l2"],))]
    assert resolve("app", D["idx"], 100.0, {}, ms, (), {}, "reg/app@" + D["idx"]) == D["m"]
    assert isinstance(resolve("app", D["x"], 100.0, {}, ms, (), {}, "reg/app@" + D["x"]), Unresolved)


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("pulls,key,says", [
    ({"progress_interval_seconds": 0.01}, "pulls.progress_interval_seconds", "must be 0 (off) or >= 0.1"),
    ({"progress_interval_seconds": -1}, "pulls.progress_interval_seconds", "must be >= 0"),
    ({"stall_timeout_seconds": "soon"}, "pulls.stall_timeout_seconds", "expected a duration"),
    ({"stall_timeout_seconds": 5, "progress_interval_seconds": 0}, "pulls.stall_timeout_seconds",
     "needs pull progress"),
    ({"stall_timeout_seconds": 1, "progress_interval_seconds": 1}, "pulls.stall_timeout_seconds",
     "at least twice pulls.progress_interval_seconds"),
    ({"stall_min_bytes_per_second": "fast"}, "pulls.stall_min_bytes_per_second", "expected a size in bytes"),
    ({"progress_log_after_seconds": True}, "pulls.progress_log_after_seconds", "expected a duration"),
    ({"no_progress_timeout_seconds": "never"}, "pulls.no_progress_timeout_seconds", "expected a duration"),
    ({"no_progress_timeout_seconds": -5}, "pulls.no_progress_timeout_seconds", "must be >= 0"),
    ({"no_progress_timeout_seconds": 1, "progress_interval_seconds": 1}, "pulls.no_progress_timeout_seconds",
     "at least twice pulls.progress_interval_seconds"),
])
def test_bad_progress_settings_name_the_key(pulls: dict, key: str, says: str) -> None:
    from shim.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as e:
        from_dict({"pulls": pulls})
    assert e.value.key == key and says in str(e.value)


def test_progress_settings_take_units() -> None:
    from shim.config import from_dict

    p = from_dict({"pulls": {"stall_timeout_seconds": "1m", "stall_min_bytes_per_second": "64KiB",
                             "progress_interval_seconds": "500ms"}}).pulls
    assert (p.stall_timeout_seconds, p.stall_min_bytes_per_second, p.progress_interval_seconds) == (60, 65536, 0.5)
    assert from_dict({"pulls": {"no_progress_timeout_seconds": "2m"}}).pulls.no_progress_timeout_seconds == 120
    assert from_dict({}).pulls.no_progress_timeout_seconds == 60  # on by default
    assert from_dict({"pulls": {"progress_interval_seconds": 0}}).pulls.progress_interval_seconds == 0  # both off
