"""A real control plane for the ``cluster`` suite: etcd + kube-apiserver on loopback.

Install: ``scripts/setup.d/55-apiserver.sh`` builds both from the Go module proxy into
/var/cache/cri-shim/{etcd-<v>,kube-apiserver-<v>}/. Certificates are made here with ``openssl``
(a CA, the serving cert for 127.0.0.1, the service-account signing key, one kubelet client
certificate per node). Clients authenticate with static bearer tokens (``--token-auth-file``):
``admin`` (system:masters), one user per node named like the ServiceAccount
``system:serviceaccount:cri-shim:cri-shim-<node>`` (so the RBAC manifests in deploy/cluster/ are
tested exactly as a fleet uses them) and the controller's ServiceAccount
(``system:serviceaccount:cri-shim:cri-shim-controller``, rights of deploy/cluster/controller.yaml);
each kubelet with a client certificate signed by the test CA (``--client-ca-file``), CN
``system:node:<node>``, O ``system:nodes``, as kubelet's TLS bootstrap gets one.
As a real cluster: authorization Node, RBAC; admission NodeRestriction and the default plugins,
ValidatingAdmissionPolicy among them (GA since 1.30), so deploy/cluster/node-identity.yaml's policy is enforced.

    cp = ControlPlane(workdir).start()
    cp.kubeconfig(path, token=cp.admin_token)
    cp.stop_apiserver(); cp.start_apiserver()   # etcd keeps the data
    cp.stop()
"""

from __future__ import annotations

import os
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from tests.support import binaries
from tests.support.procs import terminate
from tests.support.registry import free_port

K8S_VERSION = os.environ.get("CRI_SHIM_APISERVER_VERSION", "v1.35.0")
ETCD_VERSION = os.environ.get("CRI_SHIM_ETCD_VERSION", "v3.6.17")
APISERVER = Path(f"/var/cache/cri-shim/kube-apiserver-{K8S_VERSION}/kube-apiserver")
ETCD = Path(f"/var/cache/cri-shim/etcd-{ETCD_VERSION}/etcd")
INSTALL = "bash scripts/setup.d/55-apiserver.sh"
SA_NAMESPACE = "cri-shim"
SERVICE_CIDR = "10.96.0.0/24"
KUBERNETES_SERVICE_IP = "10.96.0.1"  # the first address of SERVICE_CIDR, as the API server allocates it


def require_control_plane() -> tuple[str, str]:
    import pytest

    apiserver = os.environ.get("CRI_SHIM_KUBE_APISERVER") or str(APISERVER)
    etcd = os.environ.get("CRI_SHIM_ETCD") or str(ETCD)
    for path in (apiserver, etcd):
        if not os.access(path, os.X_OK):
            msg = f"no {Path(path).name} at {path} (install: {INSTALL})"
            if binaries.in_ci():
                pytest.fail(msg + " (CI is set: cluster tests must not be skipped)", pytrace=False)
            pytest.skip(msg)
    return apiserver, etcd


CONTROLLER_USER = f"system:serviceaccount:{SA_NAMESPACE}:cri-shim-controller"


def node_user(node: str) -> str:
    return f"system:serviceaccount:{SA_NAMESPACE}:cri-shim-{node}"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


