"""A load reader of a synthetic source: many resolve → NIXL READ → verify → release cycles.

``python tests/source_procs/soak_reader.py --endpoint E --key-space M --window W --cycles N --out R.json``

Loads every rank's agent metadata once (``get_metadata``), writes
``R.json.ready``, waits for ``--go`` to appear (so a launcher can start every
reader's clock together), then runs up to ``--cycles`` cycles, until
``--seconds`` pass or ``--max-errors`` errors happen. A cycle:

1. resolve ``hash_of(s .. s+W-1)`` for a random ``s`` in ``0 .. M-W``;
2. READ the ``matched`` blocks of every rank with real NIXL
   (:class:`source_procs.nixl_reader.Reader`);
3. compare every byte with ``pattern.block_bytes_for(rank, hash)``;
4. release the lease (it must answer ``released``).

Outcomes counted: ``full`` (matched == W), ``partial`` (0 < matched < W),
``empty`` (reason ``miss``) — the last two are the clean misses an evicting
pool causes —, ``over_budget`` refusals, ``errors`` (any exception, a
malformed reply, a release that was refused), and ``wrong_blocks`` /
``wrong_bytes`` against the pattern. The result (counts, the first errors and
mismatches, latencies in ms: ``cycle_ms`` of every clean cycle,
``read_cycle_ms`` of those that READ, ``read_ms`` of the READs alone) goes to ``R.json`` *before* NIXL is torn
down; ``RESULT ok``/``RESULT fail`` to stdout.

:func:`run_soak_readers` starts ``n`` of them against one endpoint and
returns their results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from source_procs.files import write_whole  # noqa: E402
from source_procs.nixl_reader import Reader  # noqa: E402
from source_procs.pattern import block_bytes_for, hash_of  # noqa: E402

from remote_g2.protocol.messages import GetMetadata, Release, Resolve  # noqa: E402
from remote_g2.rpc.client import RpcClient  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
KEEP_ERRORS = 10  # error messages and mismatches kept verbatim in the result


class Expected:
    """The pattern bytes of (rank, key index), computed once each: the key space is small."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, rank: int, i: int) -> np.ndarray:
        got = self._cache.get((rank, i))
        if got is None:
            got = self._cache[(rank, i)] = block_bytes_for(rank, hash_of(i), self.block_bytes)
        return got


