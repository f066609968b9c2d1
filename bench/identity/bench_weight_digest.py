#!/usr/bin/env python3
"""Benchmark: digesting a model checkpoint (every byte) for its identity: BLAKE3 vs SHA-256 vs xxh3, cold and warm.

A worker's model identity is a digest of every byte of the checkpoint it
loaded (``remote_g2.identity.model_identity.weights_digest``, through
``remote_g2.identity.file_digest``), so the first start on a node reads the whole
checkpoint once. This bench measures what that costs and why the hash is
BLAKE3:

1. writes a synthetic checkpoint of ``--gb`` GB shaped like a Hugging Face
   one (``model-0000k-of-0000n.safetensors`` shards of about ``--shard-gib``
   GiB, each a valid safetensors file, plus ``model.safetensors.index.json``),
   fsynced, under ``--dir`` (default: a fresh directory under /var/tmp,
   removed at the end unless ``--keep``);
2. digests it with ``weights_digest(files, root, cache=None, threads=T,
   algorithm=A)`` for every ``--algorithms`` A and ``--threads`` T, with the
   files' pages **cold** (dropped from the page cache with
   ``posix_fadvise(DONTNEED)`` first; checked with ``mincore``) and **warm**
   (read twice just before), ``--rounds`` rounds with the configurations
   interleaved (and rotated) within each round: GB/s median, min and max;
   a plain read of the same files in the same threads, no hashing, is the
   ceiling (``read``), and each hash's in-memory rate (one thread, no I/O)
   shows which side bounds it;
3. the digest cache: the first ``weights_digest`` with a fresh
   ``DigestCache`` (a miss: pages dropped, every byte read) against the next
   ones (every file a hit: a ``stat`` and a small JSON read per file).

Prints a table and the extrapolation to a 16 GB checkpoint; ``--json PATH``
writes every number with the machine's facts (CPU model, cores, date, commit).
"Cold" means not in this kernel's page cache: on a VM the host may still
cache the virtual disk, so cold figures there are an upper bound. Example::

    python -m bench.identity.bench_weight_digest --gb 4 --rounds 2 --json bench/results/weight-digest.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import REPO, write_result
from remote_g2.identity import file_digest
from remote_g2.errors import ConfigError
from remote_g2.identity.file_digest import DigestCache, hasher_for
from remote_g2.identity.model_identity import checkpoint_files, weights_digest


GIB = 1 << 30
CHUNK = 64 << 20  # bytes generated and written at a time (one tensor)
ROW = 8192  # bytes per tensor row: 4096 bf16 elements
EXTRAPOLATE_GB = 16.0
READ = "read"  # the no-hash ceiling's row name
HIT_CALLS = 5  # digest-cache hits timed after the miss
#: Untimed reads before the warm passes of a round: the first re-read of fresh pages runs slower than later ones
#: (the kernel moves them to its active list then), which would penalise whichever configuration went first.
WARM_UP_READS = 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=4.0, help="checkpoint size in GB (1e9 bytes; default 4.0)")
    p.add_argument("--shard-gib", type=float, default=1.0, help="about this many GiB per shard (default 1.0)")
    p.add_argument("--dir", default=None,
                   help="write the checkpoint here (default: a fresh directory under /var/tmp)")
    p.add_argument("--keep", action="store_true", help="leave the checkpoint files in place at the end")
    p.add_argument("--algorithms", default="blake3,sha256,xxh3_128",
                   help="comma-separated digest algorithms (default blake3,sha256,xxh3_128)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every configuration (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    args.threads = [int(t) for t in args.threads.split(",")]
    if not args.algorithms or READ in args.algorithms:
        p.error(f"--algorithms must name at least one algorithm (and not {READ!r})")
    if min(args.threads) < 1 or args.rounds < 1 or args.gb <= 0 or args.shard_gib <= 0:
        p.error("need --gb > 0, --shard-gib > 0, --rounds >= 1 and thread counts >= 1")
    for a in args.algorithms:
        try:
            hasher_for(a)  # an unknown name fails here, before anything is written
        except (ConfigError, ValueError, ImportError) as e:
            p.error(str(e))
    return args


# --- the synthetic checkpoint -------------------------------------------------------------------------------------


def shard_plan(total_bytes: int, shard_bytes: int) -> list[list[int]]:
    """Per shard, its tensors' byte sizes (at most CHUNK each, whole ROWs); at least two shards."""
    n = max(2, math.ceil(total_bytes / shard_bytes))
    per_shard = max(ROW, total_bytes // n // ROW * ROW)
    plan = []
    for _ in range(n):
        sizes = [CHUNK] * (per_shard // CHUNK)
        if per_shard % CHUNK:
            sizes.append(per_shard % CHUNK)
        plan.append(sizes)
    return plan


def safetensors_header(names: list[str], sizes: list[int]) -> bytes:
    """The 8-byte little-endian length and the JSON header (padded with spaces to 8 bytes) of a safetensors file."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, size in zip(names, sizes):
        meta[name] = {"dtype": "BF16", "shape": [size // ROW, ROW // 2], "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def write_checkpoint(directory: Path, total_bytes: int, shard_bytes: int, seed: int, files: list[Path]) -> float:
    """Write the shards and the index, fsync them and sync once; the seconds it took.

    Each file goes into ``files`` before it is written, so a failure part-way still leaves the list to remove.
    """
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**63, size=CHUNK // 8, dtype=np.uint64)
    buf = np.empty_like(base)
    plan = shard_plan(total_bytes, shard_bytes)
    n = len(plan)
    weight_map: dict[str, str] = {}
    data_total = 0
    layer = 0
    t0 = time.perf_counter()
    for k, sizes in enumerate(plan, 1):
        name = f"model-{k:05d}-of-{n:05d}.safetensors"
        names = [f"model.layers.{layer + i}.mlp.weight" for i in range(len(sizes))]
        layer += len(sizes)
        path = directory / name
        files.append(path)
        with open(path, "wb") as f:
            f.write(safetensors_header(names, sizes))
            for tensor, size in zip(names, sizes):
                np.bitwise_xor(base, rng.integers(1, 2**63, dtype=np.uint64), out=buf)  # random-ish, distinct
                f.write(memoryview(buf).cast("B")[:size])
                weight_map[tensor] = name
                data_total += size
            f.flush()
            os.fsync(f.fileno())
    index = directory / "model.safetensors.index.json"
    files.append(index)
    index.write_text(json.dumps({"metadata": {"total_size": data_total}, "weight_map": weight_map}, indent=2))
    with open(index, "rb") as f:
        os.fsync(f.fileno())
    os.sync()  # nothing dirty left: DONTNEED drops only clean pages
    return time.perf_counter() - t0


# --- the page cache -----------------------------------------------------------------------------------------------


def drop_pages(files: Sequence[Path]) -> None:
    """Ask the kernel to drop the files' (clean) pages from the page cache; no root needed."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc: Any = None


def resident_fraction(files: Sequence[Path]) -> float | None:
    """The fraction of the files' pages in the page cache (``mincore``), or None where it cannot be asked."""
    global _libc
    try:
        if _libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _libc = libc
        page = os.sysconf("SC_PAGE_SIZE")
        resident = pages_total = 0
        for path in files:
            size = os.path.getsize(path)
            if size == 0:
                continue
            pages = (size + page - 1) // page
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr is None or addr == ctypes.c_void_p(-1).value:
                    return None
                try:
                    vec = np.zeros(pages, dtype=np.uint8)
                    if _libc.mincore(addr, size, vec.ctypes.data) != 0:
                        return None
                    resident += int(np.count_nonzero(vec & 1))
                    pages_total += pages
                finally:
                    _libc.munmap(addr, size)
            finally:
                os.close(fd)
        return resident / pages_total if pages_total else None
    except (OSError, AttributeError):
        return None


def _read_file(path: Path) -> int:
    """Read every byte of ``path`` the way ``file_digest`` does (same chunk, ``readv``), hashing nothing."""
    buf = bytearray(file_digest._CHUNK)
    view = memoryview(buf)
    size = os.path.getsize(path)
    done = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while done < size:  # bounded: the file is ours and does not grow
            n = os.readv(fd, [view])
            if not n:
                break
            done += n
    finally:
        os.close(fd)
    return done


def read_all(files: Sequence[Path], threads: int) -> int:
    """Read the files in ``threads`` threads, one file per task, as ``weights_digest`` does; bytes read."""
    with ThreadPoolExecutor(max(1, min(len(files), threads))) as pool:
        return sum(pool.map(_read_file, files))


# --- the measurements ---------------------------------------------------------------------------------------------


def one_pass(algorithm: str, threads: int, files: Sequence[Path], root: Path) -> tuple[float, int, str | None]:
    """Seconds, bytes and digest (None for the plain read) of one pass over the checkpoint."""
    t0 = time.perf_counter()
    if algorithm == READ:
        nbytes = read_all(files, threads)
        return time.perf_counter() - t0, nbytes, None
    wd = weights_digest(files, root, cache=None, threads=threads, algorithm=algorithm)
    seconds = time.perf_counter() - t0
    assert wd.bytes_read == wd.bytes, "cache=None must read every byte"
    return seconds, wd.bytes_read, wd.digest


def hash_in_memory(algorithm: str, data: memoryview, reps: int) -> float:
    """GB/s of one thread hashing ``data`` ``reps`` times (no I/O)."""
    h = hasher_for(algorithm)()
    h.update(data[: 1 << 20])  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        h.update(data)
    h.hexdigest()
    return len(data) * reps / (time.perf_counter() - t0) / 1e9


def summarize(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def measure(args: argparse.Namespace, files: list[Path], root: Path) -> dict[str, Any]:
    configs = [(READ, t) for t in args.threads] + [(a, t) for a in args.algorithms for t in args.threads]
    gbps: dict[tuple[str, int, str], list[float]] = {(a, t, c): [] for a, t in configs for c in ("cold", "warm")}
    secs: dict[tuple[str, int, str], list[float]] = {k: [] for k in gbps}
    digests: dict[str, set[str]] = {a: set() for a in args.algorithms}
    resident_cold: list[float] = []
    resident_warm: list[float] = []
    in_memory: dict[str, list[float]] = {a: [] for a in args.algorithms}
    mem_data = memoryview(np.random.default_rng(args.seed + 1).integers(
        0, 2**63, size=CHUNK // 8, dtype=np.uint64)).cast("B")
    total = len(configs) * 2 * args.rounds
    done = 0
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[: r % len(configs)]  # rotated: no config always goes first
        for cache in ("cold", "warm"):
            if cache == "warm":
                for _ in range(WARM_UP_READS):  # untimed: bring every page in, and past its first re-reads
                    read_all(files, max(args.threads))
                if (f := resident_fraction(files)) is not None:
                    resident_warm.append(f)
            for algorithm, threads in order:
                if cache == "cold":
                    drop_pages(files)
                    if (f := resident_fraction(files)) is not None:
                        resident_cold.append(f)
                seconds, nbytes, digest = one_pass(algorithm, threads, files, root)
                gbps[(algorithm, threads, cache)].append(nbytes / seconds / 1e9)
                secs[(algorithm, threads, cache)].append(seconds)
                if digest is not None:
                    digests[algorithm].add(digest)
                done += 1
                print(f"  round {r + 1}/{args.rounds} {cache:<4} {algorithm:<9} {threads} thr: "
                      f"{nbytes / seconds / 1e9:6.2f} GB/s ({done}/{total})", file=sys.stderr)
        for a in args.algorithms:
            in_memory[a].append(hash_in_memory(a, mem_data, 4))
    for a, seen in digests.items():
        assert len(seen) == 1, f"{a}: the same files gave {len(seen)} different digests"
    rows = []
    for (algorithm, threads, cache), samples in gbps.items():
        rows.append({"algorithm": algorithm, "threads": threads, "cache": cache,
                     "gbps": summarize(samples), "seconds": summarize(secs[(algorithm, threads, cache)]),
                     "samples_gbps": samples,
                     "digest": next(iter(digests[algorithm])) if algorithm != READ else None})
    return {"rows": rows, "hash_in_memory_gbps": {a: summarize(v) for a, v in in_memory.items()},
            "resident_after_drop_max": max(resident_cold) if resident_cold else None,
            "resident_warm_min": min(resident_warm) if resident_warm else None}


def measure_digest_cache(files: list[Path], root: Path, threads: int, cache_dir: Path) -> dict[str, Any]:
    """A fresh cache: the first call (pages dropped: a miss, every byte read), then HIT_CALLS calls (all hits)."""
    cache = DigestCache(cache_dir, racy_window_s=0)
    drop_pages(files)
    t0 = time.perf_counter()
    miss = weights_digest(files, root, cache=cache, threads=threads)
    miss_s = time.perf_counter() - t0
    hits = []
    for _ in range(HIT_CALLS):
        t0 = time.perf_counter()
        hit = weights_digest(files, root, cache=cache, threads=threads)
        hits.append(time.perf_counter() - t0)
        assert hit.digest == miss.digest, "a cache hit gave another digest"
        assert all(f.cached for f in hit.files) and hit.bytes_read == 0, "a second call read the files again"
    return {"algorithm": file_digest.ALGORITHM, "threads": threads, "files": len(files),
            "miss_s": miss_s, "miss_bytes_read": miss.bytes_read, "miss_files_cached": sum(f.cached for f in miss.files),
            "first_hit_s": hits[0], "hit_s": summarize(hits), "all_hits": True}


# --- the report ---------------------------------------------------------------------------------------------------


def machine_facts() -> dict[str, Any]:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {}
    for mod in ("blake3", "xxhash"):
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", None) or getattr(m, "VERSION", None)
        except ImportError:
            versions[mod] = None
    return {"cpu_model": cpu, "nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "mem_total_gb": mem_gb, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "python": sys.version.split()[0], "numpy": np.__version__, **versions,
            "platform": platform.platform(), "loadavg_start": os.getloadavg()}


def extrapolate(rows: list[dict[str, Any]], cache: dict[str, Any], threads: list[int], shard_bytes: int,
                nfiles: int) -> dict[str, Any]:
    """A 16 GB checkpoint at this machine's blake3 medians; the cache hit scaled by the file count."""
    default = min(4, len(os.sched_getaffinity(0)))  # weights_digest's own default
    t = default if default in threads else max(threads)
    rate = {r["cache"]: r["gbps"]["median"] for r in rows if r["algorithm"] == "blake3" and r["threads"] == t}
    files_16 = math.ceil(EXTRAPOLATE_GB * 1e9 / shard_bytes) + 1  # shards and the index
    return {"gb": EXTRAPOLATE_GB, "algorithm": "blake3", "threads": t,
            "cold_s": EXTRAPOLATE_GB / rate["cold"] if "cold" in rate else None,
            "warm_s": EXTRAPOLATE_GB / rate["warm"] if "warm" in rate else None,
            "files": files_16, "restart_ms": cache["hit_s"]["median"] / nfiles * files_16 * 1e3}


def print_report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"\nweight digest: {cfg['bytes'] / 1e9:.2f} GB checkpoint, {cfg['shards']} safetensors shards + index, "
          f"{args.rounds} round(s); {result['machine']['cpu_model']}, {result['machine']['nproc']} cores")
    print(f"written in {result['write']['seconds']:.1f} s ({result['write']['gbps']:.2f} GB/s, fsynced)")
    res_cold, res_warm = result["resident_after_drop_max"], result["resident_warm_min"]
    if res_cold is not None and res_warm is not None:
        print(f"page cache: at most {res_cold:.1%} of the pages resident after a drop (cold), at least "
              f"{res_warm:.1%} before a warm pass")
    header = (f"{'algorithm':<16} {'threads':>7} {'cache':<5} {'GB/s med':>9} {'min':>7} {'max':>7} "
              f"{'s (ckpt)':>9}")
    print(header)
    print("-" * len(header))
    for r in sorted(result["rows"], key=lambda r: (r["cache"], r["algorithm"] != READ, r["algorithm"], r["threads"])):
        name = "read (no hash)" if r["algorithm"] == READ else r["algorithm"]
        g = r["gbps"]
        print(f"{name:<16} {r['threads']:>7} {r['cache']:<5} {g['median']:>9.2f} {g['min']:>7.2f} {g['max']:>7.2f} "
              f"{r['seconds']['median']:>9.2f}")
    mem = ", ".join(f"{a} {v['median']:.2f}" for a, v in result["hash_in_memory_gbps"].items())
    print(f"hash rate in memory, 1 thread, GB/s: {mem}")
    c = result["digest_cache"]
    print(f"digest cache ({c['algorithm']}, {c['threads']} threads, {c['files']} files): first call (miss, pages "
          f"dropped) {c['miss_s']:.2f} s; next calls (all hits) median {c['hit_s']['median'] * 1e3:.2f} ms "
          f"(min {c['hit_s']['min'] * 1e3:.2f}, max {c['hit_s']['max'] * 1e3:.2f})")
    e = result["extrapolation_16gb"]

    def fmt(s: float | None) -> str:
        return "n/a" if s is None else f"{s:.1f}"

    print(f"first start for a 16 GB checkpoint: {fmt(e['cold_s'])} s cold, {fmt(e['warm_s'])} s warm "
          f"(blake3, {e['threads']} threads); a restart with the cache: {e['restart_ms']:.1f} ms "
          f"({e['files']} files)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_facts()
    total_bytes = int(args.gb * 1e9)
    shard_bytes = int(args.shard_gib * GIB)
    owned_dir: Path | None = None
    made_dir = False
    if args.dir is None:
        owned_dir = root = Path(tempfile.mkdtemp(prefix="bench-weight-digest-", dir="/var/tmp"))
    else:
        root = Path(args.dir).resolve()
        made_dir = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        n = len(shard_plan(total_bytes, shard_bytes))
        ours = {f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)} | {"model.safetensors.index.json"}
        foreign = sorted(f.name for f in root.glob("*.safetensors*") if f.name not in ours)
        if foreign:  # they would be digested with ours (and not removed): refuse before writing anything
            raise SystemExit(f"{root} already holds other safetensors files: {foreign}")
    cache_dir = Path(tempfile.mkdtemp(prefix="bench-weight-digest-cache-", dir="/var/tmp"))
    files: list[Path] = []
    try:
        print(f"writing {total_bytes / 1e9:.2f} GB to {root} ...", file=sys.stderr)
        write_s = write_checkpoint(root, total_bytes, shard_bytes, args.seed, files)
        found = checkpoint_files(root)
        if sorted(found) != sorted(files):
            raise SystemExit(f"{root} holds other checkpoint files than this bench's: {sorted(map(str, found))}")
        nbytes = sum(os.path.getsize(f) for f in files)
        measured = measure(args, files, root)
        cache = measure_digest_cache(files, root, max(args.threads), cache_dir)
        result = {
            "config": {"gb": args.gb, "bytes": nbytes, "shards": len(files) - 1, "shard_gib": args.shard_gib,
                       "files": [f.name for f in files], "algorithms": args.algorithms, "threads": args.threads,
                       "rounds": args.rounds, "seed": args.seed, "dir": str(root),
                       "read_chunk_bytes": file_digest._CHUNK, "production_algorithm": file_digest.ALGORITHM},
            "machine": {**machine, "loadavg_end": os.getloadavg()},
            "write": {"seconds": write_s, "gbps": nbytes / write_s / 1e9},
            **measured,
            "digest_cache": cache,
        }
        result["extrapolation_16gb"] = extrapolate(measured["rows"], cache, args.threads, shard_bytes, len(files))
        print_report(args, result)
        if args.json:
            print()
            write_result(args.json, "weight_digest", **result)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        if not args.keep:
            if owned_dir is not None:
                shutil.rmtree(owned_dir, ignore_errors=True)
            else:
                for f in files:
                    f.unlink(missing_ok=True)
                if made_dir and not any(root.iterdir()):
                    root.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
