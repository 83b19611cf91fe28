"""Kubernetes CRI protobuf packages (runtime.*)."""
