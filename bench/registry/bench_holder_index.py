"""Holder index benchmark: a registry lookup's walk, C++ ``HolderIndex`` vs a Python dict of sets.

The registry's memory store (and every registry mirror) answers a prefix
lookup by walking the asked chain against the candidate holders: one probe of
hash → holders per hash. With a million entries each probe misses the cache,
so the layout decides the cost. Both sides hold the same data: ``--pairs``
(hash, holder) pairs as chains of ``--chain`` random 8-byte hashes, each
chain held by 2 of 64 holders. Each sample walks one random chain with its
2 holders as candidates, to the end; the two implementations alternate in
``--rounds`` blocks so both see the same machine noise.

    python -m bench.registry.bench_holder_index [--pairs 1000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from bench.common import pct, write_result
from remote_g2.registry.stores.holder_index import HolderIndex


Chains = list[tuple[list[bytes], list[int]]]


def build(pairs: int, chain_len: int, seed: int) -> tuple[HolderIndex, dict[bytes, set[int]], Chains]:
    rng = random.Random(seed)
    index, model = HolderIndex(), {}
    chains = []
    for _ in range(pairs // (2 * chain_len)):
        hashes = [rng.randbytes(8) for _ in range(chain_len)]
        holders = rng.sample(range(1, 65), 2)
        for holder in holders:
            index.add(holder, hashes)
            for h in hashes:
                model.setdefault(h, set()).add(holder)
        chains.append((hashes, holders))
    return index, model, chains


def python_walk(model: dict[bytes, set[int]], hashes: list[bytes], candidates: list[int]) -> list[int]:
    """The walk the memory store did before the C++ index: one dict probe per hash for every candidate."""
    alive, matched, get = set(candidates), {}, model.get
    i = 1
    while i < len(hashes):
        held = get(hashes[i])
        if held is None:
            break
        if not alive <= held:
            for c in alive - held:
                matched[c] = i
            alive &= held
            if not alive:
                break
        i += 1
    for c in alive:
        matched[c] = i
    return [matched[c] for c in candidates]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=1_000_000, help="(hash, holder) pairs to index")
    ap.add_argument("--chain", type=int, default=128, help="hashes per lookup")
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    index, model, chains = build(args.pairs, args.chain, args.seed)
    print(f"built {index.entries:,} pairs ({len(index):,} hashes) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    rng = random.Random(args.seed + 1)
    walks = {"cpp": lambda h, c: index.walk(h, c), "python": lambda h, c: python_walk(model, h, c)}
    samples: dict[str, list[float]] = {k: [] for k in walks}
    per_round = max(1, args.samples // args.rounds)
    for _ in range(args.rounds):
        for name, walk in walks.items():
            out = samples[name]
            for _ in range(per_round):
                hashes, holders = chains[rng.randrange(len(chains))]
                t = time.perf_counter()
                got = walk(hashes, holders)
                out.append(time.perf_counter() - t)
                if got != [args.chain, args.chain]:
                    raise SystemExit(f"{name} walk matched {got}, expected the whole chain")

    rows = {name: {"p50_us": pct(xs, 50) * 1e6, "p99_us": pct(xs, 99) * 1e6, "mean_us": statistics.fmean(xs) * 1e6}
            for name, xs in samples.items()}
    speedup = rows["python"]["p50_us"] / rows["cpp"]["p50_us"]
    print(f"\nholder index walk: {args.chain}-hash chains, 2 candidates, {index.entries:,} pairs, "
          f"{os.cpu_count()} cores")
    print(f"{'implementation':<26}  {'p50 µs':>8}  {'p99 µs':>8}")
    print(f"{'-' * 26}  {'-' * 8}  {'-' * 8}")
    for name, label in (("cpp", "C++ HolderIndex.walk"), ("python", "Python dict of sets")):
        print(f"{label:<26}  {rows[name]['p50_us']:>8.1f}  {rows[name]['p99_us']:>8.1f}")
    print(f"C++ / Python p50: {speedup:.1f}x faster")
    if args.json:
        write_result(args.json, "holder_index", args=vars(args), pairs=index.entries, chain=args.chain, rows=rows,
                     speedup_p50=speedup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
