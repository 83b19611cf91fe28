"""CRI v1 (runtime.v1) message classes: ``from shim.proto.runtime.v1 import api_pb2``."""
