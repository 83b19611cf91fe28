"""Whether kubelet is back after a restart: its ``/healthz`` answers 200 and, when there is a
kubeconfig, its Node is Ready as the restarted kubelet sees it.

The Node is read with kubelet's own kubeconfig (kubeadm: ``/etc/kubernetes/kubelet.conf``):
the API server's Node authorizer lets a kubelet read its own Node and Lease, so no cluster
credential is needed, and the node's name is the kubeconfig's user, ``system:node:<name>``
(``SelfSubjectReview``).

A Node's Ready condition says what the last kubelet wrote: it stays True for a while after
kubelet stopped, and a kubelet that finds nothing changed does not write it again (its
heartbeat is its Lease, ``kube-node-lease/<name>``, renewed every 10 s; the Node's status is
written only when it changes, or every 5 minutes). So kubelet counts as back when, all at once:
``/healthz`` answers; its Lease was renewed after the restart (the new kubelet reaches the API
server); and its Node is Ready at least one node status update period after the restart
(``nodeStatusUpdateFrequency``, 10 s by default), by when the new kubelet has computed the
Node's status once and would have written NotReady (a runtime it cannot reach, PLEG not
healthy). Without a kubeconfig (a standalone kubelet) ``/healthz`` alone decides.
"""

from __future__ import annotations

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
    status_period: float = 10.0  #: kubelet's nodeStatusUpdateFrequency, seconds

    def describe(self) -> str:
        parts = []
        if self.healthz is not None:
            parts.append(f"kubelet's /healthz (http://{self.healthz[0]}:{self.healthz[1]}/healthz)")
        if self.kubeconfig is not None:
            parts.append(f"{'Node ' + self.node_name if self.node_name else 'its Node'} Ready (read with "
                         f"{self.kubeconfig})")
        return " and ".join(parts)


def check(host: Host, probe: Probe, since: float | None) -> str:
    """"" when kubelet is healthy and its Node Ready (as a kubelet restarted at ``since`` sees it,
    when given); else why not."""
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
    if since is None:
        return ""
    if node.renewed is None or node.renewed <= since:
        return f"Node {node.name}: the restarted kubelet has not renewed its Lease yet"
    if host.wall() < since + probe.status_period:
        return (f"Node {node.name}: Ready, until the restarted kubelet's first node status update "
                f"({probe.status_period:g} s after the restart)")
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
