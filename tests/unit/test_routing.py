"""Routing (shim/cri/routing.py): every spelling the runtime routes to an intercepted method is
intercepted, runtime.v1alpha2 is refused as containerd 2.x refuses it, and only CRI and
gRPC health pass by default; ``server.allowed_services`` opens other services.
The e2e table (tests/e2e/test_routing_e2e.py) checks the same against real runtimes."""

from __future__ import annotations

import functools
from pathlib import Path

import grpc
import pytest
import yaml

from shim import config as config_mod
from shim.config import ConfigError
from shim.cri import routing
from shim.cri.routing import Intercept, Refusal, Router
from tests.support import cri
from tests.support.fake_images import SVC, FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim
from tests.unit.test_pins_rpc import remove_request

REMOVE = SVC + "RemoveImage"
PULL = SVC + "PullImage"
CTR_DELETE = "/containerd.services.images.v1.Images/Delete"


def router(*allowed: str) -> Router[str]:
    return Router({REMOVE: "remove", PULL: "pull"}, allowed)


@pytest.mark.parametrize("path", [REMOVE, REMOVE[1:]])
def test_every_spelling_grpc_go_routes_is_intercepted(path: str) -> None:
    assert router().route(path) == Intercept(REMOVE, "remove")


@pytest.mark.parametrize("path", [
    "/runtime.v1.ImageService/ImageFsInfo",
    "/runtime.v1.RuntimeService/SomeFutureMethod",  # unknown to us: still CRI
    "runtime.v1.RuntimeService/GetContainerEvents",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "//runtime.v1.ImageService/RemoveImage",  # service "/runtime.v1.ImageService": no runtime serves it...
])
def test_cri_and_health_pass(path: str) -> None:
    r = router().route(path)
    if path.startswith("//"):  # ...and it is not CRI either
        assert isinstance(r, Refusal) and r.code is grpc.StatusCode.PERMISSION_DENIED
    else:
        assert r is None


@pytest.mark.parametrize("path", ["/runtime.v1alpha2.ImageService/RemoveImage", "runtime.v1alpha2.ImageService/PullImage",
                                  "/runtime.v1alpha2.RuntimeService/Version"])
def test_v1alpha2_is_unimplemented_as_containerd_2_answers(path: str) -> None:
    service = path.lstrip("/").rpartition("/")[0]
    assert router("containerd.*").route(path) == Refusal(grpc.StatusCode.UNIMPLEMENTED, f"unknown service {service}")


@pytest.mark.parametrize("path", [CTR_DELETE, "/containerd.services.introspection.v1.Introspection/Server",
                                  "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "/x.y/Z",
                                  "containerd.services.images.v1.Images/Delete"])
def test_other_services_are_refused_naming_the_key(path: str) -> None:
    r = router().route(path)
    assert isinstance(r, Refusal) and r.code is grpc.StatusCode.PERMISSION_DENIED
    assert "server.allowed_services" in r.message and "is not a CRI service" in r.message


def test_allowed_services_exact_and_prefix() -> None:
    assert router("containerd.services.version.v1.Version").route("/containerd.services.version.v1.Version/Version") is None
    assert isinstance(router("containerd.services.version.v1.Version").route(CTR_DELETE), Refusal)
    assert router("containerd.services.*").route(CTR_DELETE) is None
    assert isinstance(router("containerd.services.*").route("/containerd.servicesX.a/B"), Refusal)


@pytest.mark.parametrize("path", ["runtime.v1.ImageService", "/", "/" + "x" * 10_000])
def test_malformed_path_is_unimplemented_with_a_short_quote(path: str) -> None:
    r = router().route(path)
    assert isinstance(r, Refusal) and r.code is grpc.StatusCode.UNIMPLEMENTED
    assert r.message.startswith("malformed method name: ") and len(r.message) < 200


