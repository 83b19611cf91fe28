"""Soak: the collapsed pulls' state machine (tests/unit/test_scheduler_flights_state.py) over many
more random sequences than the unit run: 20 per second of ``CRI_SHIM_SOAK_SECONDS`` (1,200 at the
60 s scripts/test.sh sets), 80 steps each."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.unit.test_scheduler_flights_state import Flights

BUDGET = float(os.environ.get("CRI_SHIM_SOAK_SECONDS", "60"))
pytestmark = [pytest.mark.soak, pytest.mark.timeout(BUDGET * 4 + 300)]


class LongFlights(Flights):
    pass


LongFlights.TestCase.settings = settings(max_examples=max(100, int(BUDGET * 20)), stateful_step_count=80,
                                         deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_flights_long = LongFlights.TestCase
