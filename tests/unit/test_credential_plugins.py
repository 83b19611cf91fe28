"""kubelet credential provider plugins for image-set prefetch, with a small plugin of our
own (tests/support/credential_plugin.py): the exec protocol, matchImages, the answer cache
(cacheKeyType, cacheDuration), failures and timeouts, and no secret in logs or status."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from pathlib import Path

import pytest

from shim.config import ConfigError, from_dict
from shim.credentials.plugins import PluginProviders, ProviderConfigError, go_duration, parse_config
from tests.support.prefetch_store import FakeImages
from tests.unit.test_imagesets import image_sets, own, reconciled

SECRET = "plugin-pw-41d9c2"
PLUGIN = Path(__file__).parent.parent / "support" / "credential_plugin.py"


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A bin dir with the test plugin as ``fake-provider`` (a wrapper running this Python)."""
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "fake-provider"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {PLUGIN} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return d


def provider_config(tmp_path: Path, *, match: list[str], default_cache: str = "1h",
                    env: dict[str, str] | None = None, args: list[str] | None = None) -> Path:
    runs = tmp_path / "runs.log"
    env = {"PLUGIN_RUNS": str(runs), "PLUGIN_PASSWORD": SECRET, **(env or {})}
    doc = {"apiVersion": "kubelet.config.k8s.io/v1", "kind": "CredentialProviderConfig", "providers": [{
        "name": "fake-provider", "matchImages": match, "defaultCacheDuration": default_cache,
        "apiVersion": "credentialprovider.kubelet.k8s.io/v1", "args": args or ["--user", "plugin-user"],
        "env": [{"name": k, "value": v} for k, v in env.items()]}]}
    path = tmp_path / "providers.yaml"
    path.write_text(json.dumps(doc))
    return path


def runs(tmp_path: Path) -> list[dict]:
    f = tmp_path / "runs.log"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


@pytest.mark.parametrize("value, seconds", [("12h", 43200), ("1h30m", 5400), ("0", 0), ("500ms", 0.5), (0, 0)])
def test_go_durations(value, seconds) -> None:
    assert go_duration(value, "k") == seconds


