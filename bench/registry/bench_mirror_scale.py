"""A registry mirror sized for a fleet: memory per hash and lookup latency at 10 M hashes, vs Dynamo's RadixTree.

A registry mirror is the in-process copy of the registry a target (or a
router) keeps; at fleet scale it holds tens of millions of hashes. This bench
fills the mirror's own store class (``registry.mirror.MirrorIndex``, through
``install``/``extend``, the calls its snapshot makes) with ``--hashes``
distinct 32-byte block hashes (the vLLM sha256 form) in chains of
``--chain``, each chain held by ``--holders`` of ``--workers`` workers, and
measures:

* **memory**: the process's resident set before and after the fill
  (nothing but the copy stays alive), per hash and per (hash, holder) entry,
  next to the index's own ``nbytes``;
* **lookup**: a whole-chain prefix lookup, ``MirrorIndex.lookup_many`` as
  ``RegistryMirror.lookup`` calls it, against **Dynamo's RadixTree**
  (``ai-dynamo-runtime``: ``find_matches`` over the same chains and holders,
  its block hashes the first 8 bytes of ours, its native u64 form), built in
  the same process after the mirror was measured. Interleaved rounds, so
  both see the same machine; p50/p99 and the ratio mirror / Dynamo.

    python -m bench.registry.bench_mirror_scale [--hashes 10000000] [--json bench/results/mirror-scale.json]

``--no-dynamo`` measures the mirror alone (Dynamo's tree at 10 M hashes takes
several GB and a few minutes to build). Ratios are what to read: this is a
noisy 2-core VM.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from typing import Any

from bench.common import percentiles, write_result
from bench.registry.bench_registry import FP  # (the registry benches' layout)
from remote_g2.protocol.messages import Lookup, WorkerRecord
from remote_g2.registry.client.mirror import MirrorIndex

HASH_LEN = 32


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def chain(c: int, n: int) -> list[bytes]:
    """Chain ``c``'s hashes, regenerated on demand (so the bench keeps none of them alive)."""
    raw = random.Random(c).randbytes(HASH_LEN * n)
    return [raw[i:i + HASH_LEN] for i in range(0, len(raw), HASH_LEN)]


def holders_of(c: int, holders: int, workers: int) -> list[int]:
    return [(c + k * 7) % workers for k in range(holders)]


def record(w: int) -> WorkerRecord:
    return WorkerRecord(worker_id=f"w{w}", endpoint=f"tcp://127.0.0.1:{20000 + w}", epoch=1, tp_size=1,
                        fingerprint=FP, live=True, lease_expires_in_ms=10**9, blocks=0, last_seq=0, load=0,
                        registered_at_ms=1)


def fill_mirror(args: argparse.Namespace, chains: int) -> MirrorIndex:
    index = MirrorIndex(lease_ttl_ms=10**9, compat_key=FP.compat_key())
    for w in range(args.workers):
        index.install(record(w), [])
    progress = time.monotonic()
    for c in range(chains):
        hashes = chain(c, args.chain)
        for w in holders_of(c, args.holders, args.workers):
            index.extend(record(w), hashes)
        if time.monotonic() - progress > 5:
            progress = time.monotonic()
            print(f"  mirror: {c * args.chain:,} / {chains * args.chain:,} hashes", file=sys.stderr)
    return index


