"""What ``cri-shim node install`` asks of the node besides its files: systemd, kubelet's command
line, CRI calls, kubelet's healthz and its Node on the API server.

``Host`` is the interface; ``SystemHost`` the real node. Tests give a fake (tests/unit/
test_node_install.py), so the install and uninstall logic runs without systemd or kubelet.
"""

from __future__ import annotations

import asyncio
import http.client
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, Sequence

import grpc

from ..cri.methods import cri_method
from ..proto.runtime.v1 import api_pb2

#: where each kubelet renews its Lease, its heartbeat since Kubernetes 1.17
NODE_LEASES = "kube-node-lease"


class HostError(Exception):
    """A check could not be made or failed; the message says why, for the operator."""


@dataclass(frozen=True)
class Done:
    """A command's exit status and output."""

    rc: int
    out: str
    err: str


@dataclass(frozen=True)
class Runtime:
    """A CRI runtime's answer to Version."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


@dataclass(frozen=True)
class NodeView:
    """A Node as the API server shows it to the node's kubelet identity."""

    name: str
    ready: bool
    why: str  #: the Ready condition's reason and message
    #: when kubelet last renewed its Lease (kube-node-lease/<name>; seconds since the epoch), None if never
    renewed: float | None


class Host(Protocol):
    def run(self, argv: Sequence[str], timeout: float) -> Done:
        """Run a command (systemctl, journalctl) and wait for it."""

    def command_line(self, pid: int) -> list[str] | None:
        """A process's argv; None when it is gone."""

    def cri_version(self, endpoint: str, timeout: float) -> Runtime:
        """RuntimeService/Version on ``endpoint`` (``unix:///...``); HostError with the gRPC status."""

    def pinned_images(self, endpoint: str, timeout: float) -> dict[str, list[str]]:
        """ImageService/ListImages on ``endpoint``: image ID -> its tags, for images marked pinned."""

    def healthz(self, host: str, port: int, timeout: float) -> str:
        """"" when kubelet's http://host:port/healthz answers 200; else why not."""

    def node(self, kubeconfig: str, name: str | None, timeout: float) -> NodeView:
        """The Node ``name`` (None: the one the kubeconfig's user is kubelet of, system:node:<name>)."""

    def wall(self) -> float:
        """Seconds since the epoch (kubelet stamps Node heartbeats with this clock)."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


def _target(endpoint: str) -> str:
    return endpoint if "://" in endpoint else f"unix://{endpoint}"


def _unary(endpoint: str, method: str, request: bytes, timeout: float) -> bytes:
    try:
        with grpc.insecure_channel(_target(endpoint)) as channel:
            call = channel.unary_unary(method, request_serializer=_same, response_deserializer=_same)
            return call(request, timeout=timeout)
    except grpc.RpcError as e:
        raise HostError(f"{e.code().name}: {e.details()}") from None


def _same(data: bytes) -> bytes:
    return data


class SystemHost:
    """The node this runs on."""

    def run(self, argv: Sequence[str], timeout: float) -> Done:
        try:
            r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError as e:
            return Done(127, "", str(e))
        except subprocess.TimeoutExpired:
            return Done(124, "", f"{argv[0]} did not finish within {timeout:g} s")
        return Done(r.returncode, r.stdout, r.stderr)

    def command_line(self, pid: int) -> list[str] | None:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            return None
        return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] or None

    def cri_version(self, endpoint: str, timeout: float) -> Runtime:
        request = api_pb2.VersionRequest(version="v1").SerializeToString()
        v = api_pb2.VersionResponse.FromString(
            _unary(endpoint, cri_method("RuntimeService", "Version"), request, timeout))
        return Runtime(v.runtime_name, v.runtime_version)

    def pinned_images(self, endpoint: str, timeout: float) -> dict[str, list[str]]:
        answer = api_pb2.ListImagesResponse.FromString(
            _unary(endpoint, cri_method("ImageService", "ListImages"), b"", timeout))
        return {i.id: list(i.repo_tags) for i in answer.images if i.pinned}

    def healthz(self, host: str, port: int, timeout: float) -> str:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", "/healthz")
            r = conn.getresponse()
            body = r.read(200).decode(errors="replace").strip()
            return "" if r.status == 200 else f"/healthz answered {r.status} {body}"
        except OSError as e:
            return f"/healthz on {host}:{port}: {e}"
        finally:
            conn.close()

    def node(self, kubeconfig: str, name: str | None, timeout: float) -> NodeView:
        return asyncio.run(_read_node(kubeconfig, name, timeout))

    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


async def _read_node(kubeconfig: str, name: str | None, timeout: float) -> NodeView:
    import aiohttp
    from kubernetes_asyncio.client import CoordinationV1Api, CoreV1Api
    from kubernetes_asyncio.client.exceptions import ApiException
    from kubernetes_asyncio.config import ConfigException

    from ..cluster.client import NODE_USER, new_client, user_name

    try:
        api = await new_client(kubeconfig)
    except (ConfigException, OSError, ValueError) as e:
        raise HostError(f"kubeconfig {kubeconfig}: {e}") from None
    try:
        if name is None:
            user = await user_name(api, timeout)
            if not user.startswith(NODE_USER):
                raise HostError(f"kubeconfig {kubeconfig} is {user}, not a kubelet (system:node:<name>): "
                                f"pass --node-name")
            name = user[len(NODE_USER):]
        node = await CoreV1Api(api).read_node(name, _request_timeout=timeout)
        try:
            lease = await CoordinationV1Api(api).read_namespaced_lease(name, NODE_LEASES, _request_timeout=timeout)
            renew = lease.spec.renew_time if lease.spec else None
        except ApiException as e:
            if e.status != 404:
                raise
            renew = None
    except ApiException as e:
        raise HostError(f"Node {name or '(this kubelet)'}: {e.status} {e.reason}") from None
    except (TimeoutError, OSError, aiohttp.ClientError) as e:
        raise HostError(f"the API server in {kubeconfig}: {type(e).__name__}: {e}") from None
    finally:
        await api.close()
    renewed = renew.timestamp() if isinstance(renew, datetime) else None
    for c in (node.status.conditions or []) if node.status else []:
        if c.type == "Ready":
            return NodeView(name, c.status == "True", f"{c.reason}: {c.message}", renewed)
    return NodeView(name, False, "no Ready condition yet", renewed)
