"""The source rank's NIXL agent (source/rank_agent.py): its progress thread, with a real agent."""

from __future__ import annotations

import os
import time

import numpy as np

from remote_g2.secondary_pool import MemoryRegion
from remote_g2.source.rank_agent import RankAgent


def _wait_for(cond, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_a_wake_makes_progress_at_once_instead_of_after_the_idle_sleep() -> None:
    """Over UCX TCP every READ needs the source's progress: a lease opening must not wait out the idle pace."""
    buf = np.zeros(1 << 16, dtype=np.uint8)
    agent = RankAgent(f"test-rank-agent-{os.getpid()}", [MemoryRegion(buf.ctypes.data, buf.nbytes)],
                      idle_interval_s=30.0, busy_interval_s=30.0)
    calls: list[float] = []
    real = agent._agent.get_new_notifs
    agent._agent.get_new_notifs = lambda: (calls.append(time.monotonic()), real())[1]
    try:
        agent.start_progress()
        assert _wait_for(lambda: len(calls) == 1, 5.0)
        time.sleep(0.3)
        assert len(calls) == 1  # idle: asleep for 30 s
        woke_at = time.monotonic()
        agent.wake()
        assert _wait_for(lambda: len(calls) == 2, 2.0)
        assert calls[1] - woke_at < 0.5
    finally:
        t0 = time.monotonic()
        agent.close()  # also wakes the thread: closing never waits out a sleep
    assert time.monotonic() - t0 < 5.0
