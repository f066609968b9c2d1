"""Gathered reads against the in-place path and raw NIXL: heterogeneous TP and small scattered blocks (issue 32).

Everything real, on this machine: a registry (memory store) in this process,
a source worker ``mpiexec -n S bench/transfer/gather_procs/source_rank.py`` (a
HostPool per rank, blocks stored in a random order so nothing coalesces, a
staging region of ``--staging-mib``) and a target worker ``mpiexec -n T
bench/transfer/gather_procs/target_rank.py`` with the real target client (NIXL over
UCX; on one host UCX copies with ``cma``). Per configuration, target rank 0
times, interleaved (the order rotates every round, so noise hits all):

* ``gathered`` — a request end to end (lookup, resolve with a gather wish:
  each source rank packs what each target rank reads into staging; every
  rank READs its staged run; release), the client's default;
* ``in place`` — the same request with the client's ``gather`` off: each
  target rank READs every piece where it lies (today's path, end to end);
* ``raw sliced`` — a bare NIXL READ of exactly the in-place path's
  descriptors (one per head slice of each block, or per scattered block),
  every target rank starting at one instant;
* ``raw contiguous`` — a bare NIXL READ of the same number of bytes from
  each source rank as one descriptor: the ideal, what these bytes cost if
  nothing were scattered;
* ``gathered, no bounce`` — where the target's ranks READ some part into
  their bounce region and scatter it (``target/bounce.py``: small pieces
  scattered in the destination, TP 4 -> 1 of the default model), the
  gathered and the in-place request again with every rank's bounce region off.

Then the fixed cost: 1-block requests end to end against a raw
one-descriptor READ of one block's share plus one RPC round trip to the
source (``ping``), and against the same request with peer resolve off (the
leader resolves every share through source rank 0), interleaved. Bytes are checked on every target rank after the first
requests, the raw sliced READ and the last request (a wrong byte aborts).

``--cpus split`` binds every source rank to CPU 0 and every target rank to
CPU 1 (``mpiexec -bind-to user:...``), as two hosts would each have their
own: a gather then costs the source's CPU, not the READ's. ``shared``
(default) lets both sides run anywhere on this box's cores, so the
source's copy competes with the target's READ copy for the same CPUs — a
cost no two-host deployment pays.

Configurations (``--configs``): ``S:T`` pairs of the model (``--model``,
default a Qwen2.5-7B-shaped GQA cache: 28 layers, 4 kv heads of 128, bf16,
16-token blocks) moving ``--mib`` MiB per request over all ranks, and
``small:KIB`` — TP 2 -> 2 with ``KIB``-KiB blocks per rank (one layer, one
head per rank), the small-block case.

    python -m bench.transfer.bench_gather [--configs 1:2,2:1,2:4,4:1,small:4] [--mib 64] [--reps 10]
                                          [--one-block-reps 30] [--json out.json]

Goals (issue 32), printed beside the numbers: heterogeneous TP gathered >=
0.6 of the contiguous ideal and >= 3x the raw sliced READ; small blocks
gathered >= 3x the raw sliced READ; a 1-block request <= 2x (raw
one-descriptor READ + one RPC round trip).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.transfer.bench_transfer import MPIEXEC, BenchError, Proc
from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer

PROCS = "bench.transfer.gather_procs"
MODELS = {
    "qwen2.5-7b": {"name": "qwen2.5-7b", "layers": 28, "kv_heads": 4, "head_dim": 128, "tokens": 16, "dtype_bytes": 2},
    "llama-3-8b": {"name": "llama-3-8b", "layers": 32, "kv_heads": 8, "head_dim": 128, "tokens": 16, "dtype_bytes": 2},
}


def small_spec(kib: int) -> dict[str, Any]:
    """One layer, one kv head per rank at TP 2, 16 tokens: ``kib`` KiB per rank per block."""
    head_dim = kib * 1024 // (2 * 16 * 2)
    return {"name": f"small-{kib}k", "layers": 1, "kv_heads": 2, "head_dim": head_dim, "tokens": 16, "dtype_bytes": 2}


def tp1_block_bytes(spec: dict[str, Any]) -> int:
    return spec["layers"] * 2 * spec["kv_heads"] * spec["tokens"] * spec["head_dim"] * spec["dtype_bytes"]


def run_config(name: str, spec: dict[str, Any], source_tp: int, target_tp: int, tag: int,
               args: argparse.Namespace, registry: str, tmp: Path) -> dict[str, Any]:
    blocks = max(1, (args.mib << 20) // tp1_block_bytes(spec))
    src_dir, tgt_dir = tmp / f"src-{tag}", tmp / f"tgt-{tag}"
    src_dir.mkdir()
    tgt_dir.mkdir()
    ipc = tempfile.mkdtemp(prefix="rg2g-")
    worker = f"bench-gather-src-{tag}-{os.getpid()}"
    py = sys.executable
    spec_json = json.dumps(spec)
    def bind(n: int, cpu: int) -> list[str]:
        return ["-bind-to", "user:" + ",".join([str(cpu)] * n)] if args.cpus == "split" else []

    src = Proc([str(MPIEXEC), *bind(source_tp, 0), "-n", str(source_tp), py, "-m", f"{PROCS}.source_rank",
                "--dir", str(src_dir),
                "--worker-id", worker, "--spec", spec_json, "--tag", str(tag), "--blocks", str(blocks),
                "--registry", registry, "--ipc-dir", ipc, "--staging-mib", str(args.staging_mib)],
               src_dir / "mpiexec.log")
    tgt: Proc | None = None
    try:
        deadline = time.monotonic() + 120
        while not all((src_dir / f"info-{r}.json").exists() for r in range(source_tp)) or \
                not (src_dir / "endpoint.json").exists():
            if not src.alive() or time.monotonic() > deadline:
                raise BenchError(f"{name}: the source worker did not start:\n{src.tail()}")
            time.sleep(0.1)
        with RegistryClient(registry) as reg:
            while (rec := reg.worker_info(worker)) is None or rec.blocks != blocks:
                if time.monotonic() > deadline:
                    raise BenchError(f"{name}: the registry never showed the source's {blocks} blocks ({rec})")
                time.sleep(0.05)
        tgt = Proc([str(MPIEXEC), *bind(target_tp, 1), "-n", str(target_tp), py, "-m", f"{PROCS}.target_rank",
                    "--dir", str(tgt_dir),
                    "--registry", registry, "--worker-id", f"bench-gather-tgt-{tag}-{os.getpid()}",
                    "--spec", spec_json, "--tag", str(tag), "--blocks", str(blocks), "--source-tp", str(source_tp),
                    "--source-dir", str(src_dir), "--ipc-dir", ipc, "--reps", str(args.reps),
                    "--one-block-reps", str(args.one_block_reps),
                    *(["--registry-mirror"] if args.registry_mirror else [])],
                   tgt_dir / "mpiexec.log")
        rc = tgt.wait(args.timeout_s)
        if rc is None:
            raise BenchError(f"{name}: the target worker did not finish in {args.timeout_s} s:\n{tgt.tail()}")
        if not (tgt_dir / "result.json").exists():
            raise BenchError(f"{name}: the target wrote no result (rc={rc}):\n{tgt.tail()}")
        result = json.loads((tgt_dir / "result.json").read_text())
        if "error" in result:
            raise BenchError(f"{name}: {result['error']}\n{result.get('traceback', '')}\n{tgt.tail()}")
        states = [json.loads((src_dir / f"state-{r}.json").read_text()) for r in range(source_tp)]
        result["source_gathers"] = [s["service"]["gathers"] for s in states]
        # mean ms of the source's resolves (rank 0 and peer shares) and of packing one staged part, per rank
        result["source_resolve_ms"] = [1000 * s["resolve_s"][1] / max(1, s["resolve_s"][0]) for s in states]
        result["source_pack_ms"] = [1000 * s["gather_s"][1] / max(1, s["gather_s"][0]) for s in states]
    finally:
        if tgt is not None:
            tgt.kill()
        (src_dir / "stop").touch()
        if src.wait(20) is None:
            print(f"warning: the {name} source did not stop in 20 s; killed", file=sys.stderr)
        src.kill()
        shutil.rmtree(ipc, ignore_errors=True)
    med = result["median"]
    mib = result["bytes_per_rank"] * target_tp / 2**20
    row = {
        "config": name, "source_tp": source_tp, "target_tp": target_tp, "model": spec["name"], "blocks": blocks,
        "mib": mib, "descriptors_in_place_per_rank": result["descriptors_in_place"],
        "ms": {k: v * 1000 for k, v in med.items()},
        "of_ideal": med["raw_contig"] / med["gathered"],
        "x_raw_sliced": med["raw_slices"] / med["gathered"],
        "x_in_place": med["in_place"] / med["gathered"],
        "x_no_bounce": med["gathered_no_bounce"] / med["gathered"] if "gathered_no_bounce" in med else None,
        "x_in_place_no_bounce": med["in_place_no_bounce"] / med["in_place"] if "in_place_no_bounce" in med else None,
        "one_block_over_floor": med["load"] / (med["raw_one"] + med["rpc"]),
        "one_block_classic_over_floor": med["load_classic"] / (med["raw_one"] + med["rpc"]),
        "strategy": "peer" if result["client_stats"]["peer_loads"] else "classic",
        "phase_medians_ms": result["phase_medians_ms"],
        "source_gathers": result["source_gathers"],
        "raw": result,
    }
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print(f"{'config':<14}{'MiB':>6}{'desc/rank':>10}{'gathered':>10}{'in place':>10}{'raw slic':>10}"
          f"{'raw cont':>10}{'of ideal':>10}{'x raw sl':>10}{'x in pl':>9}")
    for r in rows:
        ms = r["ms"]
        print(f"{r['config']:<14}{r['mib']:>6.1f}{r['descriptors_in_place_per_rank']:>10}{ms['gathered']:>10.2f}"
              f"{ms['in_place']:>10.2f}{ms['raw_slices']:>10.2f}{ms['raw_contig']:>10.2f}{r['of_ideal']:>10.2f}"
              f"{r['x_raw_sliced']:>10.2f}{r['x_in_place']:>9.2f}")
    print("(ms: medians; of ideal = raw contiguous / gathered; x raw sl = raw sliced / gathered; "
          "goals: hetero TP >= 0.6 of ideal and >= 3x raw sliced; small blocks >= 3x raw sliced)")
    bounced = [r for r in rows if r["x_no_bounce"] is not None]
    if bounced:
        print()
        print(f"{'config':<14}{'gathered':>10}{'no bounce':>11}{'x':>7}{'in place':>10}{'no bounce':>11}{'x':>7}"
              "   (the target's bounce region on / off)")
        for r in bounced:
            ms = r["ms"]
            print(f"{r['config']:<14}{ms['gathered']:>10.2f}{ms['gathered_no_bounce']:>11.2f}{r['x_no_bounce']:>7.2f}"
                  f"{ms['in_place']:>10.2f}{ms['in_place_no_bounce']:>11.2f}{r['x_in_place_no_bounce']:>7.2f}")
    print()
    print(f"{'config':<14}{'request':<24}{'lookup':>8}{'to_resolve':>11}{'resolve':>9}{'reads':>8}{'load':>8}"
          "   (medians, ms; load: start_load to the outcome, the coordinator's clock)")
    for r in rows:
        for kind, ph in sorted(r["phase_medians_ms"].items()):
            print(f"{r['config']:<14}{kind:<24}{ph['lookup']:>8.2f}{ph['to_resolve']:>11.2f}{ph['resolve']:>9.2f}"
                  f"{ph['reads']:>8.2f}{ph['load']:>8.2f}")
    print()
    print(f"{'config':<14}{'strategy':>9}{'1-block ms':>11}{'classic':>9}{'raw 1-desc':>11}{'RPC RTT':>9}"
          f"{'ratio':>7}{'classic':>9}   (goal: ratio <= 2)")
    for r in rows:
        ms = r["ms"]
        print(f"{r['config']:<14}{r['strategy']:>9}{ms['load']:>11.3f}{ms['load_classic']:>9.3f}{ms['raw_one']:>11.3f}"
              f"{ms['rpc']:>9.3f}{r['one_block_over_floor']:>7.2f}{r['one_block_classic_over_floor']:>9.2f}")
    print("(1-block: a request with the client's default strategy; classic: the same with peer resolve off, "
          "interleaved; ratio = 1-block / (raw 1-desc + RPC RTT))")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="1:2,2:1,2:4,4:1,small:4",
                   help="S:T pairs of --model, and small:KIB (TP 2 -> 2, KIB-KiB blocks), comma-separated")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-7b")
    p.add_argument("--mib", type=int, default=64, help="bytes per request over all target ranks, MiB (at most 256)")
    p.add_argument("--reps", type=int, default=10, help="timed rounds per configuration (at most 100)")
    p.add_argument("--one-block-reps", type=int, default=30,
                   help="timed rounds of the 1-block requests per configuration (at most 500; each takes ms)")
    p.add_argument("--staging-mib", type=int, default=256, help="each source rank's staging region")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per configuration, for the target worker")
    p.add_argument("--cpus", choices=("shared", "split"), default="shared",
                   help="split: sources on CPU 0, targets on CPU 1 (as two hosts); shared: anywhere")
    p.add_argument("--registry-mirror", action="store_true",
                   help="the target looks up in an in-process registry mirror (no registry round trip)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    if not 1 <= args.mib <= 256 or not 1 <= args.reps <= 100 or not 1 <= args.one_block_reps <= 500:
        p.error("--mib must be 1..256, --reps 1..100 and --one-block-reps 1..500")
    configs = []
    for i, item in enumerate(filter(None, args.configs.split(","))):
        a, b = item.split(":")
        if a == "small":
            configs.append((f"small {b} KiB", small_spec(int(b)), 2, 2, i + 1))
        else:
            configs.append((f"TP {a} -> {b}", MODELS[args.model], int(a), int(b), i + 1))
    server = RegistryServer(MemoryStore(lease_ttl_ms=30_000), bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0")
    registry = server.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="rg2-gather-") as tmp:
            for name, spec, s, t, tag in configs:
                print(f"{name}: ...", flush=True)
                rows.append(run_config(name, spec, s, t, tag, args, registry, Path(tmp)))
                print_table(rows[-1:])
    except BenchError as e:
        print(f"bench_gather: {e}", file=sys.stderr)
        return 1
    finally:
        server.close()
    print("\nAll configurations:")
    print_table(rows)
    if args.json:
        write_result(args.json, "gather", args=vars(args), rows=rows, loadavg=os.getloadavg(),
                     median_of_ideal=statistics.median(r["of_ideal"] for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
