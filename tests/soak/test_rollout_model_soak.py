"""Soak: the paced rollout's model (tests/unit/test_controller_rollout_model.py) over many more
random operator and node sequences than the unit run: 20 per second of ``CRI_SHIM_SOAK_SECONDS``
(1,200 at the 60 s scripts/test.sh sets)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.unit.test_controller_rollout_model import Rollouts

BUDGET = float(os.environ.get("CRI_SHIM_SOAK_SECONDS", "60"))
pytestmark = [pytest.mark.soak, pytest.mark.timeout(BUDGET * 4 + 300)]


class LongRollouts(Rollouts):
    pass


LongRollouts.TestCase.settings = settings(max_examples=max(200, int(BUDGET * 20)), deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_rollout_model_long = LongRollouts.TestCase
