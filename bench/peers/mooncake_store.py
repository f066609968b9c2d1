"""Mooncake Store's TCP batch get, measured the way remote-g2's transfer benchmark measures a remote fetch.

``python -m bench.peers.mooncake_store --block-kib 64 --mib 64 --reps 10 --json out.json``

Starts a real ``mooncake_master`` (with its HTTP metadata server) on
loopback, a *holder* process that mounts a segment and ``batch_put_from``s
``mib`` MiB in blocks of ``block_kib`` KiB, and a *reader* (this process)
that ``batch_get_into``s all of them into a registered buffer ``reps``
times, checking the bytes once. Reports the median time and GB/s. Installed
by ``make bench-peers`` (``mooncake-transfer-engine-non-cuda`` plus
libibverbs from Debian). ``MC_TCP_BIND_ADDRESS=127.0.0.1`` keeps every
socket on loopback.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_json

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
# the TCP transport the comparison is about, not a same-host memcpy shortcut
os.environ.setdefault("MC_STORE_MEMCPY", "0")


GET_BATCH = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _store(metadata: str, master: str, segment: int, local: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, segment, local, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"mooncake setup failed: {rc}")
    return store


def _pattern(n_blocks: int, block: int) -> np.ndarray:
    return (np.arange(n_blocks * block, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def _holder(metadata: str, master: str, keys: list[str], block: int, ready: Any, stop: Any) -> None:
    total = len(keys) * block
    store = _store(metadata, master, total + (64 << 20), 64 << 20)
    buf = _pattern(len(keys), block)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    ptrs = [buf.ctypes.data + i * block for i in range(len(keys))]
    for i in range(0, len(keys), 512):
        rcs = store.batch_put_from(keys[i:i + 512], ptrs[i:i + 512], [block] * len(keys[i:i + 512]))
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"batch_put_from failed: {set(rcs)}")
    ready.set()
    stop.wait(600)
    store.close()


def run(block_kib: int, mib: int, reps: int) -> dict[str, Any]:
    exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    rpc, http = _free_port(), _free_port()
    tmp = tempfile.mkdtemp(prefix="mc-")
    master = subprocess.Popen([exe, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                               "--enable_http_metadata_server=true",
                               "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}"],
                              stdout=open(Path(tmp) / "master.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    block = block_kib * 1024
    n = (mib << 20) // block
    keys = [f"blk-{block_kib}-{i}" for i in range(n)]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    holder = None
    try:
        time.sleep(1.0)
        metadata, master_addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        holder = ctx.Process(target=_holder, args=(metadata, master_addr, keys, block, ready, stop))
        holder.start()
        if not ready.wait(120):
            raise RuntimeError("the mooncake holder did not finish its puts")
        store = _store(metadata, master_addr, 16 << 20, n * block + (16 << 20))
        dst = np.zeros(n * block, dtype=np.uint8)
        store.register_buffer(dst.ctypes.data, dst.nbytes)
        ptrs = [dst.ctypes.data + i * block for i in range(n)]
        times = []
        for r in range(reps + 1):
            dst[:] = 0
            t0 = time.perf_counter()
            rcs = []
            for i in range(0, n, GET_BATCH):  # one call of 16 Ki keys fails (-800); 1024 a call works
                rcs += store.batch_get_into(keys[i:i + GET_BATCH], ptrs[i:i + GET_BATCH],
                                            [block] * len(keys[i:i + GET_BATCH]))
            dt = time.perf_counter() - t0
            if any(rc != block for rc in rcs):
                raise RuntimeError(f"batch_get_into returned {sorted(set(rcs))[:5]}")
            if r == 0:
                if not np.array_equal(dst, _pattern(n, block)):
                    raise RuntimeError("mooncake returned wrong bytes")
                continue  # warm-up
            times.append(dt)
        store.close()
    finally:
        stop.set()
        if holder is not None:
            holder.join(30)
            if holder.is_alive():
                holder.kill()
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median(times)
    return {"system": "mooncake_store_tcp", "block_kib": block_kib, "bytes": n * block, "blocks": n, "reps": reps,
            "median_s": med, "gbps": n * block / med / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-kib", type=int, default=64)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = run(a.block_kib, a.mib, a.reps)
    print(json.dumps(res))
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
