"""Tests for shim.methods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shim.cri.methods import KNOWN_METHODS, Cardinality, canonical, cardinality
from shim.proto.runtime.v1 import api_pb2

PROTO = Path(__file__).resolve().parents[2] / "proto" / "runtime" / "v1" / "api.proto"


def test_known_cardinalities() -> None:
    assert cardinality("/runtime.v1.RuntimeService/Version") is Cardinality.UNARY
    assert cardinality("/runtime.v1.RuntimeService/GetContainerEvents") is Cardinality.SERVER_STREAM
    assert cardinality("/runtime.v1.ImageService/PullImage") is Cardinality.UNARY
    assert cardinality("/runtime.v1.ImageService/StreamImages") is Cardinality.SERVER_STREAM
    assert cardinality("/runtime.v1.RuntimeService/StreamPodSandboxes") is Cardinality.SERVER_STREAM


def test_unknown_method_is_none() -> None:
    assert cardinality("/runtime.v1.RuntimeService/NoSuchThing") is None
    assert cardinality("/runtime.v1alpha2.RuntimeService/Version") is None
    assert cardinality("//runtime.v1.RuntimeService/Version") is None  # service "/runtime.v1.RuntimeService"


def test_cardinality_of_a_spelling_grpc_go_routes_to_the_method() -> None:
    assert cardinality("runtime.v1.ImageService/StreamImages") is Cardinality.SERVER_STREAM


# grpc-go Server.handleStream: drop one leading "/", split the rest at its LAST "/".
@pytest.mark.parametrize("path, routed", [
    ("/runtime.v1.ImageService/RemoveImage", "/runtime.v1.ImageService/RemoveImage"),
    ("runtime.v1.ImageService/RemoveImage", "/runtime.v1.ImageService/RemoveImage"),
    ("//runtime.v1.ImageService/RemoveImage", "//runtime.v1.ImageService/RemoveImage"),  # service "/runtime.v1..."
    ("/a/runtime.v1.ImageService/RemoveImage", "/a/runtime.v1.ImageService/RemoveImage"),  # service "a/runtime..."
    ("/runtime.v1.ImageService/RemoveImage/", "/runtime.v1.ImageService/RemoveImage/"),  # method ""
    ("/runtime.v1.ImageService/RemoveImage?x=1", "/runtime.v1.ImageService/RemoveImage?x=1"),  # no query part
    ("/runtime.v1.ImageService/Remove%49mage", "/runtime.v1.ImageService/Remove%49mage"),  # no unescaping
    ("/runtime.v1.ImageService", None),
    ("runtime.v1.ImageService", None),
    ("/", None),
    ("", None),
])
def test_canonical_is_grpc_go_routing(path: str, routed: str | None) -> None:
    assert canonical(path) == routed


def test_every_known_method_is_canonical() -> None:
    assert all(canonical(m) == m and canonical(m[1:]) == m for m in KNOWN_METHODS)


def test_count_matches_rpcs_in_our_proto() -> None:
    # Count "rpc" lines in the .proto text independently of the descriptors.
    rpcs = re.findall(r"^\s*rpc\s+(\w+)\s*\(", PROTO.read_text(), re.MULTILINE)
    assert len(KNOWN_METHODS) == len(rpcs) == len(set(rpcs))
    total = sum(len(s.methods) for s in api_pb2.DESCRIPTOR.services_by_name.values())
    assert len(KNOWN_METHODS) == total
    # upstream kubernetes/cri-api master (791729b2): 37 RuntimeService + 6 ImageService
    assert len(KNOWN_METHODS) == 43


def test_streaming_methods_are_exactly_the_upstream_ones() -> None:
    streams = {m for m, c in KNOWN_METHODS.items() if c is not Cardinality.UNARY}
    assert streams == {
        "/runtime.v1.RuntimeService/StreamPodSandboxes",
        "/runtime.v1.RuntimeService/StreamContainers",
        "/runtime.v1.RuntimeService/StreamContainerStats",
        "/runtime.v1.RuntimeService/StreamPodSandboxStats",
        "/runtime.v1.RuntimeService/GetContainerEvents",
        "/runtime.v1.RuntimeService/StreamPodSandboxMetrics",
        "/runtime.v1.ImageService/StreamImages",
    }
    assert all(c is Cardinality.SERVER_STREAM for m, c in KNOWN_METHODS.items() if m in streams)

