"""Soak: the pin ledger's state machine (tests/unit/test_pin_ledger_machine.py) over many more
random sequences than the unit run: 5 per second of ``CRI_SHIM_SOAK_SECONDS`` (300 at the
60 s scripts/test.sh sets), 40 steps each."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.unit.test_pin_ledger_machine import LedgerMachine

BUDGET = float(os.environ.get("CRI_SHIM_SOAK_SECONDS", "60"))
pytestmark = [pytest.mark.soak, pytest.mark.timeout(BUDGET * 4 + 300)]


class LongLedgerMachine(LedgerMachine):
    pass


LongLedgerMachine.TestCase.settings = settings(max_examples=max(50, int(BUDGET * 5)), stateful_step_count=40,
                                               deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_pin_ledger_long = LongLedgerMachine.TestCase
