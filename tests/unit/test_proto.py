"""Tests for our runtime.v1 declarations and the generated module.

Field numbers asserted here were read from upstream
kubernetes/cri-api pkg/apis/runtime/v1/api.proto (commit 791729b2, 2026-07-23;
same numbers in kubernetes/kubernetes
staging/src/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor as _d
from hypothesis import given, strategies as st

from shim.proto.runtime.v1 import api_pb2
from tests.support.cri import varint

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "shim" / "proto" / "runtime" / "v1"


# --------------------------------------------------------------------------
# Hand-rolled wire encoding helpers (independent of the protobuf runtime).
# --------------------------------------------------------------------------

VARINT, I64, LEN, I32 = 0, 1, 2, 5


def tag(num: int, wt: int) -> bytes:
    return varint(num << 3 | wt)


def f_varint(num: int, n: int) -> bytes:
    return tag(num, VARINT) + varint(n)


def f_len(num: int, payload: bytes | str) -> bytes:
    if isinstance(payload, str):
        payload = payload.encode()
    return tag(num, LEN) + varint(len(payload)) + payload


def f_i64(num: int, raw: bytes) -> bytes:
    assert len(raw) == 8
    return tag(num, I64) + raw


def f_i32(num: int, raw: bytes) -> bytes:
    assert len(raw) == 4
    return tag(num, I32) + raw


def map_entry(num: int, key: str, value: str) -> bytes:
    return f_len(num, f_len(1, key) + f_len(2, value))


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def fields(buf: bytes) -> list[tuple[int, int, bytes]]:
    """Split a serialized message into (number, wire type, raw value) tuples."""
    out = []
    i = 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        start = i
        if wt == VARINT:
            _, i = read_varint(buf, i)
        elif wt == I64:
            i += 8
        elif wt == I32:
            i += 4
        elif wt == LEN:
            length, i = read_varint(buf, i)
            start = i
            i += length
        else:  # pragma: no cover - groups are not used in CRI
            raise AssertionError(f"unexpected wire type {wt}")
        out.append((num, wt, buf[start:i]))
    return out


Nested = dict[int, "Nested"]


def canon(buf: bytes, nested: Nested | None = None) -> list:
    """Order-insensitive view of a message: fields stably sorted by number.

    Reordering fields with *different* numbers never changes meaning; the
    relative order of one repeated field is kept by the stable sort. Fields
    listed in ``nested`` are sub-messages and are canonicalized recursively.
    """
    nested = nested or {}
    items = []
    for num, wt, raw in fields(buf):
        if num in nested and wt == LEN:
            items.append((num, wt, canon(raw, nested[num])))
        else:
            items.append((num, wt, raw))
    return sorted(items, key=lambda t: t[0])


# --------------------------------------------------------------------------
# Generated code is current.
# --------------------------------------------------------------------------


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env=env,
        cwd=ROOT,
    )
    for name in ("api_pb2.py", "api_pb2.pyi"):
        fresh = (tmp_path / "runtime" / "v1" / name).read_text()
        committed = (GENERATED / name).read_text()
        assert fresh == committed, (
            f"shim/proto/runtime/v1/{name} is stale: run scripts/gen_proto.sh "
            "(or the installed grpcio-tools differs from the one that generated it)"
        )


def test_generated_module_imports_nothing_from_our_tree() -> None:
    src = (GENERATED / "api_pb2.py").read_text()
    imports = [
        line for line in src.splitlines() if line.startswith(("import ", "from "))
    ]
    assert imports, "expected google.protobuf imports"
    assert all(" google.protobuf" in line for line in imports), imports


def test_package_and_full_names() -> None:
    assert api_pb2.DESCRIPTOR.package == "runtime.v1"
    assert api_pb2.PullImageRequest.DESCRIPTOR.full_name == "runtime.v1.PullImageRequest"
    assert (
        api_pb2.DESCRIPTOR.services_by_name["ImageService"].methods_by_name["PullImage"].full_name
        == "runtime.v1.ImageService.PullImage"
    )


# --------------------------------------------------------------------------
# Field numbers against upstream (literals copied by hand from upstream
# kubernetes/cri-api pkg/apis/runtime/v1/api.proto).
# --------------------------------------------------------------------------

UPSTREAM_FIELDS = [
    # (message, field, number, type)
    ("ImageSpec", "image", 1, _d.FieldDescriptor.TYPE_STRING),
    ("ImageSpec", "annotations", 2, _d.FieldDescriptor.TYPE_MESSAGE),
    ("ImageSpec", "user_specified_image", 18, _d.FieldDescriptor.TYPE_STRING),
    ("ImageSpec", "runtime_handler", 19, _d.FieldDescriptor.TYPE_STRING),
    ("ImageSpec", "image_ref", 20, _d.FieldDescriptor.TYPE_STRING),
    ("Image", "size", 4, _d.FieldDescriptor.TYPE_UINT64),
    ("Image", "uid", 5, _d.FieldDescriptor.TYPE_MESSAGE),
    ("Image", "spec", 7, _d.FieldDescriptor.TYPE_MESSAGE),
    ("Image", "pinned", 8, _d.FieldDescriptor.TYPE_BOOL),
    ("PullImageRequest", "auth", 2, _d.FieldDescriptor.TYPE_MESSAGE),
    ("PullImageRequest", "sandbox_config", 3, _d.FieldDescriptor.TYPE_MESSAGE),
    ("PullImageResponse", "image_ref", 1, _d.FieldDescriptor.TYPE_STRING),
    ("AuthConfig", "registry_token", 6, _d.FieldDescriptor.TYPE_STRING),
    ("PodSandboxConfig", "labels", 6, _d.FieldDescriptor.TYPE_MESSAGE),
    ("PodSandboxConfig", "annotations", 7, _d.FieldDescriptor.TYPE_MESSAGE),
    ("PodSandboxMetadata", "attempt", 4, _d.FieldDescriptor.TYPE_UINT32),
    ("PodSandboxStatus", "runtime_handler", 9, _d.FieldDescriptor.TYPE_STRING),
    ("PodSandbox", "runtime_handler", 7, _d.FieldDescriptor.TYPE_STRING),
    ("FilesystemUsage", "inodes_used", 4, _d.FieldDescriptor.TYPE_MESSAGE),
    ("ImageFsInfoResponse", "container_filesystems", 2, _d.FieldDescriptor.TYPE_MESSAGE),
    ("StreamPodSandboxesResponse", "pod_sandboxes", 1, _d.FieldDescriptor.TYPE_MESSAGE),
]


@pytest.mark.parametrize(("message", "field", "number", "ftype"), UPSTREAM_FIELDS)
def test_field_numbers_match_upstream(message: str, field: str, number: int, ftype: int) -> None:
    fd = api_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
    assert fd.number == number
    assert fd.type == ftype


def test_image_uid_is_int64_wrapper_and_state_enum() -> None:
    uid = api_pb2.Image.DESCRIPTOR.fields_by_name["uid"]
    assert uid.message_type.full_name == "runtime.v1.Int64Value"
    assert api_pb2.PodSandboxState.Value("SANDBOX_READY") == 0
    assert api_pb2.PodSandboxState.Value("SANDBOX_NOTREADY") == 1


# --------------------------------------------------------------------------
# Unknown fields survive decode / re-encode.
# --------------------------------------------------------------------------


def _image_spec_with_unknowns() -> bytes:
    return (
        f_len(1, "docker.io/library/nginx:latest")
        + map_entry(2, "a", "b")
        + f_len(18, "nginx")
        + f_len(19, "runc")
        + f_len(20, "sha256:" + "a" * 64)
        # future fields we don't know about
        + f_varint(21, 300)
        + f_len(22, b"\x00\xffopaque")
        + f_i64(23, b"\x01\x02\x03\x04\x05\x06\x07\x08")
        + f_i32(24, b"\xde\xad\xbe\xef")
    )


def _sandbox_config_known_then_unknown() -> bytes:
    metadata = f_len(1, "pod") + f_len(2, "uid-1") + f_len(3, "ns") + f_varint(4, 2)
    return (
        f_len(1, metadata)
        + map_entry(6, "app", "web")
        + map_entry(7, "k", "v")
        # fields we leave undeclared: hostname, log_directory, linux
        + f_len(2, "host")
        + f_len(3, "/var/log/pods/x")
        + f_len(8, f_len(1, "/kubepods") + f_varint(99, 1))
    )


def test_unknown_fields_roundtrip_bytes_exactly() -> None:
    """Known fields in number order, then unknowns: output bytes == input bytes."""
    wire = (
        f_len(1, _image_spec_with_unknowns())
        + f_len(2, f_len(1, "user") + f_len(2, "secret") + f_len(6, "tok"))
        + f_len(3, _sandbox_config_known_then_unknown())
        + f_len(15, "a future top-level field")
        + f_varint(16, 1)
    )
    msg = api_pb2.PullImageRequest.FromString(wire)
    assert msg.image.image == "docker.io/library/nginx:latest"
    assert msg.image.image_ref == "sha256:" + "a" * 64
    assert msg.sandbox_config.metadata.namespace == "ns"
    assert dict(msg.sandbox_config.labels) == {"app": "web"}
    assert msg.auth.registry_token == "tok"
    assert msg.SerializeToString() == wire


def test_unknown_fields_survive_on_empty_messages() -> None:
    """Messages we declare empty forward their whole content."""
    wire = f_len(1, "container-id") + f_varint(2, 30) + f_len(7, f_len(1, b"x"))
    msg = api_pb2.StopContainerRequest.FromString(wire)
    assert msg.SerializeToString() == wire


def test_unknown_fields_survive_modification_of_known_fields() -> None:
    wire = f_len(1, _image_spec_with_unknowns()) + f_len(3, _sandbox_config_known_then_unknown())
    msg = api_pb2.PullImageRequest.FromString(wire)
    msg.image.image = "docker.io/library/nginx:1.27"
    out = msg.SerializeToString()
    unknown_spec = [f for f in fields(fields(out)[0][2]) if f[0] > 20]
    assert unknown_spec == [f for f in fields(_image_spec_with_unknowns()) if f[0] > 20]
    assert fields(out)[1] == fields(wire)[1]


def test_interleaved_unknown_fields_roundtrip_semantically() -> None:
    """kubelet (Go) emits fields in number order, so undeclared fields can sit
    between declared ones (PodSandboxConfig 1, 2..5, 6, 7, 8). Re-serializing
    moves unknown fields after known ones: bytes may differ, content may not."""
    # (Go omits proto3 zero values, and so does Python: an explicitly encoded
    # zero in a *declared* field would be dropped on re-encode, so use 1.)
    metadata = f_len(1, "pod") + f_len(2, "uid-1") + f_len(3, "ns") + f_varint(4, 1)
    config = (
        f_len(1, metadata)
        + f_len(2, "host")
        + f_len(3, "/var/log/pods/x")
        + f_len(4, f_len(1, "10.0.0.10") + f_len(2, "cluster.local"))
        + f_len(5, f_varint(1, 0) + f_varint(2, 80))
        + f_len(5, f_varint(1, 0) + f_varint(2, 443))
        + map_entry(6, "app", "web")
        + map_entry(7, "k", "v")
        + f_len(8, f_len(1, "/kubepods"))
    )
    wire = f_len(1, f_len(1, "nginx")) + f_len(3, config)
    msg = api_pb2.PullImageRequest.FromString(wire)
    out = msg.SerializeToString()
    shape: Nested = {1: {}, 3: {1: {}}}
    assert canon(out, shape) == canon(wire, shape)
    # both port_mappings stay in their original relative order
    ports = [raw for num, _, raw in fields(fields(out)[1][2]) if num == 5]
    assert ports == [f_varint(1, 0) + f_varint(2, 80), f_varint(1, 0) + f_varint(2, 443)]


_unknown_field = st.one_of(
    st.tuples(st.just(VARINT), st.integers(0, 2**64 - 1)),
    st.tuples(st.just(LEN), st.binary(max_size=40)),
    st.tuples(st.just(I64), st.binary(min_size=8, max_size=8)),
    st.tuples(st.just(I32), st.binary(min_size=4, max_size=4)),
)


@given(
    image=st.text(max_size=30),
    extras=st.lists(st.tuples(st.integers(21, 10_000), _unknown_field), max_size=8),
)
def test_unknown_fields_roundtrip_property(image: str, extras: list) -> None:
    wire = f_len(1, image) if image else b""
    for num, (wt, value) in extras:
        if wt == VARINT:
            wire += f_varint(num, value)
        elif wt == LEN:
            wire += f_len(num, value)
        elif wt == I64:
            wire += f_i64(num, value)
        else:
            wire += f_i32(num, value)
    assert api_pb2.ImageSpec.FromString(wire).SerializeToString() == wire