def test_remembered_decisions_follow_a_new_table_or_allowlist_at_once() -> None:
    r = router()
    for _ in range(2):  # the second answer comes from the memo
        assert r.route(REMOVE[1:]) == Intercept(REMOVE, "remove")
        assert isinstance(r.route(CTR_DELETE), Refusal)
    r.set_table({PULL: "pull"})
    assert r.route(REMOVE[1:]) is None  # relayed now: no stale interception
    r.set_allowed_services(["containerd.services.images.v1.Images"])
    assert r.route(CTR_DELETE) is None
    r.set_allowed_services([])
    assert isinstance(r.route(CTR_DELETE), Refusal)


def test_the_memo_is_bounded_by_paths_and_their_length() -> None:
    r = router()
    for i in range(routing.MEMO_ENTRIES * 3):
        assert r.route(f"/runtime.v1.RuntimeService/Method{i}") is None
    long = "/runtime.v1.RuntimeService/" + "x" * routing.MEMO_PATH_MAX
    assert r.route(long) is None
    assert len(r.remembered()) <= routing.MEMO_ENTRIES and long not in r.remembered()
    assert r.route(REMOVE) == Intercept(REMOVE, "remove")  # still decided right after a clear


@pytest.mark.parametrize("entry", ["runtime.v1alpha2.ImageService", "runtime.v1alpha2.*", "runtime.*", "*",
                                   "a/b", "", "containerd services", "containerd.*.images"])
def test_bad_allowed_services_entry_is_refused_naming_the_key(entry: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_mod.from_dict({"server": {"allowed_services": [entry]}})
    assert e.value.key == "server.allowed_services"


# --------------------------------------------------------------------------- through the shim, both engines


@pytest.fixture(params=["relay", "grpc"])
def serve(request):
    return functools.partial(running_shim, engine=request.param)


@pytest.fixture
def store(runtime: FakeRuntime) -> FakeImageStore:
    s = FakeImageStore([StoredImage(image_id(1), ["docker.io/library/nginx:latest"], [])])
    s.install(runtime)
    return s


async def test_pinned_image_refused_under_every_spelling(serve, runtime, store) -> None:
    async with serve(runtime.endpoint, {"pins": {"images": ["nginx"]}}) as shim:
        for path in (REMOVE, REMOVE[1:]):
            res = await cri.acall(shim.path, path, remove_request("nginx"), timeout=5)
            assert res.code is grpc.StatusCode.FAILED_PRECONDITION, (path, res)
        v1alpha2 = await cri.acall(shim.path, "/runtime.v1alpha2.ImageService/RemoveImage", remove_request("nginx"), 5)
        assert v1alpha2.code is grpc.StatusCode.UNIMPLEMENTED, v1alpha2
    assert runtime.calls("RemoveImage") == []
    assert store.resolve(image_id(1)) is not None


async def test_an_intercepted_call_reaches_the_runtime_under_the_clients_spelling(serve, runtime, store) -> None:
    """Checked under the routed name, sent on as spelled: the runtime answers the spelling as it would."""
    async with serve(runtime.endpoint, {"pins": {"images": ["quay.io/*"]}}) as shim:
        assert (await cri.acall(shim.path, PULL[1:], cri.pull_image_request("nginx"), timeout=5)).ok
        assert (await cri.acall(shim.path, REMOVE[1:], remove_request("nginx"), timeout=5)).ok
    assert [c.method for c in runtime.received if "ImageService" in c.method and "ImageStatus" not in c.method] \
        == [PULL[1:], REMOVE[1:]]


async def test_other_services_refused_until_allowed_by_reload(serve, runtime, tmp_path: Path) -> None:
    runtime.unary[CTR_DELETE] = b""
    cfg = tmp_path / "config.yaml"
    cfg.write_text("{}")
    async with serve(runtime.endpoint, config_path=str(cfg)) as shim:
        refused = await cri.acall(shim.path, CTR_DELETE, b"", timeout=5)
        assert refused.code is grpc.StatusCode.PERMISSION_DENIED and "server.allowed_services" in refused.details
        assert runtime.calls("Delete") == []
        cfg.write_text(yaml.safe_dump({"server": {"allowed_services": ["containerd.services.*"]}}))
        await shim.server.reload(shim.app, "SIGHUP")
        assert (await cri.acall(shim.path, CTR_DELETE, b"", timeout=5)).ok
        assert len(runtime.calls("Delete")) == 1
