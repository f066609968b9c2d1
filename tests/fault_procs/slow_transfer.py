"""Fault-injection transfer adapters for engine fault tests: the real NIXL adapter, slowed down.

Engines load it by module path (``--transfer fault_procs.slow_transfer:SlowNixlTransfer``,
with ``tests/`` on ``PYTHONPATH``). Each ``start_read`` first touches the file
named by ``REMOTE_G2_TEST_READING_FILE`` (so a test knows the lease is
resolved and the READ is about to be posted), then sleeps
``REMOTE_G2_TEST_READ_DELAY_S`` seconds: a stand-in for a slow fabric, which
opens a window in which a test can kill the source or the target. No real
part produces such a window on demand on loopback.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from remote_g2.adapters.nixl_transfer import NixlTransfer


class SlowNixlTransfer(NixlTransfer):
    def start_read(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        marker = os.environ.get("REMOTE_G2_TEST_READING_FILE")
        if marker:
            Path(marker).touch()
        time.sleep(float(os.environ.get("REMOTE_G2_TEST_READ_DELAY_S", "0")))
        return super().start_read(*args, **kw)


class LateNixlTransfer(NixlTransfer):
    """The real NIXL adapter whose READs report done only ``REMOTE_G2_TEST_DONE_DELAY_S`` after they were posted.

    Unlike :class:`SlowNixlTransfer` nothing blocks: the READ is posted at
    once and the engine keeps stepping, but the load stays in flight for the
    delay (a slow fabric as the engine sees it). ``start_read`` touches
    ``REMOTE_G2_TEST_READING_FILE`` as the READ is posted.
    """

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._posted_at: dict[int, float] = {}  # id(handle) -> when its READ was posted

    def start_read(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        handle = super().start_read(*args, **kw)
        self._posted_at[id(handle)] = time.monotonic()
        marker = os.environ.get("REMOTE_G2_TEST_READING_FILE")
        if marker:
            Path(marker).touch()
        return handle

    def poll(self, handle: Any) -> Any:  # type: ignore[override]
        state = super().poll(handle)
        delay = float(os.environ.get("REMOTE_G2_TEST_DONE_DELAY_S", "0"))
        if state == "done" and time.monotonic() - self._posted_at.get(id(handle), 0.0) < delay:
            return "pending"
        return state

    def release(self, handle: Any) -> None:  # type: ignore[override]
        self._posted_at.pop(id(handle), None)
        super().release(handle)
