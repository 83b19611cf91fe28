"""Running ``cri-shim controller``: the API client, the Lease lock and elector, the manager, signals."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.config import load_incluster_config

from ..cluster.client import new_client
from ..observability import logs
from .leader import KubeLeaseLock, LeaderElector
from .manager import Manager

_log = logs.get("controller")


async def _client(kubeconfig: str | None) -> ApiClient:
    if kubeconfig:
        return await new_client(kubeconfig)
    load_incluster_config()  # type: ignore[no-untyped-call]  # the Pod's ServiceAccount
    return ApiClient()


def default_identity() -> str:
    """The Pod's name (its hostname) plus a random suffix, as client-go's examples do."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


async def run(*, kubeconfig: str | None, namespace: str, lease_name: str, identity: str, lease_duration: float,
              renew_deadline: float, retry_period: float, stale_after: float) -> int:
    api = await _client(kubeconfig)
    lock = KubeLeaseLock(api, namespace=namespace, name=lease_name)
    elector = LeaderElector(lock, identity=identity, lease_duration=lease_duration, renew_deadline=renew_deadline,
                            retry_period=retry_period)
    ctl = Manager(api, elector, lease=lock, stale_after=stale_after)
    loop = asyncio.get_running_loop()
    task = loop.create_task(ctl.run(), name="controller")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    logs.log(_log, logging.INFO, "controller started", identity=identity, lease=f"{namespace}/{lease_name}",
             lease_duration=lease_duration, renew_deadline=renew_deadline, retry_period=retry_period,
             stale_after=stale_after)
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        await elector.release()
        await api.close()
    logs.log(_log, logging.INFO, "controller stopped", identity=identity)
    return 0
