"""shim/cluster/client.py: a kubeconfig's client-certificate file, rotated under a running client
(as kubelet rotates /var/lib/kubelet/pki/kubelet-client-current.pem), is loaded into a new
connection pool; a file that cannot be loaded yet keeps the previous one."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml
from kubernetes_asyncio.client.exceptions import ApiException

from shim.cluster.client import RotatingCertificate, identity_problem, new_client
from shim.cluster.reachability import describe


def issue(pem: Path, cn: str) -> None:
    """A self-signed certificate and its key in one file, renamed over ``pem`` (as kubelet does)."""
    tmp = pem.with_name(pem.name + ".new")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{tmp}.key",
                    "-out", f"{tmp}.crt", "-days", "1", "-subj", f"/O=system:nodes/CN={cn}"],
                   check=True, capture_output=True, timeout=60)
    tmp.write_bytes(Path(f"{tmp}.crt").read_bytes() + Path(f"{tmp}.key").read_bytes())
    os.replace(tmp, pem)


def kubeconfig(tmp: Path, pem: Path) -> Path:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
           "users": [{"name": "u", "user": {"client-certificate": str(pem), "client-key": str(pem)}}],
           "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_a_rotated_certificate_is_loaded_into_a_new_pool(tmp_path: Path) -> None:
    pem = tmp_path / "kubelet-client-current.pem"
    issue(pem, "system:node:n1")
    api = await new_client(str(kubeconfig(tmp_path, pem)))
    try:
        rest = api.rest_client
        assert isinstance(rest, RotatingCertificate)
        first = rest.pool_manager
        await rest.refresh()
        assert rest.pool_manager is first and rest.reloads == 0  # unchanged: nothing loaded again

        pem.write_text("-----BEGIN CERTIFICATE-----\nhalf writ")  # caught mid-write
        await rest.refresh()
        assert rest.pool_manager is first and rest.reloads == 0
        assert rest.error  # why, for the log; the previous pair stays in use

        issue(pem, "system:node:n1")  # kubelet's rotation
        await rest.refresh()
        assert rest.pool_manager is not first and rest.reloads == 1 and rest.error == ""
        assert first.closed  # no connection keeps the old identity
    finally:
        await api.close()


async def test_a_token_kubeconfig_is_used_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    api = await new_client(str(path))
    try:
        assert not isinstance(api.rest_client, RotatingCertificate)
    finally:
        await api.close()


def test_identity_problem_names_the_node_name_to_set() -> None:
    assert identity_problem("system:node:n1", "n1") == ""
    assert identity_problem("system:serviceaccount:cri-shim:cri-shim-n1", "n1") == ""  # RBAC narrows those
    assert identity_problem("system:node:n1", "host-1") == (
        "the kubeconfig's user is system:node:n1 but cluster.node_name is host-1: the API server refuses this "
        "node's status writes (set cluster.node_name: n1)")


def test_an_api_error_is_described_with_its_status_message() -> None:
    body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                       "message": "admission webhook said no"})
    e = ApiException(status=403, reason="Forbidden")
    e.body = body
    assert describe(e) == "HTTP 403: Forbidden: admission webhook said no"
    e.body = "<html>bad gateway</html>"
    assert describe(e) == "HTTP 403: Forbidden"
