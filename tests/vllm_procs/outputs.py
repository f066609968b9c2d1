"""What every vLLM test process does once it has its results: write them atomically, then hold until told."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def write_and_hold(out: str, results: list[dict], hold_file: str | None, hold_s: float) -> None:
    """Write ``results`` to ``out`` (via a temp file, so a reader never sees half), then wait for ``hold_file``.

    While it waits the process stays up: its G2 pool keeps serving, its KV events keep flowing. Bounded by
    ``hold_s``.
    """
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(out)
    if hold_file:
        deadline = time.monotonic() + hold_s
        while not os.path.exists(hold_file) and time.monotonic() < deadline:
            time.sleep(0.1)
