"""What a G2 pool's first touch costs the copies that land in it, and what faulting it in at start-up buys.

A fresh ``HostPool`` is taken on first touch: the first write of every page
pays a page fault and the kernel's zeroing, inside whichever copy writes it.
For each round, alternating, a fresh pool of ``--blocks`` cache blocks and
``--landing`` landing blocks of ``--block-kib`` KiB is built either ``lazy``
(as it was) or ``prefaulted`` (``HostPool.prefault(background=False)``,
its own time reported apart: the start-up cost), then two copies are timed
as a remote load makes them:

* ``land``: ``--load`` blocks written into landing blocks (where a READ
  lands them);
* ``keep``: those blocks stored from the landing blocks into the cache
  (``HostPool.store``, what the vLLM connector's saver does with them).

The p50 ratio lazy / prefaulted per copy is the figure.

    python -m bench.memory.bench_pool_prefault [--rounds 8] [--blocks 512] [--landing 64] [--load 64] [--block-kib 256]
        [--json F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from bench.common import write_result
from remote_g2.adapters.host_pool import HostPool
from remote_g2.protocol.messages import BlockLayout

MODES = ("lazy", "prefaulted")


def _round(a: argparse.Namespace, mode: str, data: np.ndarray, seed: int) -> dict[str, float]:
    size = a.block_kib << 10
    layout = BlockLayout(num_blocks=a.blocks + a.landing, block_bytes=size, num_layers=1, kv=2,
                         num_kv_heads=1, tokens_per_block=1, head_dim=size // 8, dtype_bytes=4, order="HND")
    pool = HostPool(layout, reserved_blocks=a.landing)
    out: dict[str, float] = {}
    if mode == "prefaulted":
        t0 = time.perf_counter()
        pool.prefault(background=False)
        out["prefault_ms"] = (time.perf_counter() - t0) * 1e3
    raw = pool.tensor.numpy()
    slots = list(pool.reserved_block_ids)[:a.load]
    t0 = time.perf_counter()
    for i, s in enumerate(slots):
        raw[s * size:(s + 1) * size] = data[i * size:(i + 1) * size]
    out["land_ms"] = (time.perf_counter() - t0) * 1e3
    hashes = [seed.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(a.load)]
    t0 = time.perf_counter()
    pool.store(hashes, [raw[s * size:(s + 1) * size] for s in slots])
    out["keep_ms"] = (time.perf_counter() - t0) * 1e3
    assert all(raw[s * size + 7] == data[i * size + 7] for i, s in enumerate(slots))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--blocks", type=int, default=512, help="cache blocks per pool (default 512)")
    p.add_argument("--landing", type=int, default=64, help="landing blocks per pool (default 64)")
    p.add_argument("--load", type=int, default=64, help="blocks a load lands and keeps (default 64)")
    p.add_argument("--block-kib", type=int, default=256, help="block size, KiB (default 256)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if not 0 < a.load <= min(a.landing, a.blocks):
        p.error("--load must be in 1..min(--landing, --blocks)")
    data = np.random.default_rng(1).integers(0, 256, size=a.load * (a.block_kib << 10), dtype=np.uint8)
    rows: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    for r in range(a.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            for k, v in _round(a, mode, data, r).items():
                rows[mode].setdefault(k, []).append(v)
    pool_mib = (a.blocks + a.landing) * a.block_kib / 1024
    load_mib = a.load * a.block_kib / 1024
    print(f"{a.rounds} rounds, a fresh {pool_mib:.0f} MiB pool each, a load of {a.load} x {a.block_kib} KiB "
          f"({load_mib:.0f} MiB), on {os.cpu_count()} CPUs")
    print(f"{'copy':8s} {'lazy p50 ms':>12s} {'prefaulted p50 ms':>18s} {'lazy / prefaulted':>18s}")
    summary: dict[str, float] = {}
    for k in ("land_ms", "keep_ms"):
        lazy, pre = (statistics.median(rows[m][k]) for m in MODES)
        summary[f"{k}_lazy_p50"], summary[f"{k}_prefaulted_p50"], summary[f"{k}_ratio"] = lazy, pre, lazy / pre
        print(f"{k[:-3]:8s} {lazy:12.2f} {pre:18.2f} {lazy / pre:18.1f}")
    pre_ms = statistics.median(rows["prefaulted"]["prefault_ms"])
    summary["prefault_ms_p50"], summary["prefault_s_per_gib"] = pre_ms, pre_ms / 1e3 / (pool_mib / 1024)
    print(f"prefault (start-up, once per pool): {pre_ms:.0f} ms for {pool_mib:.0f} MiB "
          f"({summary['prefault_s_per_gib']:.2f} s per GiB)")
    if a.json:
        write_result(a.json, "pool_prefault", args=vars(a), summary=summary, raw=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
