"""The source rank's NIXL agent (source/rank_agent.py) and its progress rule (source/progress_pace.py).

The rule is pinned as a table; the agent with real NIXL agents: a reader in
another process READs a source's pool on one host (``cma``) in each mode,
and the source's CPU is measured while it is idle (the processes of
``bench.source.bench_source_progress``, whose smoke test runs both modes over
``UCX_TLS=tcp``, where every READ needs the source).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import pytest

from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.source.config import SourceConfig
from remote_g2.source.progress_pace import ProgressPace, cma_usable, reads_need_source
from remote_g2.source.rank_agent import RankAgent
from remote_g2.errors import ConfigError

from bench.source import bench_source_progress  # (its source and reader processes)


@pytest.mark.parametrize(("ucx_tls", "needs"), [
    (None, True), ("", True), ("all", True),            # UCX picks per peer: TCP to another host may be among them
    ("tcp", True), ("tcp,cma", True), ("ud_x,rc_x", True),  # emulated READs (and UD) allowed
    ("sm,self", True), ("posix,self", True),             # the shared-memory mailboxes emulate READ too
    ("ib", True),                                        # the alias brings UD
    ("cma,self", False), ("cma", False), ("rc_x,dc_x,cma,self", False), ("rc,cuda_copy,cuda_ipc", False),
    ("^tcp", True),                                      # everything else stays: UD, the mailboxes
    ("^tcp,ud,mm", False),                               # nothing emulating is left
    ("CMA, Self", False), ("frobnicate", True),          # case and spaces; unknown names count as emulating
])
def test_which_transports_need_the_sources_progress(ucx_tls: str | None, needs: bool) -> None:
    assert reads_need_source(ucx_tls) is needs


@pytest.mark.parametrize(("ucx_tls", "cma_ok", "local", "remote"), [
    (None, True, 0.005, 0.0002),           # the default: cma on this host, TCP (or RDMA) elsewhere
    (None, False, 0.0002, 0.0002),         # the kernel forbids cma: this host's READs are mailbox messages
    ("tcp", True, 0.0002, 0.0002),         # UCX_TLS=tcp: every READ is emulated
    ("^tcp,ud,mm", True, 0.005, 0.005),    # nothing emulating left: only wire-ups need us
    ("rc_x,cma,self", True, 0.005, 0.005),
    ("posix,tcp", True, 0.0002, 0.0002),   # no cma allowed
])
def test_poll_paces_by_where_the_readers_are(ucx_tls: str | None, cma_ok: bool, local: float, remote: float) -> None:
    pace = ProgressPace(mode="poll", emulated_s=0.0002, one_sided_s=0.005, idle_s=1.0, ucx_tls=ucx_tls, cma_ok=cma_ok)
    assert pace.poll_interval_s("local") == local
    assert pace.poll_interval_s("remote") == remote
    assert pace.poll_interval_s("none") == 1.0  # no lease open: nobody is reading
    assert pace.poll_interval_s("new") == 0.0002  # a reader's first READ: the wire-up waits on us
    assert "event-driven" in pace.describe("event") and "UCX_TLS" in pace.describe("poll")


@pytest.mark.parametrize(("scope", "cap_eff", "usable"), [
    (None, "0", True), ("0", "0", True), ("1", "0", True),   # no Yama / classic / UCX sets PR_SET_PTRACER
    ("2", "0000000000080000", True), ("2", "0", False),      # admin-only: CAP_SYS_PTRACE (bit 19) needed
    ("3", "000001ffffffffff", False),                        # no attach at all
])
def test_cma_follows_the_kernels_ptrace_policy(tmp_path: Path, scope: str | None, cap_eff: str, usable: bool) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text(f"Name:\tpython\nCapEff:\t{cap_eff}\n")
    if scope is not None:
        (tmp_path / "sys" / "kernel" / "yama").mkdir(parents=True)
        (tmp_path / "sys" / "kernel" / "yama" / "ptrace_scope").write_text(scope + "\n")
    assert cma_usable(str(tmp_path)) is usable


def test_the_source_config_builds_the_pace_and_rejects_bad_settings() -> None:
    cfg = SourceConfig.from_env({"REMOTE_G2_SOURCE_PROGRESS": "Event", "REMOTE_G2_SOURCE_ONE_SIDED_PROGRESS_MS": "2",
                                 "REMOTE_G2_SOURCE_EVENT_TIMEOUT_MS": "50"})
    pace = cfg.progress_pace("cma")
    assert (pace.mode, pace.one_sided_s, pace.event_timeout_s, pace.ucx_tls) == ("event", 0.002, 0.05, "cma")
    assert SourceConfig().progress == "poll" and SourceConfig().idle_progress_interval_ms >= 1000
    with pytest.raises(ConfigError, match="progress"):
        SourceConfig.from_env({"REMOTE_G2_SOURCE_PROGRESS": "spin"})
    with pytest.raises(ConfigError, match="EVENT_TIMEOUT"):
        SourceConfig.from_env({"REMOTE_G2_SOURCE_EVENT_TIMEOUT_MS": "0"})


def _wait_for(cond, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_a_wake_makes_progress_at_once_instead_of_after_the_idle_sleep() -> None:
    """Poll mode: a lease opening must not wait out the idle pace (over TCP every READ needs the source)."""
    buf = np.zeros(1 << 16, dtype=np.uint8)
    readers = ["none"]
    agent = RankAgent(f"test-rank-agent-{os.getpid()}", [MemoryRegion(buf.ctypes.data, buf.nbytes)],
                      readers=lambda: readers[0],
                      pace=ProgressPace(mode="poll", idle_s=30.0, emulated_s=0.5, one_sided_s=30.0, cma_ok=True))
    assert agent.progress_mode == "poll"
    calls: list[float] = []
    real = agent._agent.get_new_notifs
    agent._agent.get_new_notifs = lambda: (calls.append(time.monotonic()), real())[1]
    try:
        agent.start_progress()
        assert _wait_for(lambda: len(calls) == 1, 5.0)
        time.sleep(0.3)
        assert len(calls) == 1  # idle: asleep for 30 s
        readers[0] = "local"  # a lease of a reader on this host that READs with cma: no hurry
        agent.wake()
        time.sleep(0.3)
        assert len(calls) == 1
        readers[0] = "remote"  # one elsewhere (UCX_TLS unset: READs may be emulated)
        woke_at = time.monotonic()
        agent.wake()
        assert _wait_for(lambda: len(calls) == 2, 0.3)
        assert calls[1] - woke_at < 0.3
        assert _wait_for(lambda: len(calls) == 3, 2.0)  # and it keeps the emulated pace (0.5 s here)
    finally:
        t0 = time.monotonic()
        agent.close()  # also wakes the thread: closing never waits out a sleep
    assert time.monotonic() - t0 < 5.0


def test_event_mode_runs_no_thread_of_ours() -> None:
    buf = np.zeros(1 << 16, dtype=np.uint8)
    agent = RankAgent(f"test-rank-agent-ev-{os.getpid()}", [MemoryRegion(buf.ctypes.data, buf.nbytes)],
                      pace=ProgressPace(mode="event"))
    try:
        assert agent.progress_mode == "event"
        agent.start_progress()
        agent.wake()  # harmless: NIXL's thread needs no wake-up
        assert agent._thread is None
    finally:
        agent.close()


def _run_pair(mode: str, fabric: str, tmp_path: Path) -> dict:
    """One source (4 MiB) in ``mode`` and a reader, over ``fabric``: bench.source.bench_source_progress's run."""
    args = argparse.Namespace(mib=4, reps=3, read_timeout_s=10.0, idle_s=1.0)
    return bench_source_progress.run_once(bench_source_progress.Config(fabric, 1, 64), mode, args, tmp_path)


