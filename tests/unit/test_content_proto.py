"""Our declarations of containerd's content API: generated code current, wire facts right."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shim.proto.containerd.services.content.v1 import content_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "shim" / "proto" / "containerd" / "services" / "content" / "v1"


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env=dict(os.environ, PYTHON=sys.executable), cwd=ROOT)
    for name in ("content_pb2.py", "content_pb2.pyi"):
        fresh = (tmp_path / "containerd" / "services" / "content" / "v1" / name).read_text()
        assert fresh == (GENERATED / name).read_text(), f"{name} is stale: run scripts/gen_proto.sh"


@pytest.mark.parametrize("message,field,number", [
    ("Info", "digest", 1), ("Info", "size", 2), ("Info", "created_at", 3), ("Info", "updated_at", 4),
    ("Info", "labels", 5), ("ListContentRequest", "filters", 1), ("ListContentResponse", "info", 1),
    ("ReadContentRequest", "digest", 1), ("ReadContentRequest", "offset", 2), ("ReadContentRequest", "size", 3),
    ("ReadContentResponse", "offset", 1), ("ReadContentResponse", "data", 2),
    ("Status", "started_at", 1), ("Status", "updated_at", 2), ("Status", "ref", 3), ("Status", "offset", 4),
    ("Status", "total", 5), ("Status", "expected", 6), ("ListStatusesRequest", "filters", 1),
    ("ListStatusesResponse", "statuses", 1), ("AbortRequest", "ref", 1),
])
def test_field_numbers_are_containerds(message: str, field: str, number: int) -> None:
    assert pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number


def test_method_paths_are_containerds() -> None:
    service = pb.DESCRIPTOR.services_by_name["Content"]
    assert service.full_name == "containerd.services.content.v1.Content"
    assert {m.name for m in service.methods} == {"Info", "List", "Read", "ListStatuses", "Abort"}


def test_fields_we_do_not_declare_survive_a_round_trip() -> None:
    status = pb.Status(ref="layer-sha256:" + "a" * 64, offset=5).SerializeToString() + b"\x38\x01"  # field 7
    assert pb.Status.FromString(status).SerializeToString() == status
