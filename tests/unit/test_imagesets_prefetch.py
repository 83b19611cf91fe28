"""Image-set prefetch as the pod would pull: with the image's runtime handler (declared
or from runtime_handlers.rules), with the node's config.json credentials (never shown),
joined with a CRI client's pull of the same image, and never stuck on a hung runtime."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path

import grpc
import pytest

from shim.config import HandlerRule, ImageSetsConfig, RuntimeHandlersConfig
from shim.credentials.dockerconfig import DockerConfigFiles
from shim.credentials.keyring import Credential
from shim.credentials.prefetch import PrefetchCredentials
from shim.errors import RpcError
from shim.imagesets.prefetch import Prefetch
from shim.imagesets.table import DeclaredImage
from shim.observability.metrics import Metrics
from shim.pulls.scheduler import PullScheduler
from shim.runtime_handlers.resolver import HandlerResolver
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.key import pull_key
from shim.pulls.scheduler import Priority
from tests.support.prefetch_store import FakeImages
from tests.unit.test_imagesets import image_sets, own, reconciled
from tests.support.wait import wait_for

SECRET = "pw-prefetch-5e2a91"


@pytest.fixture
def store(runtime) -> FakeImages:
    return FakeImages(runtime).install()


def by_image(store: FakeImages) -> dict[str, api_pb2.PullImageRequest]:
    return {r.image.image: r for r in store.pull_requests}


async def test_declared_handlers_and_rules_reach_the_runtime_with_a_pod(runtime, store, tmp_path) -> None:
    (tmp_path / "own.yaml").write_text(
        "apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: own}\nspec:\n  runtimeHandler: kata\n"
        "  images:\n  - name: reg.local/a:1\n  - name: reg.local/b:1\n    runtimeHandler: gvisor\n"
        "  - name: reg.local/gpu/c:1\n  - name: reg.local/a:1\n    runtimeHandler: gvisor\n")
    (tmp_path / "mco.yaml").write_text(
        "apiVersion: machineconfiguration.openshift.io/v1\nkind: PinnedImageSet\n"
        "metadata:\n  name: mco\n  annotations: {cri-shim.io/runtime-handler: fast}\n"
        "spec:\n  pinnedImages:\n  - name: reg.local/d:1\n")
    (tmp_path / "plain.yaml").write_text(own("plain", ["reg.local/gpu/e:1", "reg.local/f:1"]))
    resolver = HandlerResolver(None, RuntimeHandlersConfig(rules=(  # type: ignore[arg-type]
        HandlerRule(handler="pod-only", namespaces=("batch",)),  # needs a pod: never for prefetch
        HandlerRule(handler="nvidia", images=("reg.local/gpu/*",)),
    )))
    async with image_sets(runtime, tmp_path, options={"handler_for": resolver.for_prefetch}) as h:
        await reconciled(h, "own", 4)
        await reconciled(h, "mco", 1)
        await reconciled(h, "plain", 2)
        assert h.set_status("own")["runtime_handlers"] == ["gvisor", "kata"]
        assert h.set_status("mco")["runtime_handlers"] == ["fast"] and "runtime_handlers" not in h.set_status("plain")
    got = sorted((r.image.image, r.image.runtime_handler, r.HasField("sandbox_config")) for r in store.pull_requests)
    assert got == [("reg.local/a:1", "gvisor", True), ("reg.local/a:1", "kata", True),
                   ("reg.local/b:1", "gvisor", True), ("reg.local/d:1", "fast", True),
                   ("reg.local/f:1", "", False),
                   ("reg.local/gpu/c:1", "kata", True),  # the set's handler wins over a rule
                   ("reg.local/gpu/e:1", "nvidia", True)]


@pytest.mark.parametrize("text, says", [
    ("spec:\n  runtimeHandler: 5\n  images: []\n", "spec.runtimeHandler: expected a runtime handler name"),
    ("spec:\n  images:\n  - {name: a:1, handler: x}\n", "spec.images[0].handler: unknown key"),
])
def test_bad_handler_declarations_name_the_key(text: str, says: str) -> None:
    from shim.imagesets.loader import SetFileError, parse_text

    with pytest.raises(SetFileError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_text("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: s}\n" + text, "f.yaml")


def docker_config(path: Path, auths: dict[str, dict[str, str]]) -> None:
    path.write_text(json.dumps({"auths": auths}))


async def test_config_json_credentials_are_used_and_shown_nowhere(runtime, store, tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="cri_shim")
    sets, creds = tmp_path / "sets", tmp_path / "config.json"
    sets.mkdir()
    docker_config(creds, {"https://private.local:5000": {"auth": base64.b64encode(f"robot:{SECRET}".encode()).decode()},
                          "*.mirror.local": {"username": "m", "password": SECRET}})
    (sets / "a.yaml").write_text(own("warm", ["private.local:5000/app:1", "eu.mirror.local/x:1", "public.local/y:1"]))
    async with image_sets(runtime, sets, docker_config=(str(tmp_path / "missing.json"), str(creds))) as h:
        await reconciled(h, "warm", 3)
        status = json.dumps(h.status())
    reqs = by_image(store)
    assert (reqs["private.local:5000/app:1"].auth.username, reqs["private.local:5000/app:1"].auth.password) == \
        ("robot", SECRET)
    assert reqs["eu.mirror.local/x:1"].auth.username == "m"
    assert not reqs["public.local/y:1"].HasField("auth")  # no entry: anonymous
    assert SECRET not in caplog.text and SECRET not in status
    assert base64.b64encode(f"robot:{SECRET}".encode()).decode() not in caplog.text
    assert "private.local:5000" in status  # which registries have credentials is shown


async def test_each_matching_credential_is_tried_most_specific_first(runtime, store, tmp_path) -> None:
    sets, creds = tmp_path / "sets", tmp_path / "config.json"
    sets.mkdir()
    docker_config(creds, {"reg.local": {"username": "host", "password": SECRET},
                          "reg.local/team": {"username": "team", "password": SECRET}})
    store.fail("reg.local/team/app:1", 1, grpc.StatusCode.UNKNOWN)  # the first try (team) is refused
    (sets / "a.yaml").write_text(own("warm", ["reg.local/team/app:1"]))
    async with image_sets(runtime, sets, docker_config=(str(creds),)) as h:
        s = await reconciled(h, "warm", 1)
    assert [r.auth.username for r in store.pull_requests] == ["team", "host"]
    assert s["failed"] == 0


class RefusingRuntime:
    """A runtime that refuses the first pull once ``refuse`` is set, and takes the next ones."""

    def __init__(self) -> None:
        self.requests: list[api_pb2.PullImageRequest] = []
        self.refuse = asyncio.Event()

    async def unary(self, method: str, request: bytes, **kw: object) -> bytes:
        self.requests.append(api_pb2.PullImageRequest.FromString(request))
        if len(self.requests) == 1:
            await self.refuse.wait()
            raise RpcError(grpc.StatusCode.UNKNOWN, "fake registry: unauthorized", from_upstream=True)
        return api_pb2.PullImageResponse(image_ref="sha256:" + "ab" * 32).SerializeToString()


@pytest.mark.parametrize("change", ["recreated", "removed"])
async def test_the_next_credential_is_that_of_the_images_sets_as_they_are_then(change: str) -> None:
    """An image of sets a and b: the first try (a's pull secret) is refused after b was deleted and
    created again (a new object, a new secret), or removed: the next try carries the new object's
    secret, or none is left to try; the deleted object's secret is never sent. Found by the
    reconciler's limits machine (tests/unit/test_reconciler_limits_machine.py)."""
    secrets = {"a": "a-uid1", "b": "b-uid1"}

    def set_credentials(names: frozenset[str]) -> list[tuple[str, Credential]]:
        return [("reg.local", Credential(f"set {n}", username=secrets[n], password=SECRET)) for n in sorted(names)]

    upstream, metrics = RefusingRuntime(), Metrics()
    prefetch = Prefetch(ImageSetsConfig(), upstream, PullScheduler(4, 4, observers=[metrics]),  # type: ignore[arg-type]
                        PrefetchCredentials(DockerConfigFiles(()), set_credentials), metrics)
    img = DeclaredImage("reg.local/app:1", "reg.local/app:1", ("a", "b"))
    task = asyncio.get_running_loop().create_task(prefetch.pull(img))
    await wait_for(lambda: len(upstream.requests) == 1, 5, "first try")
    if change == "recreated":
        secrets["b"] = "b-uid2"
    else:
        img.sets = ("a",)
    upstream.refuse.set()
    pulled = await task
    users = [r.auth.username for r in upstream.requests]
    if change == "recreated":
        assert users == ["a-uid1", "b-uid2"] and pulled.error is None
    else:
        assert users == ["a-uid1"] and pulled.error is not None and pulled.error.code is grpc.StatusCode.UNKNOWN


async def test_rotated_credentials_are_used_by_the_next_pull(runtime, store, tmp_path) -> None:
    sets, creds = tmp_path / "sets", tmp_path / "config.json"
    sets.mkdir()
    docker_config(creds, {"reg.local": {"username": "old", "password": SECRET}})
    (sets / "a.yaml").write_text(own("warm", ["reg.local/a:1"]))
    async with image_sets(runtime, sets, docker_config=(str(creds),)) as h:
        await reconciled(h, "warm", 1)
        docker_config(creds, {"reg.local": {"username": "new", "password": SECRET}})
        (sets / "a.yaml").write_text(own("warm", ["reg.local/a:1", "reg.local/b:1"]))
        await reconciled(h, "warm", 2)
    assert [(r.image.image, r.auth.username) for r in store.pull_requests] == [("reg.local/a:1", "old"),
                                                                              ("reg.local/b:1", "new")]


async def test_prefetch_joins_a_kubelet_pull_with_a_pull_secret(runtime, store, tmp_path) -> None:
    gate = store.hold("reg.local/app:1")
    async with image_sets(runtime, tmp_path) as h:
        kubelet_req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="reg.local/app:1"),
                                               auth=api_pb2.AuthConfig(username="pod", password=SECRET))

        async def kubelet_run() -> bytes:
            return await h.upstream.unary("/runtime.v1.ImageService/PullImage", kubelet_req.SerializeToString())

        kubelet = asyncio.ensure_future(h.scheduler.pull(pull_key(kubelet_req, ""), kubelet_run,
                                                         priority=Priority.FOREGROUND))
        await wait_for(lambda: store.pulls == ["reg.local/app:1"])
        (tmp_path / "a.yaml").write_text(own("warm", ["reg.local/app:1"]))  # declared while kubelet pulls
        await wait_for(lambda: h.set_status("warm")["pulling"] == 1 if "warm" in h.status()["sets"] else False)
        gate.set()
        await reconciled(h, "warm", 1)
        assert (await kubelet).response
    assert store.pulls == ["reg.local/app:1"]  # one pull upstream: the prefetch joined kubelet's


