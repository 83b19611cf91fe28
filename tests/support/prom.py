"""Scraping the shim's /metrics as a Prometheus server would, for assertions."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Scrape:
    text: str
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        """One sample; 0 when the labelled series does not exist yet (as PromQL's absent-as-zero)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def bucket(self, name: str, le: str, **labels: str) -> float:
        return self.value(f"{name}_bucket", le=le, **labels)


def _get(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        return r.read().decode()


async def scrape(address: str) -> Scrape:
    text = await asyncio.to_thread(_get, address)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return Scrape(text, samples)
