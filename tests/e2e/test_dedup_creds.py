"""One upstream pull per image however it is asked for, and image sets pulled with the
node's credentials, against real containerd and a registry (through a counting proxy).

* Spellings: 12 concurrent pulls of one image in two spellings (``HOST/app`` and
  ``HOST/app:latest``) make one resolve.
* A kubelet-style pull with a pull secret, and a prefetch of the same image declared
  while it runs, make one pull (the prefetch joins; the registry serves each blob once).
* An image set on a password-protected registry fails without credentials and is
  prefetched once the node's config.json has them; the password appears in no log line
  (debug), metric or status.
* The same with a kubelet credential provider plugin (tests/support/credential_plugin.py).
* containerd 2.x: a runtime_handlers rule (and a set's runtimeHandler) route a
  prefetched image to that handler's snapshotter.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shim.proto.runtime.v1 import api_pb2 as pb
from tests.e2e.test_handlers_containerd2 import runtime_used, snapshots
from tests.e2e.test_pull_storm import metric, pool, resolves, results, storm  # noqa: F401 (fixture)
from tests.support import cri
from tests.support.fixtures import AUTH_PASSWORD, AUTH_USER
from tests.support.registry import RegistryWithProxy, free_port
from tests.support.wait import wait_for_blocking as wait_for

pytestmark = pytest.mark.e2e


def status(shim) -> dict:
    out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--admin-socket",
                          shim.config["server"]["admin_socket"]], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def status_texts(shim) -> list[str]:
    outs = []
    for extra in (["--json"], []):
        out = subprocess.run([sys.executable, "-m", "shim", "status", *extra, "--admin-socket",
                              shim.config["server"]["admin_socket"]], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        outs.append(out.stdout)
    return outs


def image_set(path: Path, name: str, images: list[str], handler: str = "") -> None:
    spec = {"images": [{"name": i} for i in images]}
    if handler:
        spec["runtimeHandler"] = handler
    doc = {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name}, "spec": spec}
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def set_state(shim, name: str) -> dict:
    sets = status(shim)["image_sets"].get("sets", {})
    return sets.get(name, {})


def docker_config(path: Path, host: str, user: str, password: str) -> None:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"auths": {f"http://{host}": {"auth": auth}}}))
    tmp.replace(path)


def test_two_spellings_of_one_image_make_one_resolve(containerd, shim_factory, make_image, proxy,
                                                      pool: ThreadPoolExecutor) -> None:
    img = make_image(tag="latest", filler_bytes=200_000)
    port = free_port()
    shim = shim_factory({"pulls": {"max_parallel": 4}, "metrics": {"address": f"127.0.0.1:{port}"}})
    wait_for(lambda: _answers(port), 10, "the metrics endpoint")
    spellings = [img.repo_ref, img.ref]  # HOST/repo and HOST/repo:latest
    proxy.hold_blobs()
    calls = storm(pool, shim.socket, [cri.pull_image_request(spellings[i % 2]) for i in range(12)])
    try:
        wait_for(lambda: metric(port, "cri_shim_pull_requests_total") >= 12, timeout=20.0, what="12 pulls at the shim")
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
    finally:
        proxy.release_blobs()
    answers = results(calls)
    assert all(r.ok for r in answers), [r.error_tuple() for r in answers if not r.ok]
    assert len({r.response for r in answers}) == 1
    print(f"\n12 pulls in 2 spellings through the shim: {resolves(proxy, img)} resolve(s), "
          f"{proxy.stats().blob_requests} blob GETs for {len(img.image.blobs)} blobs")
    assert resolves(proxy, img) == 1
    assert metric(port, "cri_shim_pull_dedup_joins_total") == 11
    assert proxy.stats().blob_bytes == img.image.size


def _answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
    except OSError:
        return False
    return True


def test_kubelet_pull_with_a_pull_secret_and_a_prefetch_declared_meanwhile_make_one_pull(
        containerd, shim_factory, make_image, auth_registry: RegistryWithProxy, tmp_path,
        pool: ThreadPoolExecutor) -> None:
    img = make_image(registry=auth_registry, filler_bytes=200_000)
    proxy = auth_registry.proxy
    assert proxy is not None
    proxy.reset()
    sets, creds = tmp_path / "sets", tmp_path / "config.json"
    sets.mkdir()
    docker_config(creds, auth_registry.host, AUTH_USER, AUTH_PASSWORD)  # the node's own credentials
    port = free_port()
    shim = shim_factory({"image_sets": {"dir": str(sets), "debounce_seconds": 0.05, "docker_config": [str(creds)]},
                         "metrics": {"address": f"127.0.0.1:{port}"}})
    wait_for(lambda: _answers(port), 10, "the metrics endpoint")
    kubelet_req = pb.PullImageRequest(image=pb.ImageSpec(image=img.ref),
                                      auth=pb.AuthConfig(username=AUTH_USER, password=AUTH_PASSWORD))
    kubelet_req.sandbox_config.metadata.CopyFrom(pb.PodSandboxMetadata(name="web", uid="uid-web", namespace="default"))
    proxy.hold_blobs()
    try:
        [kubelet] = storm(pool, shim.socket, [kubelet_req.SerializeToString()])
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
        image_set(sets / "warm.yaml", "warm", [img.ref])  # declared while kubelet's pull runs
        wait_for(lambda: metric(port, "cri_shim_pull_dedup_joins_total") == 1, timeout=20.0,
                 what="the prefetch to join")
        running = status(shim)["pulls"]["in_flight"]
        assert [r["waiters"] for r in running] == [2]
    finally:
        proxy.release_blobs()
    [answer] = results([kubelet])
    assert answer.ok, answer.error_tuple()
    wait_for(lambda: set_state(shim, "warm").get("present") == 1, timeout=20.0, what="the set present")
    stats = proxy.stats()
    print(f"\nkubelet pull + prefetch of the same image: {resolves(proxy, img)} resolve(s), "
          f"{metric(port, 'cri_shim_pulls_total')} upstream pull(s), {stats.blob_requests} blob GETs "
          f"for {len(img.image.blobs)} blobs")
    assert resolves(proxy, img) == 1
    assert metric(port, "cri_shim_pulls_total") == 1
    assert stats.blob_bytes == img.image.size


def test_image_set_on_a_private_registry_uses_config_json_and_shows_no_password(
        containerd, shim_factory, make_image, auth_registry: RegistryWithProxy, tmp_path) -> None:
    img = make_image(registry=auth_registry)
    sets, creds = tmp_path / "sets", tmp_path / "config.json"
    sets.mkdir()
    port = free_port()
    shim = shim_factory({"image_sets": {"dir": str(sets), "debounce_seconds": 0.05, "docker_config": [str(creds)],
                                        "retry_initial_seconds": 0.2, "retry_max_seconds": 0.5},
                         "metrics": {"address": f"127.0.0.1:{port}"}}, log_level="debug")
    image_set(sets / "private.yaml", "private", [img.ref])
    # no credentials on the node yet: the registry refuses the prefetch
    wait_for(lambda: set_state(shim, "private").get("failed") == 1, timeout=20.0,
             what="the anonymous prefetch to fail")
    failed_error = set_state(shim, "private")["last_error"]
    docker_config(creds, auth_registry.host, AUTH_USER, AUTH_PASSWORD)  # now it has them: read on the next try
    wait_for(lambda: set_state(shim, "private").get("present") == 1, timeout=20.0, what="the set present")
    print(f"\nwithout config.json: {failed_error!r}; with it: present")
    st = status(shim)["image_sets"]
    assert st["credentials"]["docker_config"][str(creds)]["registries"] == [f"http://{auth_registry.host}"]
    texts = status_texts(shim)
    metrics_text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    log = shim.log_text()
    assert "image set pull done" in log  # a debug-level line: the log was written at debug
    encoded = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()
    for where, text in [("log", log), ("metrics", metrics_text), ("status --json", texts[0]), ("status", texts[1])]:
        assert AUTH_PASSWORD not in text, where
        assert encoded not in text, where
    assert "registry credentials read" in log


def test_a_rule_routes_a_prefetched_image_to_its_handlers_snapshotter(ctrd2, shim_factory, make_image,  # noqa: F811
                                                                      registry, tmp_path) -> None:
    by_rule, by_set, plain = make_image(), make_image(), make_image()
    sets = tmp_path / "sets"
    sets.mkdir()
    shim = shim_factory({"runtime_handlers": {"rules": [{"handler": "fast", "images": [f"{by_rule.repo_ref}:*"]}]},
                         "image_sets": {"dir": str(sets), "debounce_seconds": 0.05}}, upstream=ctrd2.socket)
    image_set(sets / "a.yaml", "a", [by_rule.ref, plain.ref])
    image_set(sets / "b.yaml", "b", [by_set.ref], handler="fast")
    wait_for(lambda: set_state(shim, "a").get("present") == 2 and set_state(shim, "b").get("present") == 1, timeout=60,
             what="both sets present")
    assert runtime_used(ctrd2, by_rule.ref) == "fast, using snapshotter overlayfs"
    assert runtime_used(ctrd2, by_set.ref) == "fast, using snapshotter overlayfs"
    assert runtime_used(ctrd2, plain.ref) is None  # no rule, no handler: the default snapshotter
    assert snapshots(ctrd2, "overlayfs") > 0 and snapshots(ctrd2, "native") > 0
    assert "handler_source=runtime_handlers.rules[0]" in shim.log_text()


def test_image_set_on_a_private_registry_with_a_credential_provider_plugin(
        containerd, shim_factory, make_image, auth_registry: RegistryWithProxy, tmp_path) -> None:
    img = make_image(registry=auth_registry)
    sets, bin_dir = tmp_path / "sets", tmp_path / "bin"
    sets.mkdir()
    bin_dir.mkdir()
    plugin = Path(__file__).parent.parent / "support" / "credential_plugin.py"
    exe = bin_dir / "test-provider"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {plugin} \"$@\"\n")
    exe.chmod(0o755)
    runs = tmp_path / "runs.log"
    providers = tmp_path / "providers.yaml"
    providers.write_text(json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1", "kind": "CredentialProviderConfig", "providers": [{
            "name": "test-provider", "matchImages": [auth_registry.host], "defaultCacheDuration": "10m",
            "apiVersion": "credentialprovider.kubelet.k8s.io/v1", "args": ["--user", AUTH_USER],
            "env": [{"name": "PLUGIN_RUNS", "value": str(runs)}, {"name": "PLUGIN_PASSWORD", "value": AUTH_PASSWORD}],
        }]}))
    port = free_port()
    shim = shim_factory({"image_sets": {"dir": str(sets), "debounce_seconds": 0.05, "docker_config": [],
                                        "credential_provider_config": str(providers),
                                        "credential_provider_bin_dir": str(bin_dir)},
                         "metrics": {"address": f"127.0.0.1:{port}"}}, log_level="debug")
    image_set(sets / "private.yaml", "private", [img.ref])
    wait_for(lambda: set_state(shim, "private").get("present") == 1, timeout=20.0, what="the set present")
    assert [json.loads(line)["image"] for line in runs.read_text().splitlines()] == [img.ref]
    texts = status_texts(shim)
    metrics_text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for where, text in [("log", shim.log_text()), ("metrics", metrics_text), ("status --json", texts[0]),
                        ("status", texts[1])]:
        assert AUTH_PASSWORD not in text, where
    assert "test-provider" in texts[0]
