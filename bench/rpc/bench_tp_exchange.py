"""One step's agreement among a vLLM instance's TP ranks: over local links vs over vLLM's gloo group.

Why the vLLM connector's ranks exchange over ``adapters/vllm/tp_links.py``
rather than over the gloo group they already share. ``--ranks`` processes
join a real ``torch.distributed`` gloo group (as vLLM's CPU TP group is) and
set up local links over it; then, alternating the two transports in every
round, each times what a step with a load costs the engine's thread:

* ``held``: :meth:`TpSync.held_everywhere` over ``--blocks`` blocks (every
  rank's bits, their AND back to all);
* ``outcome``: :meth:`TpSync.leader_outcome` (rank 0's fetch outcome to all).

Each rank is bound to one CPU (``--bind``, rank r on CPU r mod the CPUs
this process may use), as vLLM's CPU workers are. Rank 0's timings are
reported; the p50 ratio gloo / links is the figure.

    python -m bench.rpc.bench_tp_exchange [--ranks 2] [--rounds 400] [--blocks 64] [--json F]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

from bench.common import pct, write_result

KINDS = ("held", "outcome")


def _rank(rank: int, size: int, port: int, a: argparse.Namespace, ipc_dir: str, q: Any) -> None:
    import torch.distributed as dist

    from remote_g2.adapters.vllm.tp_links import connect_step_links
    from remote_g2.adapters.vllm.tp_sync import FetchOutcome, TpSync
    from remote_g2.tp.torch_group import TorchGroupComm

    cpus = sorted(os.sched_getaffinity(0))
    if a.bind:
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    comm = TorchGroupComm()
    links = connect_step_links(comm, "bench-exchange", ipc_dir)
    syncs = {"links": TpSync(comm, links), "gloo": TpSync(comm)}
    held = [i % 7 != 3 for i in range(a.blocks)]
    outcome = FetchOutcome({"req-1"}, set(), set()) if rank == 0 else None
    ms: dict[str, dict[str, list[float]]] = {t: {k: [] for k in KINDS} for t in syncs}
    for i in range(a.warmup + a.rounds):
        for name in (("links", "gloo") if i % 2 == 0 else ("gloo", "links")):
            sync = syncs[name]
            t0 = time.perf_counter()
            sync.held_everywhere(held)
            t1 = time.perf_counter()
            sync.leader_outcome(outcome)
            t2 = time.perf_counter()
            if i >= a.warmup:
                ms[name]["held"].append((t1 - t0) * 1e3)
                ms[name]["outcome"].append((t2 - t1) * 1e3)
    if rank == 0:
        q.put({"linked": links is not None, "ms": ms})
    syncs["links"].close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--blocks", type=int, default=64, help="blocks a step's loads ask about (default 64)")
    p.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                   help="bind each rank to one CPU, as vLLM's CPU workers are (default on)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rg2-xchg-") as tmp:
        ipc_dir = os.path.join(tmp, "ipc")
        procs = [ctx.Process(target=_rank, args=(r, a.ranks, port, a, ipc_dir, q)) for r in range(a.ranks)]
        for proc in procs:
            proc.start()
        try:
            res = q.get(timeout=600)
        finally:
            for proc in procs:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
    if not res["linked"]:
        print("the ranks could not set up local links", file=sys.stderr)
        return 1
    ms = res["ms"]
    print(f"{a.ranks} ranks, {a.blocks} blocks, {a.rounds} rounds alternating, rank 0's ms "
          f"({os.cpu_count()} CPUs, {'bound' if a.bind else 'unbound'}; {platform.python_version()})")
    print(f"{'exchange':10s} {'transport':10s} {'p50':>8s} {'p99':>8s} {'mean':>8s}")
    rows = []
    for kind in KINDS:
        for name in ("links", "gloo"):
            xs = ms[name][kind]
            row = {"exchange": kind, "transport": name, "p50_ms": pct(xs, 50), "p99_ms": pct(xs, 99),
                   "mean_ms": statistics.fmean(xs)}
            rows.append(row)
            print(f"{kind:10s} {name:10s} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {row['mean_ms']:8.3f}")
        ratio = pct(ms["gloo"][kind], 50) / pct(ms["links"][kind], 50)
        print(f"{'':10s} gloo / links at p50: {ratio:.1f}x")
    if a.json:
        write_result(a.json, "tp_exchange", args=vars(a), ranks=a.ranks, blocks=a.blocks, rounds=a.rounds,
                     bind=a.bind, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
