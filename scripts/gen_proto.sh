#!/usr/bin/env bash
# Regenerate the Python protobuf modules for our own proto declarations.
#
#   proto/runtime/v1/api.proto                        ->  shim/proto/runtime/v1/api_pb2.py (+ .pyi)
#   proto/containerd/services/content/v1/content.proto ->  shim/proto/containerd/services/content/v1/content_pb2.py (+ .pyi)
#
# Usage: scripts/gen_proto.sh [OUT_DIR]
#   OUT_DIR defaults to shim/proto (relative to the repository root). The unit
#   tests pass a temporary directory to check the committed files are current.
# Needs grpcio-tools (python -m grpc_tools.protoc). Only message classes are
# generated (no grpc stubs): the proxy handles methods generically.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-shim/proto}"
python="${PYTHON:-python}"

cd "$root"
mkdir -p "$out"
"$python" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" \
  proto/runtime/v1/api.proto proto/containerd/services/content/v1/content.proto
