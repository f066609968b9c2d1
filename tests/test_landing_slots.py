"""LandingSlots: free slots handed out lowest first, finished loads' slots back at once, failed loads' quarantined."""

from __future__ import annotations

import time

import pytest

from remote_g2.adapters.landing_slots import LandingSlots, valid_prefix


def test_take_give_back_and_quarantine() -> None:
    slots = LandingSlots(range(10, 14), quarantine_s=0.2)
    assert slots.available() == 4
    a = slots.take(2)
    assert a == [10, 11]
    with pytest.raises(ValueError):
        slots.take(3)
    assert slots.available() == 2  # a refused take takes nothing
    slots.give_back(a)
    b = slots.take(4)
    slots.quarantine(b)  # a failed load: a late READ may still land in these
    assert slots.available() == 0
    time.sleep(0.25)
    assert slots.available() == 4


def test_valid_prefix_stops_at_the_first_invalid_slot() -> None:
    assert valid_prefix([5, 6, 7], set()) == 3
    assert valid_prefix([5, 6, 7], {6}) == 1
    assert valid_prefix([5, 6, 7], {5, 7}) == 0
    assert valid_prefix([], {1}) == 0
