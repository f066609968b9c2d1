"""A fault-injection transfer adapter for engine fault tests: the real NIXL adapter, slowed down.

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
