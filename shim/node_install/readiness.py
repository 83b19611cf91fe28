"""Whether kubelet is back after a restart: its ``/healthz`` answers 200 and, when there is a
kubeconfig, its Node is Ready with a heartbeat from after the restart.

The Node is read with kubelet's own kubeconfig (kubeadm: ``/etc/kubernetes/kubelet.conf``):
the API server's Node authorizer lets a kubelet read its own Node, so no cluster credential
is needed, and the node's name is the kubeconfig's user, ``system:node:<name>``
(``SelfSubjectReview``). A Node stays Ready for a while after its kubelet stopped (the
node lifecycle controller marks it Unknown only after 40 s without a heartbeat), so Ready
counts only with a ``lastHeartbeatTime`` later than the second the restart returned in: every
heartbeat the old kubelet wrote is older. kubelet writes a full status when it starts, so
the new one is there within its first status update. Without a kubeconfig (a standalone
kubelet) ``/healthz`` alone decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .host import Host, HostError

POLL_SECONDS = 1.0
CALL_TIMEOUT = 5.0


@dataclass(frozen=True)
class Probe:
    """What to look at: kubelet's healthz address, its kubeconfig and Node name (None: from the kubeconfig)."""

    healthz: tuple[str, int] | None
    kubeconfig: str | None
    node_name: str | None

    def describe(self) -> str:
        parts = []
        if self.healthz is not None:
            parts.append(f"kubelet's /healthz (http://{self.healthz[0]}:{self.healthz[1]}/healthz)")
        if self.kubeconfig is not None:
            parts.append(f"{'Node ' + self.node_name if self.node_name else 'its Node'} Ready (read with "
                         f"{self.kubeconfig})")
        return " and ".join(parts)


def check(host: Host, probe: Probe, since: float | None) -> str:
    """"" when kubelet is healthy and its Node Ready (with a heartbeat later than the second of
    ``since``, when given); else why not."""
    if probe.healthz is not None:
        why = host.healthz(*probe.healthz, timeout=CALL_TIMEOUT)
        if why:
            return f"kubelet not healthy: {why}"
    if probe.kubeconfig is None:
        return ""
    try:
        node = host.node(probe.kubeconfig, probe.node_name, CALL_TIMEOUT)
    except HostError as e:
        return str(e)
    if not node.ready:
        return f"Node {node.name} not Ready ({node.why})"
    if since is not None and (node.heartbeat is None or node.heartbeat <= math.floor(since)):
        return f"Node {node.name}: no heartbeat from the restarted kubelet yet"
    return ""


def wait(host: Host, probe: Probe, since: float, timeout: float) -> tuple[str, float]:
    """Poll ``check`` until it passes or ``timeout`` seconds went by: ("", seconds taken), or
    (the last reason, seconds taken)."""
    start = host.monotonic()
    while True:
        why = check(host, probe, since)
        took = host.monotonic() - start
        if not why or took >= timeout:
            return why, took
        host.sleep(min(POLL_SECONDS, max(0.0, timeout - took)))
