"""End-to-end benchmark: time to first token of a long prompt with a remote hit, a local hit, and recompute.

Everything real: a registry (embedded store) in this process, a source
reference engine and a target reference engine under ``mpiexec`` with NIXL
agents, the same prompts through both. Per repeat (a fresh prompt each):

1. the source serves the prompt (computes it; its blocks go to G2 and the registry);
2. the target serves it with every cache off — **recompute**;
3. the target serves it with remote reuse — **remote hit** (every reusable
   block read from the source's G2 over NIXL, the last block computed);
4. the target serves it again — **local hit** (the blocks are in its own G1 now).

Every run's tokens and logits must be identical bit for bit (else the
benchmark fails). The table shows medians over the repeats and the ratios,
which are what to compare on a noisy machine.

    python -m bench.transfer.bench_e2e [--tokens 2048] [--repeats 3] [--source-tp 2] [--target-tp 2] [--mla]
                                       [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

from bench.common import write_result
from remote_g2.adapters.reference.launch import EngineProcess
from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer

from remote_g2.identity.hashing import chain_block_hashes

TPB = 16


def _wait_published(registry: str, worker_id: str, want: int) -> None:
    with RegistryClient(registry) as reg:
        if reg.wait_for_blocks(worker_id, want, timeout_s=15) < want:
            raise SystemExit(f"the registry never listed {want} blocks of {worker_id}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    p.add_argument("--repeats", type=int, default=3, help="prompts, each measured once per mode (default 3)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--source-tp", type=int, default=2)
    p.add_argument("--target-tp", type=int, default=2)
    p.add_argument("--mla", action="store_true")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)

    server = RegistryServer(MemoryStore(lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0")
    registry = server.start()
    model = ["--mla"] if a.mla else []
    engines: list[EngineProcess] = []
    rows: list[dict[str, Any]] = []
    rng = random.Random(11)
    try:
        t0 = time.perf_counter()
        engines.append(EngineProcess("bench-src", tp=a.source_tp, args=["--source", "--registry", registry, *model]))
        engines.append(EngineProcess("bench-tgt", tp=a.target_tp, args=["--target", "--registry", registry, *model]))
        source, target = (e.client for e in engines)
        print(f"engines up in {time.perf_counter() - t0:.1f} s (source TP={a.source_tp}, target TP={a.target_tp}, "
              f"{'MLA' if a.mla else 'GQA'}); {a.repeats} prompts of {a.tokens} tokens", flush=True)
        warm = [rng.randrange(1024) for _ in range(64)]  # one-off costs: first forwards, first NIXL contact
        source.generate("warm", warm, 2, cache="local")
        _wait_published(registry, "bench-src", len(warm) // TPB)
        target.generate("warm", warm, 2, cache="all")
        published = len(warm) // TPB
        for i in range(a.repeats):
            prompt = [rng.randrange(1024) for _ in range(a.tokens)]
            src = source.generate(f"src-{i}", prompt, a.new_tokens, cache="local", timeout_s=120)
            published += len(chain_block_hashes(prompt, TPB))
            _wait_published(registry, "bench-src", published)
            base = target.generate(f"recompute-{i}", prompt, a.new_tokens, cache="none", timeout_s=120)
            remote = target.generate(f"remote-{i}", prompt, a.new_tokens, cache="all", timeout_s=120)
            local = target.generate(f"local-{i}", prompt, a.new_tokens, cache="local", timeout_s=120)
            same = all(r.tokens == src.tokens and r.logits == src.logits for r in (base, remote, local))
            if not same or remote.blocks_remote != (a.tokens - 1) // TPB:
                raise SystemExit(f"repeat {i}: identical={same}, remote blocks {remote.blocks_remote} "
                                 f"(reason {remote.remote_reason!r})")
            rows.append({"recompute_s": base.ttft_s, "remote_s": remote.ttft_s, "local_s": local.ttft_s,
                         "load_s": remote.load_s, "bytes_read": remote.bytes_remote,
                         "blocks_remote": remote.blocks_remote, "local_blocks": local.blocks_g1 + local.blocks_g2})
            print(f"  prompt {i}: recompute {base.ttft_s * 1e3:.1f} ms, remote {remote.ttft_s * 1e3:.1f} ms "
                  f"(load {remote.load_s * 1e3:.1f} ms), local {local.ttft_s * 1e3:.1f} ms", flush=True)
    finally:
        for e in reversed(engines):
            e.stop()
        server.close()

    med = {k: statistics.median(r[k] for r in rows) for k in ("recompute_s", "remote_s", "local_s", "load_s")}
    nbytes = rows[0]["bytes_read"]
    result = {
        "tokens": a.tokens, "repeats": a.repeats, "source_tp": a.source_tp, "target_tp": a.target_tp,
        "model": "mla" if a.mla else "gqa", "blocks_remote": rows[0]["blocks_remote"], "bytes_read": nbytes,
        "ttft_recompute_s": med["recompute_s"], "ttft_remote_s": med["remote_s"], "ttft_local_s": med["local_s"],
        "load_s": med["load_s"], "read_gbps": nbytes / med["load_s"] / 1e9 if med["load_s"] else 0.0,
        "speedup_remote_vs_recompute": med["recompute_s"] / med["remote_s"],
        "speedup_local_vs_recompute": med["recompute_s"] / med["local_s"],
        "remote_over_local": med["remote_s"] / med["local_s"],
        "outputs_identical": True, "runs": rows,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    print()
    print(f"{'TTFT, ' + str(a.tokens) + '-token prompt':<34}{'median ms':>10}{'vs recompute':>14}")
    print("-" * 58)
    for name, key in (("recompute (caches off)", "recompute_s"), ("remote hit (NIXL from source G2)", "remote_s"),
                      ("local hit (own G1)", "local_s")):
        print(f"{name:<34}{med[key] * 1e3:>10.1f}{med['recompute_s'] / med[key]:>13.1f}×")
    print(f"\nremote load: {result['blocks_remote']} blocks, {nbytes / 1e6:.1f} MB in {med['load_s'] * 1e3:.1f} ms "
          f"({result['read_gbps']:.2f} GB/s); remote hit / local hit = {result['remote_over_local']:.2f}; "
          f"every token and logit identical to recompute: yes")
    if a.json:
        write_result(a.json, "e2e", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
