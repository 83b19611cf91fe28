"""Generated protobuf modules for cri-shim (see proto/ and scripts/gen_proto.sh)."""
