"""Synchronous admin calls against the test API server (tests/support/apiserver.py), through
kubernetes_asyncio: each call runs in its own short event loop, so sync tests can use it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, TypeVar

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import new_client_from_config

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "cluster"
MCO_CRDS = REPO / "tests" / "cluster" / "mco-crds.yaml"
SERVED = (("cri-shim.io", "v1", "imagesets"), ("cri-shim.io", "v1", "nodeimagesetstatuses"),
          ("cri-shim.io", "v1", "pinnedimagesetreports"),
          ("machineconfiguration.openshift.io", "v1", "pinnedimagesets"),
          ("machineconfiguration.openshift.io", "v1alpha1", "pinnedimagesets"),
          ("machineconfiguration.openshift.io", "v1", "machineconfigpools"))


class Admin:
    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig

    def run(self, fn: Callable[[client.ApiClient], Awaitable[T]]) -> T:
        async def go() -> T:
            api = await new_client_from_config(config_file=str(self.kubeconfig), persist_config=False)
            try:
                return await fn(api)
            finally:
                await api.close()
        return asyncio.run(go())

    # ------------------------------------------------------------------ objects

    def apply_docs(self, docs: Iterable[dict[str, Any]]) -> None:
        """Create each document (CRDs, RBAC, namespaces, service accounts, secrets); one that exists is kept."""
        async def go(api: client.ApiClient) -> None:
            ext, rbac, core = client.ApiextensionsV1Api(api), client.RbacAuthorizationV1Api(api), client.CoreV1Api(api)
            adm = client.AdmissionregistrationV1Api(api)
            for d in docs:
                kind, ns = d["kind"], d["metadata"].get("namespace")
                create = {
                    "CustomResourceDefinition": ext.create_custom_resource_definition,
                    "ClusterRole": rbac.create_cluster_role,
                    "ClusterRoleBinding": rbac.create_cluster_role_binding,
                    "Role": rbac.create_namespaced_role,
                    "RoleBinding": rbac.create_namespaced_role_binding,
                    "Namespace": core.create_namespace,
                    "ServiceAccount": core.create_namespaced_service_account,
                    "Secret": core.create_namespaced_secret,
                    "ValidatingAdmissionPolicy": adm.create_validating_admission_policy,
                    "ValidatingAdmissionPolicyBinding": adm.create_validating_admission_policy_binding,
                }[kind]
                try:
                    await (create(ns, d) if ns else create(d))
                except ApiException as e:
                    if e.status != 409:
                        raise
        self.run(go)

    def apply_files(self, *paths: Path, substitute: dict[str, str] | None = None) -> None:
        docs = []
        for p in paths:
            text = p.read_text()
            for k, v in (substitute or {}).items():
                text = text.replace(k, v)
            docs += [d for d in yaml.safe_load_all(text) if d]
        self.apply_docs(docs)

    def wait_served(self, group: str, version: str, plural: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.run(lambda api: client.CustomObjectsApi(api).list_cluster_custom_object(group, version, plural))
                return
            except ApiException as e:
                if e.status not in (404, 429, 503) or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def create_node(self, name: str, labels: dict[str, str]) -> None:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
        self.run(lambda api: client.CoreV1Api(api).create_node(body))

    def set_node_labels(self, name: str, labels: dict[str, str | None]) -> None:
        self.run(lambda api: client.CoreV1Api(api).patch_node(name, {"metadata": {"labels": labels}}))

    def custom(self, verb: str, group: str, version: str, plural: str, *args: Any, **kwargs: Any) -> Any:
        async def go(api: client.ApiClient) -> Any:
            c = client.CustomObjectsApi(api)
            fn = getattr(c, f"{verb}_cluster_custom_object")
            return await fn(group, version, plural, *args, **kwargs)
        return self.run(go)

    def get_custom(self, group: str, version: str, plural: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom("get", group, version, plural, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def apply_custom(self, group: str, version: str, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of one cluster-scoped custom object (field manager: the test)."""
        return self.custom("patch", group, version, plural, body["metadata"]["name"], body,
                           field_manager="test", force=True, _content_type="application/apply-patch+yaml")

    def events(self, namespace: str = "default") -> list[Any]:
        return self.run(lambda api: client.CoreV1Api(api).list_namespaced_event(namespace)).items


def install(kubeconfig: Path, nodes: Iterable[str]) -> Admin:
    """A fresh API server made ready for shims: the shim's CRDs, MCO's test CRDs, the RBAC of
    deploy/cluster/ (node-rbac.yaml once per node; node-identity.yaml: RBAC for system:nodes and the
    admission policies; controller.yaml but its Deployment), every kind served. Returns the admin."""
    admin = Admin(kubeconfig)
    admin.apply_files(DEPLOY / "crds.yaml", MCO_CRDS, DEPLOY / "rbac.yaml", DEPLOY / "node-identity.yaml")
    admin.apply_docs(d for d in yaml.safe_load_all((DEPLOY / "controller.yaml").read_text())
                     if d and d["kind"] != "Deployment")  # tests run the controller as processes
    for node in nodes:
        admin.apply_files(DEPLOY / "node-rbac.yaml", substitute={"NODE_NAME": node})
    for group, version, plural in SERVED:
        admin.wait_served(group, version, plural)
    return admin
