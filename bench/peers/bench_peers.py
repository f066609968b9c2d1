"""remote-g2 against the systems a user would pick instead, side by side in one run.

``python -m bench.peers.bench_peers {registry,transfer,all} [--json out.json] [--plot out.png]``

registry
    1 M (hash, worker) entries over 8 workers (``bench_registry.py``'s data
    set: chains of 128 hashes, two holders each), 128-hash prefix lookups:
    remote-g2's server on its embedded store, a real Redis and a real
    3-master Redis Cluster, the raw
    Redis Lua prefix walk (no server), remote-g2's **registry mirror** (an
    in-process copy following the Redis-backed server's change feed — what a
    router embeds), and **Dynamo's RadixTree** (``ai-dynamo-runtime``,
    in-process ``find_matches`` over the same chains, what Dynamo's router
    embeds). Interleaved rounds, p50/p99 and single-client lookups/s. Goal:
    remote-g2's lookup p50 within 3× of Dynamo's in-process tree, while being
    shared by a whole fleet (the mirror answers from the fleet-wide registry).

transfer
    The same bytes (``--mib``, default 64 MiB) in blocks of 4 KiB, 64 KiB and
    1 MiB: remote-g2's end-to-end fetch (lookup + resolve + per-rank NIXL READ
    + release, TP=2 → 2; the target looks up in its registry mirror unless
    ``--no-registry-mirror``), a raw NIXL READ of the same descriptors and a memcpy
    (both from ``bench_transfer.py``, same run), and **Mooncake Store**'s TCP
    ``batch_get_into`` (``peers/mooncake_store.py``: a real ``mooncake_master``
    on loopback). Goals: remote-g2 ≥ 5× Mooncake's TCP batch get and ≥ 70 % of
    raw NIXL. Both are one request at a time (median of ``--reps`` 20, every
    rank bound to a core unless ``--bind none``); the rows also carry
    ``bench_transfer.py``'s sustained rate (several requests in flight) and
    its ratios to raw NIXL (posted likewise) and to Mooncake.

The peers are installed by ``make bench-peers``, never by the test suite.
Ratios are what to read: this is a noisy 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import REPO, module_cmd
from bench.registry import bench_registry as br
from tests.conftest import start_redis_cluster  # (the test suite's cluster builder)


def _dynamo_tree(chains: int, workers: int) -> Any:
    """Dynamo's RadixTree holding the same chains, same holders, as the registry."""
    from dynamo.llm import RadixTree

    tree = RadixTree()
    event_id = 0
    for c in range(chains):
        ids = [int.from_bytes(h, "big") for h in br.chain(c)]
        blocks = [{"block_hash": v, "tokens_hash": v} for v in ids]
        for k in range(br.HOLDERS_PER_CHAIN):
            event_id += 1
            tree.apply_event((c + k) % workers, json.dumps(
                {"event_id": event_id, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}).encode())
    return tree


