"""RunPodSandbox / RemovePodSandbox: forwarded unchanged; the shim learns from them which
runtime handler each pod runs with (for image pulls, see shim/runtime_handlers/resolver.py).

Only a successful call teaches anything. The request is decoded after the runtime has
answered, so even a request the shim cannot parse reaches the runtime as it is.
"""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from ..cri.call import Call
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from .resolver import HandlerResolver

_log = logs.get("handlers")



async def run_pod_sandbox(resolver: HandlerResolver, request: bytes, call: Call) -> bytes:
    response = await call.forward(request)
    try:
        req = api_pb2.RunPodSandboxRequest.FromString(request)
        resp = api_pb2.RunPodSandboxResponse.FromString(response)
    except DecodeError:
        logs.log(_log, logging.WARNING, "cannot parse RunPodSandbox; pod handler not learned")
        return response
    uid = req.config.metadata.uid
    if uid:
        resolver.learned(uid, resp.pod_sandbox_id, req.runtime_handler)
    return response


async def remove_pod_sandbox(resolver: HandlerResolver, request: bytes, call: Call) -> bytes:
    response = await call.forward(request)
    try:
        sandbox_id = api_pb2.RemovePodSandboxRequest.FromString(request).pod_sandbox_id
    except DecodeError:
        return response
    if sandbox_id:
        resolver.sandbox_removed(sandbox_id)
    return response
