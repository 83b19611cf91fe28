"""Events about this node's ``NodeImageSetStatus``, bounded per node as kubelet's event recorder
bounds its own (client-go's ``EventCorrelator``):

* spam filter: one token bucket for the node (every Event here has the same source and object):
  a burst of ``cluster.event_burst`` (25, as client-go), then one per
  ``cluster.event_interval_seconds`` (300 s, as client-go's 1/300 qps). An Event over it is not
  sent (counted in ``cri-shim status`` as ``events_dropped``; the status object still counts
  every failure). Creating an Event and bumping the count of one take a token each.
* aggregation: once ``SIMILAR`` Events of the same type and reason with different messages were
  recorded within ``SIMILAR_WINDOW`` seconds, the next ones become one Event
  ``(combined from similar events): <the latest message>`` (its message and count updated);
* series: an Event equal to one already sent (type, reason, message) is not created again; the
  existing one's ``count`` and ``lastTimestamp`` are patched (created anew if it is gone, e.g.
  after the API server's event TTL). At most ``REMEMBERED`` sent Events are remembered (LRU).

Besides, node_report.py sends at most one Event per set and reason every ``event_interval_seconds``.
So a node makes at most ``event_burst`` Event requests at once and one per
``event_interval_seconds`` after that, whatever the number of sets.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from kubernetes_asyncio.client import CoreV1Api

from ..observability import logs
from ..relay.bucket import TokenBucket
from .informer import describe
from .objects import FIELD_MANAGER, NODE_STATUS

_log = logs.get("cluster")
SIMILAR = 10  # client-go's maxSimilarEvents
SIMILAR_WINDOW = 600.0  # client-go's aggregation interval (10 minutes)
REMEMBERED = 4096  # client-go's LRU cache size
COMBINED = "(combined from similar events): "


def timestamp() -> str:
    """Now, as the API server writes times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class _Sent:
    name: str
    count: int


class EventRecorder:
    def __init__(self, node_name: str, namespace: str, *, burst: int, interval: float, request_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node_name = node_name
        self.namespace = namespace
        self.request_timeout = request_timeout
        self._clock = clock
        self._bucket = TokenBucket(burst, 1.0 / interval if interval > 0 else float("inf"), clock)
        self._similar: dict[tuple[str, str], tuple[float, set[str]]] = {}  # (type, reason) -> (window start, messages)
        self._sent: OrderedDict[tuple[str, str, str], _Sent] = OrderedDict()
        self.uid = ""
        self.created = 0
        self.patched = 0
        self.dropped = 0
        self.errors = 0

    def _aggregate(self, type_: str, reason: str, message: str) -> tuple[str, tuple[str, str, str]]:
        """(the message to send, the key of the Event it counts on)."""
        now = self._clock()
        start, seen = self._similar.get((type_, reason), (now, set()))
        if now - start > SIMILAR_WINDOW:
            start, seen = now, set()
        if len(seen) <= SIMILAR:  # enough to know; a window's messages are not all kept
            seen.add(message)
        self._similar[(type_, reason)] = (start, seen)
        if len(seen) > SIMILAR:
            return COMBINED + message, (type_, reason, COMBINED)
        return message, (type_, reason, message)

    async def record(self, core: CoreV1Api, type_: str, reason: str, message: str) -> bool:
        """Send (or count) one Event; False when the spam filter or the API refused it."""
        message, key = self._aggregate(type_, reason, message[:1024])
        if not self._bucket.take():
            self.dropped += 1
            return False
        sent = self._sent.get(key)
        ts = timestamp()
        try:
            if sent is not None:
                self._sent.move_to_end(key)
                if await self._patch(core, sent, message, ts):
                    return True
            name = await self._create(core, type_, reason, message, ts)
        except Exception as e:
            self.errors += 1
            logs.log(_log, logging.DEBUG, "cannot create an Event", error=describe(e))
            return False
        self._sent[key] = _Sent(name, 1)
        while len(self._sent) > REMEMBERED:
            self._sent.popitem(last=False)
        return True

    async def _patch(self, core: CoreV1Api, sent: _Sent, message: str, ts: str) -> bool:
        """Count one more on the Event sent before; False when it is gone (create it anew)."""
        if not sent.name:
            return False
        try:
            await core.patch_namespaced_event(  # type: ignore[call-arg]  # .pyi lacks _content_type
                sent.name, self.namespace, {"count": sent.count + 1, "lastTimestamp": ts, "message": message},
                _content_type="application/merge-patch+json", _request_timeout=self.request_timeout)
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return False
            raise
        sent.count += 1
        self.patched += 1
        return True

    async def _create(self, core: CoreV1Api, type_: str, reason: str, message: str, ts: str) -> str:
        body = {
            "metadata": {"generateName": f"{self.node_name}.", "namespace": self.namespace},
            "involvedObject": {"apiVersion": NODE_STATUS.api_version, "kind": NODE_STATUS.kind,
                               "name": self.node_name, "uid": self.uid},
            "reason": reason, "type": type_, "message": message,
            "source": {"component": FIELD_MANAGER, "host": self.node_name},
            "reportingComponent": FIELD_MANAGER, "reportingInstance": self.node_name,
            "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
        }
        resp: Any = await core.create_namespaced_event(
            self.namespace, body,  # type: ignore[arg-type]  # .pyi: a CoreV1Event; a dict works
            _request_timeout=self.request_timeout)
        self.created += 1
        meta = resp.get("metadata") if isinstance(resp, dict) else getattr(resp, "metadata", None)
        name = meta.get("name") if isinstance(meta, dict) else getattr(meta, "name", None)
        return str(name or "")

    def status(self) -> dict[str, int]:
        return {"created": self.created, "count_updates": self.patched, "dropped": self.dropped,
                "errors": self.errors}