def registry(args: argparse.Namespace) -> dict[str, Any]:
    from remote_g2.registry import RegistryClient, RegistryMirror

    procs: list[subprocess.Popen[Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            redis_proc, redis_url = common.start_redis(tmp)
            procs.append(redis_proc)
            reg_redis, ep_redis = br.start_registry("--redis-url", redis_url)
            procs.append(reg_redis)
            reg_mem, ep_mem = br.start_registry()
            procs.append(reg_mem)
            cluster_procs, cluster_url = start_redis_cluster(Path(tmp) / "cluster")
            procs.extend(cluster_procs)
            reg_cluster, ep_cluster = br.start_registry("--redis-cluster-url", cluster_url)
            procs.append(reg_cluster)
            print(f"ingesting {args.blocks:,} entries into each registry...", file=sys.stderr)
            ing_redis = br.ingest(ep_redis, args.blocks, args.workers, 4096)
            ing_mem = br.ingest(ep_mem, args.blocks, args.workers, 4096)
            ing_cluster = br.ingest(ep_cluster, args.blocks, args.workers, 4096)
            chains = ing_redis["chains"]
            t0 = time.perf_counter()
            tree = _dynamo_tree(chains, args.workers)
            dyn_build = time.perf_counter() - t0

            def full(reply: Any) -> None:
                assert reply.reason == "ok" and reply.matched == br.CHAIN_LEN, reply

            def raw_ok(reply: Any) -> None:
                assert reply[0] == b"ok" and int(reply[1]) == br.CHAIN_LEN, reply[:2]

            def dyn_lookup(hashes: list[bytes]) -> Any:
                return tree.find_matches([int.from_bytes(h, "big") for h in hashes])

            def dyn_ok(reply: Any) -> None:
                assert max(reply.scores.values()) == br.CHAIN_LEN, reply.scores

            raw = br.RawLookup(redis_url)
            print("registry mirror: snapshot of the Redis-backed registry...", file=sys.stderr)
            t0 = time.perf_counter()
            mirror = RegistryMirror(ep_redis, timeout_s=30).start()
            if not mirror.wait_ready(300):
                raise RuntimeError(f"the registry mirror did not get ready: {mirror.last_error}")
            mirror_ready_s = time.perf_counter() - t0
            with RegistryClient(ep_redis, timeout_s=10) as c_redis, RegistryClient(ep_mem, timeout_s=10) as c_mem, \
                    RegistryClient(ep_cluster, timeout_s=10) as c_cluster, mirror:
                lat = br.latency({
                                  # the copy follows the Redis-backed server
                                  "remote-g2 mirror, in-process": (mirror.lookup, full),
                                  "remote-g2 server, embedded store": (c_mem.lookup, full),
                                  "remote-g2 server, Redis": (c_redis.lookup, full),
                                  "remote-g2 server, Redis Cluster (3 masters)": (c_cluster.lookup, full),
                                  "raw Redis Lua prefix walk": (raw, raw_ok),
                                  "Dynamo RadixTree, in-process": (dyn_lookup, dyn_ok)},
                                 chains, args.lookups, args.rounds)
        finally:
            for p in reversed(procs):
                common.stop(p)
    dyn = lat["Dynamo RadixTree, in-process"]["p50_ms"]
    rows = [{"system": name, "p50_ms": v["p50_ms"], "p99_ms": v["p99_ms"], "lookups_per_s": 1e3 / v["mean_ms"],
             "p50_vs_dynamo": v["p50_ms"] / dyn} for name, v in lat.items()]
    best = min(v["p50_ms"] for k, v in lat.items() if k.startswith("remote-g2"))
    return {"bench": "peers.registry", "blocks": args.blocks, "workers": args.workers, "prefix": br.CHAIN_LEN,
            "rows": rows, "ingest_events_per_s": {"redis": ing_redis["events_per_s"],
                                                   "embedded": ing_mem["events_per_s"],
                                                   "redis_cluster": ing_cluster["events_per_s"]},
            "dynamo_build_s": dyn_build, "mirror_ready_s": mirror_ready_s,
            "goal_p50_within_3x_of_dynamo": best <= 3 * dyn,
            "best_remote_g2_p50_vs_dynamo": best / dyn}


def transfer(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.blocks_kib.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "transfer.json"
        print(f"remote-g2 / raw NIXL / memcpy at {sizes} KiB (bench_transfer.py)...", file=sys.stderr)
        subprocess.run(module_cmd("bench.transfer.bench_transfer", "--blocks-kib", args.blocks_kib,
                                  "--mib", str(args.mib), "--reps", str(args.reps), "--json", str(out),
                                  "--bind", args.bind, *([] if args.no_registry_mirror else ["--registry-mirror"])),
                       check=True, stdout=sys.stderr, cwd=REPO)
        ours = json.loads(out.read_text())
        mooncake = []
        for kib in sizes:
            print(f"Mooncake Store TCP batch get, {kib} KiB blocks...", file=sys.stderr)
            mc_out = Path(tmp) / f"mc-{kib}.json"
            subprocess.run(module_cmd("bench.peers.mooncake_store", "--block-kib", str(kib), "--mib", str(args.mib),
                                      "--reps", str(args.reps), "--json", str(mc_out)),
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
            mooncake.append(json.loads(mc_out.read_text()))
    rows = []
    by_kib = {int(r["block_kib"]): r for r in ours["rows"]}
    for kib, mc in zip(sizes, mooncake):
        r = by_kib[kib]
        sustained = r.get("stream") or {}
        rows.append({"block_kib": kib, "remote_g2_gbps": r["e2e_gb_per_s"], "raw_nixl_gbps": r["raw_gb_per_s"],
                     "memcpy_gbps": r["memcpy_gb_per_s"], "mooncake_tcp_gbps": mc["gbps"],
                     "remote_g2_vs_mooncake": r["e2e_gb_per_s"] / mc["gbps"],
                     "remote_g2_vs_raw_nixl": r["ratio_e2e_over_raw"],
                     # several requests in flight (bench_transfer's sustained rounds), against raw NIXL likewise
                     "sustained_gbps": sustained.get("e2e_gb_per_s"),
                     "sustained_vs_raw_nixl": sustained.get("ratio_e2e_over_raw"),
                     "sustained_vs_mooncake": (sustained["e2e_gb_per_s"] / mc["gbps"]
                                               if sustained.get("e2e_gb_per_s") else None)})
    return {"bench": "peers.transfer", "mib": args.mib, "registry_mirror": not args.no_registry_mirror,
            "bind": args.bind,
            "rows": rows, "remote_g2_raw": ours}


def _print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    cells = [[k for k in keys]] + [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    for n, c in enumerate(cells):
        print("  ".join(x.rjust(w) if n else x.ljust(w) for x, w in zip(c, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("registry", "transfer") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = results[key]["rows"]
        if key == "registry":
            names = [textwrap.fill(r["system"].replace("remote-g2 server, ", "remote-g2, "), 12) for r in rows]
            ax.bar(names, [r["p50_ms"] for r in rows],
                   color=["#3a7" if r["system"].startswith("remote-g2") else "#999" if "raw" in r["system"]
                          else "#c63" for r in rows])
            ax.errorbar(names, [r["p50_ms"] for r in rows],
                        yerr=[[0] * len(rows), [r["p99_ms"] - r["p50_ms"] for r in rows]], fmt="none", ecolor="k")
            for i, r in enumerate(rows):  # the ratio the goal is stated in, on each bar
                ax.annotate(f"{r['p50_vs_dynamo']:.1f}×", (i, r["p50_ms"]), textcoords="offset points",
                            xytext=(14, 2), fontsize=8)
            ax.set_ylabel("lookup latency, ms (bar p50, whisker p99)")
            ax.set_title(f"128-hash prefix lookup over {results[key]['blocks']:,} entries\n"
                         "(label: p50 as a multiple of Dynamo's)", fontsize=10)
            ax.tick_params(axis="x", labelsize=7)
        else:
            import numpy as np

            x = np.arange(len(rows))
            series = [("remote_g2_gbps", "remote-g2 end to end", "#3a7"), ("raw_nixl_gbps", "raw NIXL READ", "#27a"),
                      ("memcpy_gbps", "memcpy", "#999"), ("mooncake_tcp_gbps", "Mooncake Store TCP", "#c63")]
            for i, (k, label, color) in enumerate(series):
                ax.bar(x + (i - 1.5) * 0.2, [r[k] or 0 for r in rows], 0.2, label=label, color=color)
            for i, r in enumerate(rows):  # the two ratios the goals are stated in, over the remote-g2 bar
                ax.annotate(f"{r['remote_g2_vs_mooncake']:.1f}× MC\n{r['remote_g2_vs_raw_nixl']:.2f} raw",
                            (i - 0.3, r["remote_g2_gbps"]), textcoords="offset points", xytext=(0, 3),
                            ha="center", fontsize=7)
            top = max(max(r[k] or 0 for k, _, _ in series) for r in rows)
            ax.set_ylim(0, top * 1.35)
            ax.set_xticks(x, [f"{r['block_kib']} KiB" for r in rows])
            ax.set_ylabel("GB/s")
            ax.set_title(f"fetch {results[key]['mib']} MiB, TP=2 → 2\n"
                         "(label: remote-g2 × Mooncake, and as a fraction of raw NIXL)", fontsize=10)
            ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("registry", "transfer", "all"))
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--blocks-kib", default="4,64,1024")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--bind", choices=("none", "core"), default="core",
                   help="transfer: bind every source and target rank to a core (bench_transfer.py --bind), as "
                        "an MPI launch with --bind-to core does (the default); none: the kernel places them, and "
                        "on 2 vCPUs a rank woken behind the other rank's copy starts its READ late")
    p.add_argument("--no-registry-mirror", action="store_true",
                   help="transfer: the target asks the registry server instead of its in-process mirror")
    p.add_argument("--json")
    p.add_argument("--plot")
    a = p.parse_args(argv)
    results: dict[str, Any] = {"machine": {"platform": platform.platform()}}
    if a.what in ("registry", "all"):
        results["registry"] = registry(a)
        _print_rows(f"registry lookups ({a.blocks:,} entries, {a.workers} workers, 128-hash prefixes)",
                    results["registry"]["rows"])
        print(f"goal: remote-g2 p50 within 3x of Dynamo's in-process tree: "
              f"{results['registry']['best_remote_g2_p50_vs_dynamo']:.2f}x -> "
              f"{'met' if results['registry']['goal_p50_within_3x_of_dynamo'] else 'NOT met'}")
    if a.what in ("transfer", "all"):
        results["transfer"] = transfer(a)
        _print_rows(f"fetch of {a.mib} MiB (GB/s)", results["transfer"]["rows"])
        for r in results["transfer"]["rows"]:  # the goals are stated one request at a time
            mc, raw = r["remote_g2_vs_mooncake"], r["remote_g2_vs_raw_nixl"]
            print(f"goal at {r['block_kib']} KiB: >= 5x Mooncake {mc:.1f}x -> {'met' if mc >= 5 else 'NOT met'}; "
                  f">= 0.70 of raw NIXL {raw:.2f} -> {'met' if raw >= 0.70 else 'NOT met'}")
    if a.json:
        common.write_result(a.json, "peers", args=vars(a), **results)
    if a.plot:
        plot(results, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