class ControlPlane:
    def __init__(self, workdir: Path, *, apiserver: str, etcd: str, nodes: tuple[str, ...] = (),
                 extra_args: tuple[str, ...] = ()) -> None:
        self.dir = workdir
        self.extra_args = extra_args  # more kube-apiserver flags (bench/cluster_fleet.py: its audit log)
        self.apiserver_bin = apiserver
        self.etcd_bin = etcd
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.admin_token = secrets.token_hex(16)
        self.node_tokens = {n: secrets.token_hex(16) for n in nodes}  # the node's cri-shim ServiceAccount
        self.nodes = nodes  # each has a kubelet client certificate (system:node:<n>)
        self.controller_token = secrets.token_hex(16)  # the controller's ServiceAccount (controller.yaml)
        self.etcd: subprocess.Popen[bytes] | None = None
        self.apiserver: subprocess.Popen[bytes] | None = None
        self.ca = self.dir / "ca.crt"

    # ------------------------------------------------------------------ certificates

    def _certs(self) -> None:
        d = self.dir
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", "2", "-subj", "/CN=cri-shim-test-ca", cwd=d)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
                 "-subj", "/CN=kube-apiserver", cwd=d)
        # The `kubernetes` Service's ClusterIP and names too: in-cluster clients (the controller's
        # pods, tests/cluster/test_controller_pods.py) verify the serving cert against them.
        (d / "san.ext").write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost,IP:{KUBERNETES_SERVICE_IP},"
                                   "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n")
        _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", "server.crt", "-days", "2", "-extfile", "san.ext", cwd=d)
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
        lines = [f"{self.admin_token},admin,admin,system:masters"]
        lines += [f"{tok},{node_user(n)},{n},system:serviceaccounts" for n, tok in self.node_tokens.items()]
        lines.append(f"{self.controller_token},{CONTROLLER_USER},controller,system:serviceaccounts")
        (d / "tokens.csv").write_text("\n".join(lines) + "\n")
        for n in self.nodes:
            self.issue_kubelet_cert(n, d / f"kubelet-{n}.pem")

    def issue_kubelet_cert(self, node: str, pem: Path, *, ca: str = "ca") -> Path:
        """A kubelet client certificate and its key in one PEM file, as kubelet keeps
        /var/lib/kubelet/pki/kubelet-client-current.pem; signed by ``<ca>.crt`` (another CA: one the API server does not trust).
        Written next to ``pem`` and renamed over it, as kubelet's rotation replaces the file."""
        d, tmp = self.dir, pem.with_name(pem.name + ".new")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{tmp}.key", "-out", f"{tmp}.csr",
                 "-subj", f"/O=system:nodes/CN=system:node:{node}", cwd=d)
        _openssl("x509", "-req", "-in", f"{tmp}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
                 "-out", f"{tmp}.crt", "-days", "2", cwd=d)
        tmp.write_bytes(Path(f"{tmp}.crt").read_bytes() + Path(f"{tmp}.key").read_bytes())
        for ext in (".key", ".csr", ".crt"):
            Path(f"{tmp}{ext}").unlink()
        os.replace(tmp, pem)
        return pem

    def other_ca(self) -> str:
        """A CA the API server does not trust (``issue_kubelet_cert(..., ca=...)``)."""
        if not (self.dir / "other-ca.crt").exists():
            _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other-ca.key", "-out",
                     "other-ca.crt", "-days", "2", "-subj", "/CN=not-the-cluster-ca", cwd=self.dir)
        return "other-ca"

    # ------------------------------------------------------------------ processes

    def start(self) -> "ControlPlane":
        self._certs()
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self.etcd_log = open(self.dir / "etcd.log", "ab")
        self.etcd = subprocess.Popen(
            [self.etcd_bin, "--name", "test", "--data-dir", str(self.dir / "etcd"),
             "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"test=http://127.0.0.1:{peer}", "--unsafe-no-fsync",
             "--log-level", "warn"],
            stdout=self.etcd_log, stderr=subprocess.STDOUT)
        self.start_apiserver()
        return self

    def start_apiserver(self, timeout: float = 120.0) -> None:
        d = self.dir
        self.apiserver_log = open(d / "apiserver.log", "ab")
        self.apiserver = subprocess.Popen(
            [self.apiserver_bin, "--etcd-servers", self.etcd_url, "--bind-address", "127.0.0.1",
             "--advertise-address", "127.0.0.1", "--secure-port", str(self.port),
             "--tls-cert-file", str(d / "server.crt"), "--tls-private-key-file", str(d / "server.key"),
             "--cert-dir", str(d / "certs"),
             "--token-auth-file", str(d / "tokens.csv"), "--client-ca-file", str(self.ca),
             "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
             "--service-account-issuer", "https://kubernetes.default.svc",
             "--service-account-key-file", str(d / "sa.pub"),
             "--service-account-signing-key-file", str(d / "sa.key"),
             "--service-cluster-ip-range", SERVICE_CIDR, "--allow-privileged",
             "--enable-priority-and-fairness=false", "--watch-cache=true", "-v", "1", *self.extra_args],
            stdout=self.apiserver_log, stderr=subprocess.STDOUT)
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            assert self.apiserver is not None
            if self.apiserver.poll() is not None:
                raise RuntimeError(f"kube-apiserver exited {self.apiserver.returncode}: {self.log_tail()}")
            req = urllib.request.Request(f"{self.url}/readyz",
                                         headers={"Authorization": f"Bearer {self.admin_token}"})
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                    if r.status == 200:
                        return
            except Exception as e:  # not listening yet, 500 while post-start hooks run
                last = str(e)
            time.sleep(0.2)
        raise RuntimeError(f"kube-apiserver not ready after {timeout} s ({last}): {self.log_tail()}")

    def stop_apiserver(self) -> None:
        if self.apiserver is not None:
            terminate(self.apiserver, timeout=15)
            self.apiserver = None
            self.apiserver_log.close()

    def stop(self) -> None:
        self.stop_apiserver()
        if self.etcd is not None:
            terminate(self.etcd, timeout=15)
            self.etcd = None
            self.etcd_log.close()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.dir / "apiserver.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def log_tails(self) -> dict[str, str]:
        return {"kube-apiserver": self.log_tail()}

    # ------------------------------------------------------------------ clients

    def kubeconfig(self, path: Path, *, token: str | None = None, user: str = "admin",
                   cert: Path | None = None) -> Path:
        """A kubeconfig with a bearer token (the admin's unless ``token``) or a client certificate
        file holding the certificate and its key (``cert``, as kubelet's own kubeconfig)."""
        creds = ({"client-certificate": str(cert), "client-key": str(cert)} if cert is not None
                 else {"token": token or self.admin_token})
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": user, "user": creds}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    def node_kubeconfig(self, path: Path, node: str) -> Path:
        """The node's cri-shim ServiceAccount (rights: deploy/cluster/*rbac.yaml)."""
        return self.kubeconfig(path, token=self.node_tokens[node], user=node)

    def controller_kubeconfig(self, path: Path) -> Path:
        """The controller's ServiceAccount (rights: deploy/cluster/controller.yaml)."""
        return self.kubeconfig(path, token=self.controller_token, user="controller")

    def kubelet_cert(self, node: str) -> Path:
        """The node's kubelet client certificate + key (system:node:<node>, group system:nodes)."""
        return self.dir / f"kubelet-{node}.pem"

    def kubelet_kubeconfig(self, path: Path, node: str, cert: Path | None = None) -> Path:
        """A kubelet's own kubeconfig (/var/lib/kubelet/kubeconfig): its client certificate file,
        ``kubelet_cert(node)`` unless ``cert``. The Node authorizer lets it register its Node."""
        return self.kubeconfig(path, user="default-auth", cert=cert or self.kubelet_cert(node))


def remove(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
