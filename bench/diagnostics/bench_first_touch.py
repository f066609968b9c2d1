"""What a first touch of fresh memory costs a copy on this machine, and what faulting it in first leaves.

Why G2 pools are faulted in at start-up (``HostPool.prefault``): a copy into
pages nothing has written yet pays a page fault and the kernel's zeroing per
page, and on a virtual machine whose host backs guest memory lazily too, far
more. In one ``--gib`` buffer (``huge_page_buffer``, as a pool's), for each of
``--parts`` parts of ``--mib`` MiB: a copy into the untouched part, then the
same copy again. Then a second buffer of the same size, faulted in first
(``populate``: its time reported), and the same copies into it. What a fresh
process sees depends on how recently the machine freed the memory it gets:
run it on a quiet machine, more than once.

    python -m bench.diagnostics.bench_first_touch [--gib 1] [--mib 16] [--parts 4] [--json F]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from bench.common import write_result
from remote_g2.memory.host_memory import huge_page_buffer, populate


def _copies(buf: np.ndarray, src: np.ndarray, parts: int) -> list[tuple[float, float]]:
    """For each part: (first copy ms, the same copy again ms)."""
    out = []
    n = src.size
    for i in range(parts):
        part = buf[i * n:(i + 1) * n]
        t0 = time.perf_counter()
        part[:] = src
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        part[:] = src
        out.append((first * 1e3, (time.perf_counter() - t0) * 1e3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="buffer size, GiB (default 1)")
    p.add_argument("--mib", type=int, default=16, help="one copy, MiB (default 16: a sized load's share per rank)")
    p.add_argument("--parts", type=int, default=4, help="copies per buffer (default 4)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    nbytes = int(a.gib * (1 << 30))
    if a.parts * (a.mib << 20) > nbytes:
        p.error("--parts x --mib must fit in --gib")
    src = np.ones(a.mib << 20, dtype=np.uint8)
    lazy = _copies(huge_page_buffer(nbytes), src, a.parts)
    warm_buf = huge_page_buffer(nbytes)
    t0 = time.perf_counter()
    done = populate(warm_buf.ctypes.data, nbytes)
    populate_s = time.perf_counter() - t0
    warm = _copies(warm_buf, src, a.parts)
    print(f"{a.mib} MiB copies into a {a.gib:g} GiB buffer, on {os.cpu_count()} CPUs")
    print(f"{'buffer':12s} {'part':>4s} {'first copy ms':>14s} {'again ms':>9s}")
    for name, rows in (("lazy", lazy), ("faulted in", warm)):
        for i, (first, again) in enumerate(rows):
            print(f"{name:12s} {i:4d} {first:14.2f} {again:9.2f}")
    print(f"populate: {done / 2**20:.0f} MiB in {populate_s * 1e3:.0f} ms"
          + ("" if done else " (the kernel does not offer MADV_POPULATE_WRITE)"))
    if a.json:
        write_result(a.json, "first_touch", args=vars(a), lazy_ms=lazy, faulted_in_ms=warm,
                     populate_ms=populate_s * 1e3, populated_bytes=done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