def soak(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Run the cycles, filling ``result`` as it goes (so an exception leaves what was counted)."""
    rng = random.Random(args.seed)
    client = RpcClient(args.endpoint, timeout_ms=args.rpc_timeout_ms)
    reader = Reader(args.window)
    result["_close"] = (client, reader)
    meta = client.call(GetMetadata())
    for info in meta.ranks:
        reader.ensure_peer(info)
    tp = meta.tp_size
    known = [p["name"] for p in reader.peers.values()]
    expected = Expected(reader.peers[0]["layout"].block_bytes)

    ready = Path(f"{args.out}.ready")
    ready.write_text(str(os.getpid()))
    wait_until = time.monotonic() + args.go_timeout_s
    while args.go and not Path(args.go).exists():
        if time.monotonic() > wait_until:
            raise TimeoutError(f"no go file {args.go} within {args.go_timeout_s} s")
        time.sleep(0.005)

    def error(msg: str) -> None:
        result["errors"] += 1
        if len(result["error_samples"]) < KEEP_ERRORS:
            result["error_samples"].append(msg)

    result["t_start"] = time.time()
    deadline = time.monotonic() + args.seconds
    while (result["cycles"] < args.cycles and time.monotonic() < deadline
           and result["errors"] < args.max_errors):
        start = rng.randrange(args.key_space - args.window + 1)
        t0 = time.perf_counter()
        try:
            reply = client.call(Resolve([hash_of(start + i) for i in range(args.window)], args.ttl_ms,
                                        "soak-reader", known))
        except Exception as e:
            error(f"resolve: {type(e).__name__}: {e}")
            continue
        result["cycles"] += 1
        if reply.reason == "miss":
            result["empty"] += 1
            result["cycle_ms"].append((time.perf_counter() - t0) * 1000)
            continue
        if reply.reason == "over_budget":
            result["over_budget"] += 1
            continue
        ok = True
        try:
            ranks = sorted(rb.rank for rb in reply.ranks)
            if (reply.reason != "ok" or not 0 < reply.matched <= args.window or ranks != list(range(tp))
                    or any(len(rb.block_ids) != reply.matched for rb in reply.ranks)):
                raise RuntimeError(f"malformed reply: {reply.reason}, matched {reply.matched}, ranks "
                                   f"{[(rb.rank, len(rb.block_ids)) for rb in reply.ranks]}")
            t1 = time.perf_counter()
            reader.read(reply.ranks, timeout_s=args.read_timeout_s)
            result["read_ms"].append((time.perf_counter() - t1) * 1000)
            for rb in reply.ranks:
                buf = reader.peers[rb.rank]["buf"]
                bb = expected.block_bytes
                for i in range(reply.matched):
                    got = buf[i * bb:(i + 1) * bb]
                    want = expected(rb.rank, start + i)
                    wrong = int(np.count_nonzero(got != want))
                    if wrong:
                        result["wrong_blocks"] += 1
                        result["wrong_bytes"] += wrong
                        if len(result["mismatches"]) < KEEP_ERRORS:
                            result["mismatches"].append({"rank": rb.rank, "key": start + i, "block": rb.block_ids[i],
                                                         "wrong_bytes": wrong})
                result["blocks_verified"] += reply.matched
        except Exception as e:
            ok = False
            error(f"read/verify: {type(e).__name__}: {e}")
        try:  # release even when the READ failed: the lease must not outlive the cycle
            if not client.call(Release(reply.lease_id)).released:
                ok = False
                error(f"release of lease {reply.lease_id} answered released=False")
        except Exception as e:
            ok = False
            error(f"release: {type(e).__name__}: {e}")
        if ok:
            result["full" if reply.matched == args.window else "partial"] += 1
            ms = (time.perf_counter() - t0) * 1000
            result["cycle_ms"].append(ms)
            result["read_cycle_ms"].append(ms)
    result["t_end"] = time.time()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--key-space", type=int, required=True, help="resolve windows inside hash_of(0..M-1)")
    p.add_argument("--window", type=int, default=8, help="hashes per resolve")
    p.add_argument("--cycles", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=300.0, help="upper bound on the cycles' wall time")
    p.add_argument("--max-errors", type=int, default=50, help="stop after this many errors")
    p.add_argument("--ttl-ms", type=int, default=30_000)
    p.add_argument("--rpc-timeout-ms", type=float, default=10_000)
    p.add_argument("--read-timeout-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=None, help="the windows drawn (default: from the pid)")
    p.add_argument("--go", default=None, help="wait for this file before the first cycle")
    p.add_argument("--go-timeout-s", type=float, default=120.0)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    if not 1 <= args.window <= args.key_space:
        p.error("--window must be in 1..--key-space")
    if args.seed is None:
        args.seed = os.getpid()

    result: dict[str, Any] = {
        "ok": False, "pid": os.getpid(), "cycles": 0, "full": 0, "partial": 0, "empty": 0, "over_budget": 0,
        "errors": 0, "error_samples": [], "wrong_blocks": 0, "wrong_bytes": 0, "mismatches": [],
        "blocks_verified": 0, "cycle_ms": [], "read_cycle_ms": [], "read_ms": [], "t_start": None, "t_end": None,
    }
    try:
        soak(args, result)
    except Exception as e:  # set-up failed, or the go file never came
        result["errors"] += 1
        result["error_samples"].append(f"setup: {type(e).__name__}: {e}")
    closers = result.pop("_close", None)
    result["ok"] = result["errors"] == 0 and result["wrong_bytes"] == 0 and result["over_budget"] == 0
    write_whole(args.out, json.dumps(result))
    print("RESULT", "ok" if result["ok"] else "fail", flush=True)
    if closers is not None:
        client, reader = closers
        client.close()
        reader.close()
    return 0 if result["ok"] else 1


def run_soak_readers(endpoint: str, out_dir: Path, n: int, *, key_space: int, window: int, cycles: int,
                     seconds: float, start_timeout_s: float = 120.0, seed: int = 0) -> list[dict[str, Any]]:
    """Start ``n`` soak readers, start their cycles together once all are ready, return their results.

    Each reader runs in its own session and is killed by its process group if
    it overruns ``seconds`` (plus a margin). A reader that wrote its result and
    then died of a signal (NIXL at exit) is fine; one that wrote nothing fails
    with its output. Each result gets ``rc`` and the tail of its ``output``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    go = out_dir / f"go-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ)
    env.setdefault("UCX_LOG_LEVEL", "fatal")
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def kill_all() -> None:
        from bench.common import kill_group  # (here: this file also runs as a script, without the repository root)

        for proc, _ in procs:
            if proc.poll() is None:
                kill_group(proc)

    try:
        for i in range(n):
            out = out_dir / f"soak-{os.getpid()}-{time.monotonic_ns()}-{i}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--endpoint", endpoint,
                   "--key-space", str(key_space), "--window", str(window), "--cycles", str(cycles),
                   "--seconds", str(seconds), "--seed", str(seed * 1000 + i), "--go", str(go),
                   "--go-timeout-s", str(start_timeout_s + 30), "--out", str(out)]
            procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           start_new_session=True, cwd=REPO, env=env), out))
        deadline = time.monotonic() + start_timeout_s
        for proc, out in procs:
            ready = Path(f"{out}.ready")
            while not ready.exists() and not out.exists():  # a reader that failed set-up writes its result
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        go.touch()
        results = []
        deadline = time.monotonic() + seconds + 60.0
        for proc, out in procs:
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all()
                raise AssertionError(f"soak reader {proc.pid} did not finish within {seconds + 60:.0f} s") from None
            text = output.decode(errors="replace")[-4000:]
            if not out.exists():
                raise AssertionError(f"soak reader wrote no result (rc={proc.returncode}):\n{text}")
            result = json.loads(out.read_text())
            result["rc"] = proc.returncode
            result["output"] = text
            results.append(result)
        return results
    finally:
        kill_all()
        go.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