def fill_dynamo(args: argparse.Namespace, chains: int) -> Any:
    from dynamo.llm import RadixTree

    tree = RadixTree()
    event_id = 0
    progress = time.monotonic()
    for c in range(chains):
        ids = [int.from_bytes(h[:8], "big") for h in chain(c, args.chain)]
        payload = {"stored": {"parent_hash": None, "blocks": [{"block_hash": v, "tokens_hash": v} for v in ids]}}
        for w in holders_of(c, args.holders, args.workers):
            event_id += 1
            tree.apply_event(w, json.dumps({"event_id": event_id, "data": payload}).encode())
        if time.monotonic() - progress > 5:
            progress = time.monotonic()
            print(f"  dynamo: {c * args.chain:,} / {chains * args.chain:,} hashes", file=sys.stderr)
    return tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hashes", type=int, default=10_000_000, help="distinct block hashes in the copy")
    ap.add_argument("--chain", type=int, default=128, help="hashes per chain (and per lookup)")
    ap.add_argument("--holders", type=int, default=2, help="workers holding each chain")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--lookups", type=int, default=2000, help="lookups per system per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-dynamo", action="store_true", help="measure the mirror alone")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    chains = args.hashes // args.chain

    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    index = fill_mirror(args, chains)
    fill_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_bytes()
    hashes = len(index._holders)
    entries = index._holders.entries
    memory = {"hashes": hashes, "entries": entries, "fill_s": fill_s,
              "rss_bytes": rss1 - rss0, "rss_bytes_per_hash": (rss1 - rss0) / hashes,
              "rss_bytes_per_entry": (rss1 - rss0) / entries,
              "index_nbytes_per_hash": index._holders.nbytes / hashes}
    print(f"mirror: {hashes:,} hashes, {entries:,} entries in {fill_s:.1f} s; resident "
          f"{memory['rss_bytes_per_hash']:.1f} B/hash ({memory['rss_bytes_per_entry']:.1f} B/entry), "
          f"index {memory['index_nbytes_per_hash']:.1f} B/hash; goal <= 64 B/hash: "
          f"{'met' if memory['rss_bytes_per_hash'] <= 64 else 'NOT met'}", file=sys.stderr)

    compat = FP.compat_key()

    def mirror_lookup(hashes: list[bytes]) -> Any:
        return index.lookup_many([Lookup(hashes, None, compat)], [0])[0]

    def mirror_ok(reply: Any) -> None:
        assert reply.reason == "ok" and reply.matched == args.chain, reply

    # name -> (the call timed, its input made from a chain's hashes outside the timing, a check of its answer)
    calls: dict[str, tuple[Any, Any, Any]] = {
        "remote-g2 mirror (MirrorIndex.lookup_many)": (mirror_lookup, list, mirror_ok)}
    dynamo: dict[str, Any] = {}
    if not args.no_dynamo:
        t0 = time.perf_counter()
        tree = fill_dynamo(args, chains)
        dynamo["fill_s"] = time.perf_counter() - t0
        gc.collect()
        dynamo["rss_bytes_per_hash"] = (rss_bytes() - rss1) / hashes

        def dynamo_input(hashes: list[bytes]) -> list[int]:
            return [int.from_bytes(h[:8], "big") for h in hashes]

        def dynamo_ok(reply: Any) -> None:
            assert max(reply.scores.values()) == args.chain, reply.scores

        calls["Dynamo RadixTree (find_matches)"] = (tree.find_matches, dynamo_input, dynamo_ok)
        print(f"dynamo: built in {dynamo['fill_s']:.0f} s, resident {dynamo['rss_bytes_per_hash']:.0f} B/hash",
              file=sys.stderr)

    # Each sample asks for a random chain; its hashes are made, in each side's form, outside the timing.
    rng = random.Random(args.seed)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds):
        order = list(calls.items()) if r % 2 == 0 else list(reversed(calls.items()))
        for name, (call, make_input, check) in order:
            for _ in range(args.lookups):
                asked = make_input(chain(rng.randrange(chains), args.chain))
                t = time.perf_counter()
                reply = call(asked)
                samples[name].append(time.perf_counter() - t)
                check(reply)
    lat = {name: percentiles(s, "us") for name, s in samples.items()}

    print(f"\n{'system':<46} {'p50 µs':>9} {'p99 µs':>9}")
    for name, v in lat.items():
        print(f"{name:<46} {v['p50_us']:>9.1f} {v['p99_us']:>9.1f}")
    result: dict[str, Any] = {"hashes": hashes, "entries": entries, "chain": args.chain,
                              "holders": args.holders, "workers": args.workers, "memory": memory,
                              "latency": lat, "goal_bytes_per_hash_at_most_64":
                              memory["rss_bytes_per_hash"] <= 64}
    if dynamo:
        names = list(lat)
        ratio = lat[names[0]]["p50_us"] / lat[names[1]]["p50_us"]
        result["dynamo"] = dynamo
        result["p50_mirror_vs_dynamo"] = ratio
        result["goal_p50_at_most_half_of_dynamo"] = ratio <= 0.5
        print(f"goal: mirror lookup p50 <= 0.5x Dynamo's: {ratio:.2f}x -> {'met' if ratio <= 0.5 else 'NOT met'}")
    if args.json:
        write_result(args.json, "mirror_scale", args=vars(args), **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