async def test_a_hung_list_images_is_a_failed_list_not_a_stuck_loop(runtime, store, tmp_path) -> None:
    store.list_gate = asyncio.Event()  # ListImages never answers until set
    (tmp_path / "a.yaml").write_text(own("warm", ["reg.local/a:1"]))
    async with image_sets(runtime, tmp_path, runtime_timeout_seconds=0.2) as h:
        await wait_for(lambda: "DEADLINE_EXCEEDED" in h.status()["runtime_error"], what="ListImages deadline")
        lists = store.lists
        await wait_for(lambda: store.lists > lists, what="a retried ListImages")  # the loop goes on
        store.list_gate.set()
        await reconciled(h, "warm", 1)
        assert h.status()["runtime_error"] == ""


async def test_a_hung_image_fs_info_does_not_stop_reconciling(runtime, store, tmp_path) -> None:
    hang = asyncio.Event()

    async def fs_info(request: bytes, context) -> bytes:
        await hang.wait()
        return b""
    runtime.unary["/runtime.v1.ImageService/ImageFsInfo"] = fs_info
    (tmp_path / "a.yaml").write_text(own("warm", ["reg.local/a:1"]))
    async with image_sets(runtime, tmp_path, runtime_timeout_seconds=0.2, min_free_bytes=1) as h:
        await wait_for(lambda: "ImageFsInfo failed: DEADLINE_EXCEEDED" in h.status()["disk"]["blocked"],
                         what="the disk guard to say why")
        assert store.pulls == []  # the guard holds the pull: free space is unknown
        hang.set()
        store.install()  # a runtime that answers again
        h.sets.reconciler.runtime.resync_seconds = 0.05
        h.sets.resync()
        await reconciled(h, "warm", 1)


async def test_a_reload_that_changes_docker_config_is_used_by_the_next_pull(runtime, store, tmp_path) -> None:
    import dataclasses

    sets, one, two = tmp_path / "sets", tmp_path / "one.json", tmp_path / "two.json"
    sets.mkdir()
    docker_config(one, {"reg.local": {"username": "one", "password": SECRET}})
    docker_config(two, {"reg.local": {"username": "two", "password": SECRET}})
    (sets / "a.yaml").write_text(own("warm", ["reg.local/a:1"]))
    async with image_sets(runtime, sets, docker_config=(str(one),)) as h:
        await reconciled(h, "warm", 1)
        h.sets.configure(dataclasses.replace(h.sets.cfg, docker_config=(str(two),)))
        (sets / "a.yaml").write_text(own("warm", ["reg.local/a:1", "reg.local/b:1"]))
        await reconciled(h, "warm", 2)
        assert list(h.status()["credentials"]["docker_config"]) == [str(two)]
    assert [r.auth.username for r in store.pull_requests] == ["one", "two"]
