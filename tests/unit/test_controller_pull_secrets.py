"""shim/controller/pull_secrets.py: which Secrets nodes may read, from the sets' imagePullSecrets."""

from __future__ import annotations

from typing import Any, AsyncIterator

import pytest
from kubernetes_asyncio.client import ApiClient

from shim.controller.pull_secrets import PullSecretRoles, role, wanted


def image_set(name: str, *refs: tuple[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"imagePullSecrets": [{"namespace": ns, "name": n} for ns, n in refs]}}


@pytest.fixture
async def r() -> AsyncIterator[PullSecretRoles]:
    api = ApiClient()  # never called: only the bookkeeping is exercised here (tests/cluster: the API)
    out = PullSecretRoles(api)
    out.dirty = False  # as after a sync
    yield out
    await api.close()


def test_names_by_namespace_from_every_set(r: PullSecretRoles) -> None:
    r.set_changed("a", image_set("a", ("team", "pull"), ("infra", "mirror")))
    r.set_changed("b", image_set("b", ("team", "pull"), ("team", "extra")))
    assert r.dirty
    assert wanted(r.refs) == {"team": ("extra", "pull"), "infra": ("mirror",)}
    r.dirty = False
    r.set_changed("b", image_set("b", ("team", "extra"), ("team", "pull")))  # same Secrets, reordered
    assert not r.dirty
    r.set_changed("a", None)  # deleted
    assert r.dirty and wanted(r.refs) == {"team": ("extra", "pull")}


def test_an_unreadable_version_keeps_the_last_references(r: PullSecretRoles) -> None:
    r.set_changed("a", image_set("a", ("team", "pull")))
    r.dirty = False
    r.set_changed("a", {"metadata": {"name": "a"}, "spec": {"imagePullSecrets": [{"name": "no-namespace"}]}})
    assert not r.dirty and wanted(r.refs) == {"team": ("pull",)}


def test_relist_forgets_sets_gone_meanwhile(r: PullSecretRoles) -> None:
    r.set_changed("a", image_set("a", ("team", "pull")))
    r.set_changed("gone", image_set("gone", ("old", "s")))
    r.relisted({"a": image_set("a", ("team", "pull"))})
    assert wanted(r.refs) == {"team": ("pull",)}


def test_a_role_never_names_no_secret() -> None:
    assert role("team", ("pull",))["rules"][0]["resourceNames"] == ["pull"]
    with pytest.raises(AssertionError):
        role("team", ())  # an empty resourceNames would grant every Secret
