"""Which of MCO's resources the API server serves, asked through discovery (not by listing them).

``GET /apis/machineconfiguration.openshift.io``: 404 when the group is not served (a cluster
without MCO: one request, and nothing is watched). When it is served, its versions' resource
lists say where ``pinnedimagesets`` is (``v1``, else ``v1alpha1``; OpenShift before 4.16 has
the group without it) and whether ``machineconfigpools`` is at ``v1``. Discovery needs no RBAC
beyond ``system:discovery`` (every authenticated user).
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from .informer import open_response
from .objects import MACHINE_CONFIG_POOL, PINNED_IMAGE_SETS, Kind

MCO_GROUP = MACHINE_CONFIG_POOL.group


async def get_json(api: Any, path: str, request_timeout: float) -> dict[str, Any] | None:
    """GET ``path`` with the client's credentials: the JSON body, or None on 404."""
    try:
        resp = await open_response(await api.call_api(path, "GET", auth_settings=["BearerToken"],
                                                      header_params={"Accept": "application/json"},
                                                      _preload_content=False, _request_timeout=request_timeout))
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    try:
        body: dict[str, Any] = json.loads(await resp.read())
        return body
    finally:
        resp.release()


async def mco_kinds(api: Any, request_timeout: float) -> tuple[Kind, Kind] | None:
    """(PinnedImageSet, MachineConfigPool) as served, or None when MCO's pinned sets are not served.
    Raises on anything but an answer (the caller retries with backoff)."""
    group = await get_json(api, f"/apis/{MCO_GROUP}", request_timeout)
    if group is None:
        return None
    versions = {v.get("version") for v in group.get("versions") or []}
    served: dict[str, set[str]] = {}
    for version in ("v1", "v1alpha1"):
        if version in versions:
            resources = await get_json(api, f"/apis/{MCO_GROUP}/{version}", request_timeout)
            served[version] = {r.get("name") for r in (resources or {}).get("resources") or []}
    if MACHINE_CONFIG_POOL.plural not in served.get(MACHINE_CONFIG_POOL.version, set()):
        return None
    for kind in PINNED_IMAGE_SETS:  # v1 first
        if kind.plural in served.get(kind.version, set()):
            return kind, MACHINE_CONFIG_POOL
    return None
