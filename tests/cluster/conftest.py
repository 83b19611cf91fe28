"""Cluster fixtures: one etcd + kube-apiserver for the session with the shim's CRDs, MCO's test
CRDs and the RBAC from deploy/cluster/ applied; plus the e2e fixtures (registry, containerd, shim)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from tests.support.apiserver import ControlPlane, require_control_plane
from tests.support.controller import ControllerProc
from tests.support.fixtures import (  # noqa: F401  (re-exported fixtures)
    _reset_proxies_after_test,
    auth_registry,
    containerd,
    containerd_factory,
    fast_tmp,
    make_image,
    proxy,
    registry,
    shim_factory,
)
from tests.support.kube import Admin, install

NODES = ("node-a", "node-b")  # Node objects created through the API
KUBELET_NODE = "node-k"  # registered by a real kubelet (tests/cluster/test_kubelet_node.py)


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    apiserver, etcd = require_control_plane()
    workdir = Path(tempfile.mkdtemp(prefix="kube-"))
    cp = ControlPlane(workdir, apiserver=apiserver, etcd=etcd, nodes=(*NODES, KUBELET_NODE))
    try:
        cp.start()
        admin = install(cp.kubeconfig(workdir / "admin.kubeconfig"), (*NODES, KUBELET_NODE))
        cp.admin = admin  # type: ignore[attr-defined]
        yield cp
    finally:
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def admin(control_plane: ControlPlane) -> Admin:
    """The cluster admin; NODES exist as Node objects (created through the API)."""
    a: Admin = control_plane.admin  # type: ignore[attr-defined]
    for n in NODES:
        try:
            a.create_node(n, {"kubernetes.io/hostname": n})
        except ApiException as e:
            if e.status != 409:
                raise
    return a


@pytest.fixture
def controllers(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Any]:
    """``start(identity, *flags)``: a `cri-shim controller` process, stopped (SIGTERM) at the end."""
    started: list[ControllerProc] = []

    def start(identity: str, *extra: str) -> ControllerProc:
        c = ControllerProc(control_plane, tmp_path, identity, *extra)
        started.append(c)
        return c
    try:
        yield start
    finally:
        for c in started:
            c.stop()
            print(f"--- controller {c.identity} log (tail)\n{c.log_text()[-3000:]}")
