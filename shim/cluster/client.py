"""The API client of a kubeconfig, whose client-certificate files may be rotated under it.

kubelet's own kubeconfig (``/var/lib/kubelet/kubeconfig``) names its client certificate and key
by file (``/var/lib/kubelet/pki/kubelet-client-current.pem``, which kubelet points at a new
certificate before the old one expires). kubernetes_asyncio reads them once, when the client is
made. Here, before each request, the files' identity (device, inode, size, modification time:
two ``stat`` calls, nothing read) is compared with the pair loaded; when it changed, the pair is
loaded into a new connection pool and the old pool is closed, as client-go closes every
connection on rotation so that none keeps the old identity (a watch in flight ends; its
informer resumes it on the new pool). A pair that cannot be loaded (half written, key and
certificate not matching yet) keeps the old pool and is tried again at the next request.
A kubeconfig with a token, an exec plugin or inline certificate data is used as it is.

``identity_problem``: with kubelet's identity (``system:node:<name>``) the admission policies of
deploy/cluster/node-identity.yaml refuse every write not about ``<name>``, so a ``cluster.node_name``
that differs is said at start, not discovered in refused writes.
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

from kubernetes_asyncio.client import ApiClient, AuthenticationV1Api, Configuration
from kubernetes_asyncio.client.rest import RESTClientObject
from kubernetes_asyncio.config import new_client_from_config

from ..observability import logs

_log = logs.get("cluster")

Stamp = tuple[tuple[int, int, int, int], ...]


def stamp(files: tuple[str, ...]) -> Stamp | None:
    """What identifies the files' content without reading it; None while one is missing."""
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            return None
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class RotatingCertificate(RESTClientObject):
    """The REST client of ``ApiClient``, reloading its client certificate files when they change."""

    def __init__(self, configuration: Configuration) -> None:
        files = (str(configuration.cert_file), str(configuration.key_file or configuration.cert_file))
        self.files = tuple(dict.fromkeys(files))  # one file holding both, as kubelet's
        self.loaded = stamp(self.files)
        super().__init__(configuration)
        self.configuration = configuration
        self.reloads = 0
        self.error = ""  # why the changed files could not be loaded; "" once they were

    async def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        await self.refresh()
        return await super().request(method, url, *args, **kwargs)

    async def refresh(self) -> None:
        """Load the files into a new pool if they changed since loaded (before each request)."""
        now = stamp(self.files)
        if now is not None and now != self.loaded:
            await self._reload(now)

    async def _reload(self, now: Stamp) -> None:
        try:
            fresh = RESTClientObject(self.configuration)
        except (OSError, ssl.SSLError) as e:
            if str(e) != self.error:
                logs.log(_log, logging.WARNING, "client certificate changed but cannot be loaded; the previous "
                         "one stays in use", file=self.files[0], error=str(e))
            self.error = str(e)
            return
        old, self.pool_manager = self.pool_manager, fresh.pool_manager
        self.loaded = now
        self.reloads += 1
        self.error = ""
        logs.log(_log, logging.INFO, "client certificate reloaded: new connections use it", file=self.files[0])
        await old.close()


async def new_client(kubeconfig: str) -> ApiClient:
    """The client of ``kubeconfig``; its client-certificate files, if any, are followed (above)."""
    api = await new_client_from_config(config_file=kubeconfig, persist_config=False)
    cfg = api.configuration
    if cfg.cert_file and os.path.isfile(str(cfg.cert_file)):
        old = api.rest_client
        api.rest_client = RotatingCertificate(cfg)
        await old.close()
    return api


NODE_USER = "system:node:"  # kubelet's user name prefix (group system:nodes)


async def user_name(api: ApiClient, request_timeout: float) -> str:
    """Who the API server says this client is (SelfSubjectReview, authentication.k8s.io/v1, GA in 1.28)."""
    review = await AuthenticationV1Api(api).create_self_subject_review(
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},  # type: ignore[arg-type]
        _request_timeout=request_timeout)
    return str(review.status.user_info.username)


def identity_problem(user: str, node_name: str) -> str:
    """Why this node's writes will be refused: its user is another node's kubelet; "" when not."""
    if not user.startswith(NODE_USER) or user[len(NODE_USER):] == node_name:
        return ""
    return (f"the kubeconfig's user is {user} but cluster.node_name is {node_name}: the API server refuses "
            f"this node's status writes (set cluster.node_name: {user[len(NODE_USER):]})")
