"""A failed pull's typed reason, from the error's structure: real runtime errors, and references
that hold "401", "403", "stalled" or "denied" never change the reason."""

from __future__ import annotations

import grpc
import pytest

from shim.errors import RpcError
from shim.pulls.failure import REASONS, PullFailure
from shim.pulls.progress import Stall, no_progress_message, stall_message
from tests.support.pull_errors import CAPTURED

DIGEST_401 = "sha256:" + "4013" * 16


@pytest.mark.parametrize(("runtime", "case", "code", "details", "reason"), CAPTURED,
                         ids=[f"{r}: {c}" for r, c, *_ in CAPTURED])
def test_real_runtime_errors(runtime: str, case: str, code: str, details: str, reason: str) -> None:
    assert PullFailure(grpc.StatusCode[code], details).reason == reason


def test_every_reason_is_captured_from_a_real_runtime() -> None:
    assert {r for *_, r in CAPTURED} == set(REASONS) - {"stalled"}  # stalled is the shim's own
    assert {r for r, *_ in CAPTURED} == {"containerd-1.6", "containerd-2.x", "crio"}
    for runtime in ("containerd-1.6", "containerd-2.x", "crio"):
        assert {r for rt, *_, r in CAPTURED if rt == runtime} == set(REASONS) - {"stalled"}, runtime


@pytest.mark.parametrize("ref", [f"reg.example/app401@{DIGEST_401}", "reg.example/denied/403:401",
                                 "reg.example/stalled/unauthorized:v1", "reg.example:4030/no-space-left:v1"])
def test_the_reference_never_decides(ref: str) -> None:
    not_found = (f'failed to pull and unpack image "{ref}": failed to resolve reference "{ref}": '
                 f"{ref}: not found")
    assert PullFailure(grpc.StatusCode.NOT_FOUND, not_found).reason == "notFound"
    tls = (f'failed to pull and unpack image "{ref}": failed to resolve reference "{ref}": failed to do '
           f'request: Head "https://reg.example/v2/x/manifests/401": tls: first record does not look like a TLS '
           "handshake")
    assert PullFailure(grpc.StatusCode.UNKNOWN, tls).reason == "other"
    server = (f'failed to pull and unpack image "{ref}": failed to resolve reference "{ref}": pulling from host '
              "reg.example failed with status code [manifests 401]: 500 Internal Server Error")
    assert PullFailure(grpc.StatusCode.UNKNOWN, server).reason == "other"


def test_grpc_codes() -> None:
    assert PullFailure(grpc.StatusCode.UNAUTHENTICATED, "x").reason == "auth"
    assert PullFailure(grpc.StatusCode.PERMISSION_DENIED, "x").reason == "auth"
    assert PullFailure(grpc.StatusCode.NOT_FOUND, "x").reason == "notFound"
    # a gRPC limit, not a full disk
    assert PullFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "received message larger than max").reason == "other"
    assert PullFailure(grpc.StatusCode.UNKNOWN, "connection reset by peer").reason == "other"


def test_containerd_refused_token() -> None:
    """containerd's wording (remotes/docker/resolver.go, 1.6 to 2.x) when the registry refuses the token's scope."""
    details = ('failed to pull and unpack image "docker.io/library/app403:latest": failed to resolve reference '
               '"docker.io/library/app403:latest": pull access denied, repository does not exist or may require '
               "authorization: server message: insufficient_scope: authorization failed")
    assert PullFailure(grpc.StatusCode.UNKNOWN, details).reason == "auth"


def test_the_shims_own_guards() -> None:
    image = "reg.example/stalled-401:v1"
    stalled = RpcError(grpc.StatusCode.UNAVAILABLE, stall_message(image, Stall(9 << 10, 60.0), 64 << 10))
    hung = RpcError(grpc.StatusCode.UNAVAILABLE, no_progress_message(image, 60, "resolving", "reg.example", 0, 0))
    assert PullFailure.of(stalled).reason == "stalled"
    assert PullFailure.of(hung).reason == "stalled"
    # the same words from the runtime are not the shim's guard; the shim's other refusals are not auth
    assert PullFailure(grpc.StatusCode.UNAVAILABLE, stalled.details).reason == "other"
    assert PullFailure.of(RpcError(grpc.StatusCode.PERMISSION_DENIED, "cri-shim: refused")).reason == "other"
    assert PullFailure.of(RpcError(grpc.StatusCode.UNKNOWN, "x", from_upstream=True)).from_runtime


def test_str_is_what_status_shows() -> None:
    assert str(PullFailure(grpc.StatusCode.NOT_FOUND, "r: not found")) == "NOT_FOUND: r: not found"
