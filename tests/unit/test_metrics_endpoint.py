"""The /metrics endpoint's bounds are config values checked at load (the endpoint itself, served
by a shim process: tests/process/test_metrics_endpoint.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("key, value", [("max_connections", 0), ("timeout_seconds", 0)])
def test_metrics_bounds_are_validated(key: str, value: int) -> None:
    from shim.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match=f"metrics.{key}"):
        from_dict({"metrics": {key: value}})


