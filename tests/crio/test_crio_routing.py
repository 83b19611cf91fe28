"""The method-spelling table against CRI-O (grpc-go 1.72: a path without the leading ``/``
is routed; no runtime.v1alpha2): every spelling CRI-O routes to RemoveImage or PullImage
is enforced through the shim (tests/support/routing_table.py)."""

from __future__ import annotations

import pytest

from tests.support import routing_table
from tests.support.crio import Crio

pytestmark = pytest.mark.crio


@pytest.mark.parametrize("engine", ["relay", "grpc"])
def test_remove_pinned_image_under_every_spelling(crio: Crio, make_image, shim_factory, engine) -> None:
    routing_table.remove_pinned_table(str(crio.socket), shim_factory, make_image, engine)


@pytest.mark.parametrize("engine", ["relay", "grpc"])
def test_pull_under_every_spelling_goes_through_the_scheduler(crio: Crio, make_image, shim_factory, engine) -> None:
    routing_table.pull_table(str(crio.socket), shim_factory, make_image, engine)


@pytest.mark.parametrize("engine", ["relay", "grpc"])
def test_removal_by_one_tag_leaves_what_crio_leaves(crio: Crio, make_image, registry, shim_factory, engine) -> None:
    assert routing_table.assert_removal_by_tag_as_the_runtime_does(
        str(crio.socket), shim_factory, make_image, registry, engine) == ["v2"]  # CRI-O untags only
