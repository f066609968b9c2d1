"""The vLLM tier's fetch thread lowers the interpreter's switch interval while a job runs, and puts it back."""

from __future__ import annotations

import sys
import threading

import pytest

from remote_g2.adapters.vllm_tier.fetching import QuickHandoff


def test_the_switch_interval_is_lowered_inside_and_restored_by_the_last_one_out() -> None:
    before = sys.getswitchinterval()
    handoff = QuickHandoff(0.0005)
    try:
        with handoff:
            assert sys.getswitchinterval() == pytest.approx(0.0005, abs=1e-7)
            inner_done = threading.Event()

            def other() -> None:
                with handoff:
                    assert sys.getswitchinterval() == pytest.approx(0.0005, abs=1e-7)
                inner_done.set()

            t = threading.Thread(target=other)
            t.start()
            t.join(5)
            assert inner_done.is_set()
            assert sys.getswitchinterval() == pytest.approx(0.0005, abs=1e-7)  # the other left first: still low
        assert sys.getswitchinterval() == pytest.approx(before, abs=1e-7)
    finally:
        sys.setswitchinterval(before)


def test_a_change_made_by_someone_else_meanwhile_is_kept_and_zero_changes_nothing() -> None:
    before = sys.getswitchinterval()
    try:
        handoff = QuickHandoff(0.0005)
        with handoff:
            sys.setswitchinterval(0.002)  # another part of the process chose its own
        assert sys.getswitchinterval() == pytest.approx(0.002, abs=1e-7)
        sys.setswitchinterval(before)
        with QuickHandoff(0):
            assert sys.getswitchinterval() == pytest.approx(before, abs=1e-7)
        sys.setswitchinterval(0.0001)
        with QuickHandoff(0.0005):  # already lower: left as it is
            assert sys.getswitchinterval() == pytest.approx(0.0001, abs=1e-7)
        assert sys.getswitchinterval() == pytest.approx(0.0001, abs=1e-7)
    finally:
        sys.setswitchinterval(before)