@pytest.mark.parametrize("fabric", ["one-host"])  # UCX_TLS=tcp, both modes: tests/test_bench_source_progress.py
@pytest.mark.parametrize("mode", ["event", "poll"])
def test_reads_complete_in_each_mode_and_an_idle_source_takes_no_cpu(mode: str, fabric: str, tmp_path: Path) -> None:
    """Every READ of 4 MiB comes back byte-exact; then, with no reader, the source sleeps.

    The reader is on this host: its READs are one-sided (``cma``), the
    wire-up is what needs the source. Idle, in event mode, costs only NIXL's
    timed wake-ups (every 5 ms by default); poll mode's pace is the one for
    readers on this host.
    """
    run = _run_pair(mode, fabric, tmp_path)  # raises on a wrong byte, a stalled READ, or a mode not in effect
    assert run["mode"] == mode and run["bytes_checked"] == {"warmup": True, "last_read": True}
    # the reader is on this host: cma (one-sided) unless UCX_TLS=tcp, where every READ is emulated
    assert run["poll_interval_s"] == (None if mode == "event" else {"one-host": 0.005 if cma_usable() else 0.0002, "tcp": 0.0002}[fabric])
    if mode == "event":
        assert run["idle_cpu_pct_per_source"] < 5, f"an idle event-driven source used {run['idle_cpu_pct']} % CPU"