@pytest.mark.parametrize("doc, says", [
    ({"kind": "Other"}, "expected kind CredentialProviderConfig"),
    ({"providers": []}, "providers: expected a non-empty list"),
    ({"providers": [{"name": "../x", "matchImages": ["a"], "defaultCacheDuration": "1h",
                     "apiVersion": "credentialprovider.kubelet.k8s.io/v1"}]}, "providers[0].name"),
    ({"providers": [{"name": "x", "matchImages": [], "defaultCacheDuration": "1h",
                     "apiVersion": "credentialprovider.kubelet.k8s.io/v1"}]}, "providers[0].matchImages"),
    ({"providers": [{"name": "x", "matchImages": ["a"], "defaultCacheDuration": "soon",
                     "apiVersion": "credentialprovider.kubelet.k8s.io/v1"}]}, "providers[0].defaultCacheDuration"),
    ({"providers": [{"name": "x", "matchImages": ["a"], "defaultCacheDuration": "1h",
                     "apiVersion": "v9"}]}, "providers[0].apiVersion"),
])
def test_bad_provider_configs_name_the_key(doc: dict, says: str) -> None:
    base = {"apiVersion": "kubelet.config.k8s.io/v1", "kind": "CredentialProviderConfig"}
    with pytest.raises(ProviderConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_config(json.dumps({**base, **doc}), "p.yaml")


def test_config_keys_are_checked_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({"image_sets": {"credential_provider_config": str(tmp_path / "none.yaml")}})
    assert e.value.key == "image_sets.credential_provider_bin_dir"
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Nope\n")
    with pytest.raises(ConfigError) as e:
        from_dict({"image_sets": {"credential_provider_config": str(bad), "credential_provider_bin_dir": "/x"}})
    assert e.value.key == "image_sets.credential_provider_config" and "CredentialProviderConfig" in str(e.value)


async def test_exec_protocol_match_images_and_registry_cache(tmp_path: Path, bin_dir: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="cri_shim")
    cfg = provider_config(tmp_path, match=["*.private.local", "reg.local:5000/team"],
                          env={"PLUGIN_CACHE_KEY_TYPE": "Registry", "PLUGIN_CACHE_DURATION": "10m"})
    plugins = PluginProviders.from_files(str(cfg), str(bin_dir))
    [(key, cred)] = await plugins.entries("eu.private.local/app:1")
    assert (key, cred.username, cred.password) == ("eu.private.local", "plugin-user", SECRET)
    assert runs(tmp_path)[0] == {"apiVersion": "credentialprovider.kubelet.k8s.io/v1",
                                 "kind": "CredentialProviderRequest", "image": "eu.private.local/app:1"}
    await plugins.entries("eu.private.local/other:2")  # same registry: the cached answer
    assert len(runs(tmp_path)) == 1
    assert await plugins.entries("public.local/app:1") == []  # no pattern matches: not run
    assert await plugins.entries("reg.local:5000/elsewhere/app") == []  # path prefix does not match
    assert len(await plugins.entries("reg.local:5000/team/app")) == 1
    assert len(runs(tmp_path)) == 2
    assert SECRET not in caplog.text and SECRET not in json.dumps(plugins.status())


async def test_cache_duration_zero_runs_the_plugin_each_time(tmp_path: Path, bin_dir: Path) -> None:
    cfg = provider_config(tmp_path, match=["reg.local"], env={"PLUGIN_CACHE_DURATION": "0"})
    plugins = PluginProviders.from_files(str(cfg), str(bin_dir))
    for _ in range(2):
        assert len(await plugins.entries("reg.local/app:1")) == 1
    assert len(runs(tmp_path)) == 2


async def test_default_cache_duration_applies_when_the_answer_has_none(tmp_path: Path, bin_dir: Path) -> None:
    now = [100.0]
    cfg = provider_config(tmp_path, match=["reg.local"], default_cache="30s")
    from shim.credentials.plugins import load_config

    plugins = PluginProviders(load_config(str(cfg)), str(bin_dir), clock=lambda: now[0])
    await plugins.entries("reg.local/app:1")
    now[0] += 29
    await plugins.entries("reg.local/app:1")
    assert len(runs(tmp_path)) == 1
    now[0] += 2
    await plugins.entries("reg.local/app:1")
    assert len(runs(tmp_path)) == 2


@pytest.mark.parametrize("mode, says", [("exit", "exited with status 3"), ("garbage", "answer is not JSON"),
                                        ("wrong-version", "expected 'credentialprovider.kubelet.k8s.io/v1'"),
                                        ("hang", "no answer within 0.5 s; killed")])
async def test_a_failing_plugin_is_logged_without_its_output(tmp_path: Path, bin_dir: Path, caplog, mode: str,
                                                             says: str) -> None:
    caplog.set_level(logging.DEBUG, logger="cri_shim")
    cfg = provider_config(tmp_path, match=["reg.local"], env={"PLUGIN_MODE": mode})
    from shim.credentials.plugins import load_config

    plugins = PluginProviders(load_config(str(cfg)), str(bin_dir), timeout=0.5)
    assert await plugins.entries("reg.local/app:1") == []
    assert says in plugins.status()["fake-provider"]["last_error"]
    assert "credential provider failed" in caplog.text and SECRET not in caplog.text


async def test_a_plugin_that_prints_forever_is_killed_at_the_output_limit(tmp_path: Path, bin_dir: Path,
                                                                         caplog) -> None:
    """Its answer is read as it comes: at MAX_OUTPUT_BYTES the plugin is killed (an endless answer
    would otherwise be read until the timeout, or memory, runs out)."""
    caplog.set_level(logging.DEBUG, logger="cri_shim")
    cfg = provider_config(tmp_path, match=["reg.local"], env={"PLUGIN_MODE": "flood"})
    from shim.credentials.plugins import MAX_OUTPUT_BYTES, load_config

    plugins = PluginProviders(load_config(str(cfg)), str(bin_dir), timeout=120)
    assert await plugins.entries("reg.local/app:1") == []
    assert plugins.status()["fake-provider"]["last_error"] == f"answer larger than {MAX_OUTPUT_BYTES} bytes; killed"
    pid = int((tmp_path / "runs.log.pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)
    assert SECRET not in caplog.text


async def test_a_killed_flood_is_reaped_even_when_its_output_was_not_read(tmp_path: Path) -> None:
    """The CI failure this guards: on a busy machine the flood filled the pipe faster than the
    loop read it, asyncio stopped reading, and wait() after the kill (which also waits for the
    pipes to close) hung until the 120 s timeout. Here nothing is read before the kill."""
    import asyncio

    from shim.credentials import plugins

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys\nwhile True: sys.stdout.buffer.write(b'x' * 65536)",
        stdout=asyncio.subprocess.PIPE)
    await asyncio.sleep(0.5)  # the pipe and asyncio's reader fill; asyncio pauses reading
    async with asyncio.timeout(plugins.REAP_SECONDS):
        await plugins.kill_plugin(proc)
    assert proc.returncode == -9


async def test_prefetch_uses_plugin_credentials(runtime, tmp_path: Path, bin_dir: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="cri_shim")
    store = FakeImages(runtime).install()
    cfg = provider_config(tmp_path, match=["reg.local"])
    sets = tmp_path / "sets"
    sets.mkdir()
    (sets / "a.yaml").write_text(own("warm", ["reg.local/a:1", "reg.local/b:1", "public.local/c:1"]))
    async with image_sets(runtime, sets, max_parallel=1, credential_provider_config=str(cfg),
                          credential_provider_bin_dir=str(bin_dir)) as h:
        await reconciled(h, "warm", 3)
        status = json.dumps(h.status())
    got = {r.image.image: (r.auth.username, r.auth.password) for r in store.pull_requests}
    assert got == {"reg.local/a:1": ("plugin-user", SECRET), "reg.local/b:1": ("plugin-user", SECRET),
                   "public.local/c:1": ("", "")}
    # one lane: b's lookup comes after a's answer, cached for the registry (cacheKeyType Registry)
    assert len(runs(tmp_path)) == 1
    assert SECRET not in caplog.text and SECRET not in status and "fake-provider" in status
