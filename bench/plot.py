"""Draw a bench's results: ``python -m bench.plot {pool,holder,registry,source,transfer,gather,e2e,peers} RESULTS OUT``.

One PNG per comparison (matplotlib), from the JSON the bench wrote with
``--json``: bars side by side, the goal drawn where there is one. Which bench
writes what: ``pool`` ``bench.memory.bench_pool_index``, ``holder``
``bench.registry.bench_holder_index``, ``registry``
``bench.registry.bench_registry``, ``source`` ``bench.source.bench_source``,
``transfer`` ``bench.transfer.bench_transfer``, ``gather``
``bench.transfer.bench_gather``, ``e2e`` ``bench.transfer.bench_e2e``,
``peers`` ``bench.peers.bench_peers`` (which also draws with ``--plot``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

#: what -> the bench that writes its results
BENCHES = {
    "pool": "bench.memory.bench_pool_index",
    "holder": "bench.registry.bench_holder_index",
    "registry": "bench.registry.bench_registry",
    "source": "bench.source.bench_source",
    "transfer": "bench.transfer.bench_transfer",
    "gather": "bench.transfer.bench_gather",
    "e2e": "bench.transfer.bench_e2e",
    "peers": "bench.peers.bench_peers",
}


def draw(what: str, results: dict[str, Any], path: str) -> None:
    """One PNG per comparison: bars side by side, the goal drawn where there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if what == "peers":
        from bench.peers import bench_peers

        bench_peers.plot(results, path)
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if what == "pool":
        rows = results["rows"]
        labels = [f"{r['impl']}\n{r['threads']} thr" for r in rows]
        ax.bar(labels, [r["ops_per_s"] for r in rows], color=["#3a7" if "py" not in r["impl"] else "#999" for r in rows])
        ax.set_ylabel("find_and_pin + unpin per second")
        ax.set_title(f"pool index, {results['config']['prefix']}-hash prefixes over {results['config']['blocks']:,} blocks")
        ax.tick_params(axis="x", labelsize=7)
    elif what == "holder":
        rows = results["rows"]
        ax.bar(["C++ HolderIndex", "Python dict of sets"], [rows["cpp"]["p50_us"], rows["python"]["p50_us"]],
               color=["#3a7", "#999"])
        ax.set_ylabel("µs (p50)")
        ax.set_title(f"{results['chain']}-hash walk, 2 candidates, {results['pairs']:,} pairs: "
                     f"{results['speedup_p50']:.1f}x")
    elif what == "registry":
        names = ["server\n(Lua)", "server\n(mirror)", "raw Lua", "ping", "no-op\nEVALSHA"]
        keys = ["latency_server", "latency_mirrored_server", "latency_raw_lua", "latency_ping_server",
                "latency_noop_evalsha"]
        ax.bar(names, [results[k]["p50_ms"] for k in keys], color=["#3a7", "#3a7", "#999", "#bbb", "#bbb"])
        ax.axhline(0.5, color="r", ls="--", lw=1, label="goal p50 0.5 ms")
        ax.set_ylabel("ms (p50)")
        ax.set_title(f"registry lookup, {results['blocks']:,} entries; throughput / raw Lua: "
                     f"{results['throughput_ratio']:.2f} (Lua), {results['throughput_ratio_mirrored']:.2f} (mirror)",
                     fontsize=9)
        ax.legend()
    elif what == "source":
        lat = results["latency"]
        names = ["round trip", "resolve", "release"]
        ax.bar(names, [lat["round_trip_p50_ms"], lat["resolve_p50_ms"], lat["release_p50_ms"]], color="#3a7",
               label="p50")
        ax.bar(names, [lat["round_trip_p99_ms"] - lat["round_trip_p50_ms"], lat["resolve_p99_ms"] - lat["resolve_p50_ms"],
                       lat["release_p99_ms"] - lat["release_p50_ms"]],
               bottom=[lat["round_trip_p50_ms"], lat["resolve_p50_ms"], lat["release_p50_ms"]], color="#ad8",
               label="to p99")
        ax.axhline(2.0, color="r", ls="--", lw=1, label="goal p50 2 ms")
        ax.set_ylabel("ms")
        ax.set_title(f"source resolve/release, TP={results['tp']}, {results['hashes']} hashes; "
                     f"{results['throughput']['resolves_per_s']:.0f} resolves/s")
        ax.legend()
    elif what == "transfer":
        import numpy as np

        rows = results["rows"]
        x = np.arange(len(rows))
        series = [("one request: remote-g2", "#3a7", lambda r: r["e2e_gb_per_s"]),
                  ("one request: raw NIXL", "#27a", lambda r: r["raw_gb_per_s"])]
        if all(r.get("stream") for r in rows):
            series += [("sustained: remote-g2", "#8c8", lambda r: r["stream"]["e2e_gb_per_s"]),
                       ("sustained: raw NIXL", "#8ad", lambda r: r["stream"]["raw_gb_per_s"])]
        width = 0.8 / len(series)
        for i, (label, color, get) in enumerate(series):
            xs = x + (i - (len(series) - 1) / 2) * width
            ax.bar(xs, [get(r) for r in rows], width, label=label, color=color)
            if i % 2 == 0:  # the remote-g2 bar of each pair carries the pair's ratio
                ratios = [get(r) / series[i + 1][2](r) for r in rows]
                for xi, r, q in zip(xs, rows, ratios):
                    ax.annotate(f"{q:.2f}", (xi, get(r)), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [f"{r['block_kib']} KiB" for r in rows])
        ax.set_ylabel("GB/s (label: remote-g2 / raw NIXL)")
        ax.set_title(f"fetch of {results['mib']} MiB, TP={results['tp']} → {results['tp']}", fontsize=10)
        top = max(get(r) for _, _, get in series for r in rows)
        ax.set_ylim(0, top * 1.45)  # room for the legend
        ax.legend(loc="upper left", ncol=2, fontsize=8)
    elif what == "gather":
        import numpy as np

        rows = results["rows"]
        x = np.arange(len(rows))
        series = [("remote-g2, gathered", "#3a7", "gathered"), ("remote-g2, in place", "#8c8", "in_place"),
                  ("raw NIXL, sliced descriptors", "#999", "raw_slices"),
                  ("raw NIXL, contiguous (ideal)", "#27a", "raw_contig")]
        width = 0.8 / len(series)
        for i, (label, color, key) in enumerate(series):
            xs = x + (i - (len(series) - 1) / 2) * width
            ax.bar(xs, [r["ms"][key] for r in rows], width, label=label, color=color)
        for xi, r in zip(x, rows):
            ax.annotate(f"{r['of_ideal']:.2f} of ideal\n{r['x_raw_sliced']:.1f}x raw sliced",
                        (xi, max(r["ms"].values())), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [f"{r['config']}\n{r['descriptors_in_place_per_rank']} desc/rank" for r in rows], fontsize=8)
        ax.set_ylabel("ms per request (median)")
        ax.set_title(f"{results['args']['mib']} MiB per request, {results['rows'][0]['model']} and small blocks",
                     fontsize=10)
        ax.set_ylim(0, max(max(r["ms"].values()) for r in rows) * 1.35)
        ax.legend(loc="upper left", fontsize=7)
    elif what == "e2e":
        names = ["recompute", "remote hit", "local hit"]
        vals = [results["ttft_recompute_s"], results["ttft_remote_s"], results["ttft_local_s"]]
        ax.bar(names, [v * 1e3 for v in vals], color=["#999", "#3a7", "#27a"])
        for i, v in enumerate(vals):
            ax.annotate(f"{vals[0] / v:.1f}×", (i, v * 1e3), ha="center", va="bottom")
        ax.set_yscale("log")
        ax.set_ylabel("time to first token, ms (log)")
        ax.set_title(f"{results['tokens']}-token prompt, TP {results['source_tp']} → {results['target_tp']}, "
                     "outputs identical")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=sorted(BENCHES), help="which comparison the results are of")
    p.add_argument("results", help="the JSON the bench wrote with --json")
    p.add_argument("out", help="the PNG to write")
    a = p.parse_args(argv)
    with open(a.results) as f:
        draw(a.what, json.load(f), a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
