"""What a shim at rest holds in memory: with the default config it does not load the
Kubernetes client (about 45 MiB), the OpenTelemetry SDK and OTLP exporters, nor image sets
and the credential readers; each comes in when the setting that needs it is there.

The shim runs as on a node (``cri-shim serve``'s startup path), through
tests/support/loaded_modules.py, which writes ``sys.modules`` when the process exits after
SIGTERM. The RSS figures are bench/idle_memory.py's (docs/performance.md, "Memory at rest").
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from tests.support.fake_runtime import FakeRuntime
from tests.support.loaded_modules import ENV, loaded
from tests.support.shim import ShimProcess
from tests.support.slow_pulls import VERSION

ONLY_WHEN_CONFIGURED = {
    "kubernetes_asyncio": "cluster.kubeconfig",
    "aiohttp": "cluster.kubeconfig",
    "shim.cluster": "cluster.kubeconfig",
    "opentelemetry.sdk": "tracing (OTEL_*)",
    "opentelemetry.exporter.otlp.proto.grpc": "tracing (OTEL_*)",
    "shim.imagesets": "image_sets.dir or cluster.kubeconfig",
    "shim.credentials": "image_sets.dir or cluster.kubeconfig",
}


async def _modules_after_a_call(runtime: FakeRuntime, workdir: Path, config: dict, env: dict[str, str]) -> set[str]:
    """Start the shim, make one call through it, stop it (SIGTERM): the modules it had loaded."""
    runtime.unary[VERSION] = b"\x0a\x050.1.0"
    out = workdir / "modules.txt"
    shim = ShimProcess(workdir, upstream=runtime.endpoint, config=config, log_level="info",
                       module="tests.support.loaded_modules", env={ENV: str(out), **env})
    await shim.astart()
    try:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"\x0a\x050.1.0"
    finally:
        assert await shim.astop() == 0, shim.log_tail()
    return loaded(out)


def _present(modules: set[str], package: str) -> bool:
    return any(m == package or m.startswith(package + ".") for m in modules)


async def test_default_config_loads_no_cluster_tracing_or_image_set_libraries(runtime: FakeRuntime,
                                                                               tmp_path: Path) -> None:
    modules = await _modules_after_a_call(runtime, tmp_path, {}, {})
    assert "shim.relay.listener" in modules and "grpc" in modules  # the list is the serving process's
    loaded_anyway = {p: why for p, why in ONLY_WHEN_CONFIGURED.items() if _present(modules, p)}
    assert not loaded_anyway, f"loaded without the setting that needs them: {loaded_anyway}"


async def test_each_library_comes_with_its_setting(runtime: FakeRuntime, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({  # an API server that refuses connections: the watch retries
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    config = {"cluster": {"kubeconfig": str(kubeconfig), "state_file": str(tmp_path / "cluster-sets.json")}}
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    modules = await _modules_after_a_call(runtime, tmp_path, config, env)
    missing = {p: why for p, why in ONLY_WHEN_CONFIGURED.items() if not _present(modules, p)}
    assert not missing, f"not loaded although configured: {missing}"
