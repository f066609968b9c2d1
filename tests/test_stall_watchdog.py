"""The stall watchdog: every thread's stack on stderr when no Python thread could run for a while."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from remote_g2.errors import ConfigError
from remote_g2.stall_watchdog import STALL_DUMP_ENV, StallWatchdog, maybe_start_stall_watchdog

_SCRIPT = textwrap.dedent("""
    import ctypes, sys, time
    from remote_g2.stall_watchdog import maybe_start_stall_watchdog

    dog = maybe_start_stall_watchdog()
    assert dog is not None and maybe_start_stall_watchdog() is dog  # one per process
    time.sleep(float(sys.argv[1]))           # Python runs: the watchdog keeps re-arming, no dump
    print("--- stall ---", file=sys.stderr, flush=True)
    ctypes.PyDLL(None).sleep(2)              # a C call that keeps the GIL: no Python thread runs for 2 s
    print("--- after ---", file=sys.stderr, flush=True)
    dog.stop()
""")


def _run(env_value: str, idle_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SCRIPT, str(idle_s)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, STALL_DUMP_ENV: env_value})


def test_a_process_that_holds_the_gil_gets_its_stacks_dumped_and_keeps_running():
    out = _run("0.5", 1.5)
    assert out.returncode == 0, out.stderr
    before, _, rest = out.stderr.partition("--- stall ---")
    during, _, after = rest.partition("--- after ---")
    assert "Timeout (0:00:00.500000)!" not in before  # 1.5 s of healthy Python: re-armed, silent
    assert "Timeout (0:00:00.500000)!" in during
    assert "most recent call first" in during and "<module>" in during  # the stuck main thread's frame
    assert "Timeout" not in after


def test_off_unless_asked_and_a_bad_value_is_a_config_error(monkeypatch):
    monkeypatch.delenv(STALL_DUMP_ENV, raising=False)
    assert maybe_start_stall_watchdog() is None
    monkeypatch.setenv(STALL_DUMP_ENV, "soon")
    with pytest.raises(ConfigError, match=STALL_DUMP_ENV):
        maybe_start_stall_watchdog()
    with pytest.raises(ConfigError, match="between"):
        StallWatchdog(0.0)
