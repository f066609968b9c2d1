"""One TP rank of a synthetic source worker, for tests and benchmarks.

Run every rank with ``mpiexec -n TP python tests/source_procs/source_rank.py --dir D ...``.
Each rank fills a HostPool with hashes ``hash_of(0..N-1)`` (bytes from
``pattern.block_bytes_for(rank, hash)``), starts the source service through
``maybe_start_source_service`` and then, until ``D/stop`` appears or
``--lifetime-s`` passes (never blocking in MPI):

* rank 0 writes ``D/endpoint.json`` (``{"endpoint", "epoch", "pid"}``) once it serves;
* every rank rewrites ``D/state-{rank}.json`` every 50 ms: pid, the pool's
  total pin count and the service's stats;
* a file ``D/cmd-{rank}.json`` (``[{"op": "store"|"remove", "hashes": [i, ...]}]``)
  is applied and renamed to ``.done``;
* ``--file-comm RANK:SIZE`` starts a rank without mpiexec (see :class:`FileComm`);
  ``--torch-comm RANK:SIZE`` without MPI too, over a real ``torch.distributed``
  gloo group (:class:`remote_g2.tp.torch_group.TorchGroupComm`, as vLLM's workers);
* a file ``D/delay-pin-{rank}`` makes this rank's find_and_pin sleep that many
  seconds first (to kill or freeze a rank in the middle of a resolve);
* ``--mla`` makes the worker an MLA one: the fingerprint says ``is_mla=True``
  with one (latent) kv head, every rank's layout has one kv head, and every
  rank holds the SAME bytes, ``block_bytes_for(0, hash)`` (MLA KV is
  replicated across TP ranks).
* ``--churn-hashes M --churn-per-s R`` (off by default) runs a :class:`Churn`
  thread on every rank: it keeps storing runs of ``--churn-batch`` hashes from
  ``hash_of(0..M-1)`` (pattern bytes, as always) at R hashes per second, so a
  pool smaller than M keeps evicting its least-recently-used unpinned blocks
  while readers resolve. Every rank draws the same runs (``--churn-seed``), as
  an engine stores the same blocks on every TP rank, but each at its own pace,
  so ranks evict different blocks at times; ``--churn-rank-seeds`` makes each
  rank draw its own runs, so their contents differ a lot (every resolve is
  trimmed to what all ranks hold). Its counters go into the state and done
  files as ``churn``; the pool's ``evictions`` and ``hits`` (blocks found by
  find_and_pin, trimmed ones included) go there too.

On the way out every rank shuts the service down, then writes ``D/done-{rank}``
(so a NIXL crash at interpreter exit, after that, is recognisable as such).

With ``--tp-size`` the world is split into TP groups (attention DP): group
``g`` is worker ``WORKER_ID-gg`` and its files are named ``endpoint-gg.json``,
``state-gg-{rank}.json`` and so on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from source_procs.files import write_whole  # noqa: E402
from source_procs.pattern import block_bytes_for, hash_of, make_layout  # noqa: E402

from remote_g2.adapters.host_pool import HostPool  # noqa: E402
from remote_g2.rpc.curve import CurveServerConfig  # noqa: E402
from remote_g2.errors import PoolIndexError  # noqa: E402
from remote_g2.protocol.messages import LayoutFingerprint  # noqa: E402
from remote_g2.source import SourceConfig, maybe_start_source_service  # noqa: E402


class FileComm:
    """A stand-in TP communicator for ranks started without mpiexec (``--file-comm RANK:SIZE``).

    Implements the part of ``mpi4py.MPI.Comm`` the source service uses
    (``Get_rank``, ``Get_size``, ``allgather``) with files in a directory, so
    a test can SIGKILL one rank without a launcher tearing the others down.
    """

    def __init__(self, directory: Path, rank: int, size: int, timeout_s: float = 60.0) -> None:
        self.dir, self.rank, self.size, self.timeout_s = directory, rank, size, timeout_s
        self.dir.mkdir(parents=True, exist_ok=True)

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's spelling)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def allgather(self, obj: object) -> list[object]:
        import pickle

        tmp = self.dir / f"allgather-{self.rank}.tmp"
        tmp.write_bytes(pickle.dumps(obj))
        os.replace(tmp, self.dir / f"allgather-{self.rank}.pkl")
        deadline = time.monotonic() + self.timeout_s
        paths = [self.dir / f"allgather-{r}.pkl" for r in range(self.size)]
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                raise TimeoutError("file allgather timed out")
            time.sleep(0.02)
        return [pickle.loads(p.read_bytes()) for p in paths]


class DelayablePool(HostPool):
    """A HostPool whose find_and_pin can be told (by a file) to take its time."""

    def __init__(self, *args, delay_file: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self._delay_file = delay_file

    def find_and_pin(self, hashes):
        try:
            delay = float(self._delay_file.read_text() or "0")
        except (OSError, ValueError):
            delay = 0.0
        if delay > 0:
            time.sleep(delay)
        return super().find_and_pin(hashes)


def stall_gathers_while(path: Path) -> None:
    """Test-only fault: every part a gather packs first waits while ``path`` exists (at most 30 s).

    A stand-in — no real part stalls a memcpy on demand — for a source whose
    gather thread is starved or stuck, so that a test can end the lease, or
    kill the source, while a staged part is not yet packed.
    """
    from remote_g2.source import gather

    pack = gather.pack_chunks

    def stalled(*args, **kwargs):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 30
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return pack(*args, **kwargs)

    gather.pack_chunks = stalled  # type: ignore[assignment]


class Churn(threading.Thread):
    """Stores runs of hashes from a key space larger than the pool, at a steady rate, until stopped.

    Each run is ``batch`` consecutive hashes ``hash_of(j..j+batch-1)`` from a
    random ``j``; the ones not cached take a free block or evict the
    least-recently-used unpinned one (HostPool never evicts a pinned block).
    A store refused because every block is pinned is counted as ``full`` and
    skipped; any other exception is counted as an error (and logged), so a
    soak can fail on it. Bounded: it stops at ``stop`` or ``deadline``
    (monotonic), and after a stall it catches up by at most 100 ms of work.
    """

    TICK_S = 0.01

    def __init__(self, pool: HostPool, fill_rank: int, *, key_space: int, per_s: float, batch: int, seed: int,
                 stop: threading.Event, deadline: float) -> None:
        super().__init__(name="churn", daemon=True)
        if not 1 <= batch <= key_space:
            raise ValueError(f"--churn-batch {batch} must be in 1..{key_space}")
        self.pool, self.fill_rank = pool, fill_rank
        self.key_space, self.per_s, self.batch = key_space, per_s, batch
        self.rng = random.Random(seed)
        self.stop, self.deadline = stop, deadline
        self._bytes: dict[int, object] = {}  # key index -> its pattern bytes (the key space is small)
        self.counts = {"stores": 0, "hashes": 0, "full": 0, "errors": 0, "last_error": ""}

    def _data(self, i: int) -> object:
        data = self._bytes.get(i)
        if data is None:
            data = self._bytes[i] = block_bytes_for(self.fill_rank, hash_of(i), self.pool.layout.block_bytes)
        return data

    def run(self) -> None:
        owed = 0.0
        last = time.monotonic()
        while not self.stop.is_set() and last < self.deadline:
            now = time.monotonic()
            owed = min(owed + self.per_s * (now - last), max(self.batch, self.per_s * 0.1))
            last = now
            while owed >= self.batch and not self.stop.is_set():
                owed -= self.batch
                j = self.rng.randrange(self.key_space - self.batch + 1)
                keys = range(j, j + self.batch)
                try:
                    self.pool.store([hash_of(i) for i in keys], [self._data(i) for i in keys])
                    self.counts["stores"] += 1
                    self.counts["hashes"] += self.batch
                except PoolIndexError:
                    self.counts["full"] += 1
                except Exception as e:  # counted and reported, never silently dropped
                    self.counts["errors"] += 1
                    self.counts["last_error"] = f"{type(e).__name__}: {e}"
                    logging.getLogger("churn").exception("churn store failed")
            self.stop.wait(self.TICK_S)


def write_json(path: Path, data: object) -> None:
    write_whole(path, json.dumps(data))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--hashes", type=int, default=32, help="store hash_of(0..N-1) on every rank")
    p.add_argument("--missing", default="", help="RANK:I,J;... hash indices NOT stored on that rank")
    p.add_argument("--max-ttl-ms", type=int, default=60_000)
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--sibling-timeout-ms", type=int, default=1000)
    p.add_argument("--sibling-retry-after-ms", type=int, default=1000)
    p.add_argument("--rpc-workers", type=int, default=4)
    p.add_argument("--peer-transport", choices=["stream", "zmq"], default="stream")
    p.add_argument("--registry", default=None)
    p.add_argument("--ipc-dir", type=Path, default=None, help="default: DIR/ipc")
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--lifetime-s", type=float, default=120.0)
    p.add_argument("--tp-size", type=int, default=None,
                   help="split MPI world into TP groups of this size (attention DP); each group is worker "
                        "WORKER_ID-gG and its files carry -gG after their stem")
    p.add_argument("--file-comm", default=None, metavar="RANK:SIZE",
                   help="run without MPI: exchange start-up records through files in DIR/comm")
    p.add_argument("--torch-comm", default=None, metavar="RANK:SIZE",
                   help="run without MPI: exchange start-up records over a torch.distributed gloo group")
    p.add_argument("--mla", action="store_true",
                   help="MLA worker: 1 kv head per rank, is_mla fingerprint, rank 0's bytes on every rank")
    p.add_argument("--churn-hashes", type=int, default=0, metavar="M",
                   help="eviction pressure: keep storing hashes from hash_of(0..M-1) (see --churn-per-s)")
    p.add_argument("--churn-per-s", type=float, default=0.0, metavar="R", help="hashes stored per second by churn")
    p.add_argument("--churn-batch", type=int, default=8, help="consecutive hashes per churn store")
    p.add_argument("--churn-seed", type=int, default=1, help="the runs churn draws (the same on every rank)")
    p.add_argument("--churn-rank-seeds", action="store_true", help="each rank draws its own runs (seed + rank)")
    p.add_argument("--curve-secret", type=Path, default=None, help="serve rank 0's TCP endpoints with CURVE")
    p.add_argument("--curve-allowed", type=Path, default=None, help="CURVE: the directory of client keys admitted")
    p.add_argument("--staging-mib", type=int, default=8, help="each rank's staging region (0: never gather)")
    p.add_argument("--gather-min-descriptors", type=int, default=16)
    p.add_argument("--gather-max-piece-kib", type=int, default=8)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()

    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s [pid {os.getpid()}] %(name)s: %(message)s")
    comm = None
    if args.file_comm:
        r, n = (int(x) for x in args.file_comm.split(":"))
        comm = FileComm(args.dir / "comm", r, n)
        world_rank, world_size = r, n
    elif args.torch_comm:
        import torch.distributed as dist

        from remote_g2.tp.torch_group import TorchGroupComm

        r, n = (int(x) for x in args.torch_comm.split(":"))
        dist.init_process_group("gloo", init_method=f"file://{args.dir / 'torch-init'}", rank=r, world_size=n)
        comm = TorchGroupComm(dist.new_group(list(range(n)), backend="gloo"))
        world_rank, world_size = r, n
    else:
        from mpi4py import MPI

        world_rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    tp = args.tp_size or world_size
    rank = world_rank % tp  # the TP rank the service will find (groups are consecutive world ranks)
    tag = "" if args.tp_size is None else f"-g{world_rank // tp}"
    worker_id = args.worker_id + tag
    d: Path = args.dir
    missing: dict[int, set[int]] = {}
    for part in filter(None, args.missing.split(";")):
        r, idx = part.split(":")
        missing[int(r)] = {int(i) for i in idx.split(",") if i}

    stall_gathers_while(d / f"stall-gather{tag}-{rank}")
    layout = make_layout(args.num_blocks, num_kv_heads=1) if args.mla else make_layout(args.num_blocks)
    fill_rank = 0 if args.mla else rank  # whose pattern this rank's blocks hold (MLA: replicated)
    pool = DelayablePool(layout, delay_file=d / f"delay-pin{tag}-{rank}")
    keep = [i for i in range(args.hashes) if i not in missing.get(rank, set())]
    hashes = [hash_of(i) for i in keep]
    pool.store(hashes, [block_bytes_for(fill_rank, h, layout.block_bytes) for h in hashes])

    fingerprint = LayoutFingerprint(model_id="synthetic", dtype="bf16", tokens_per_block=layout.tokens_per_block,
                                    kv_layout="HND", num_layers=layout.num_layers,
                                    num_kv_heads=layout.num_kv_heads if args.mla else layout.num_kv_heads * tp,
                                    head_dim=layout.head_dim, tp_size=tp, is_mla=args.mla)
    config = SourceConfig(enabled=True, ipc_dir=str(args.ipc_dir or d / "ipc"), max_lease_ttl_ms=args.max_ttl_ms,
                          default_lease_ttl_ms=min(10_000, args.max_ttl_ms), pin_budget_blocks=args.budget,
                          sibling_timeout_ms=args.sibling_timeout_ms,
                          sibling_retry_after_ms=args.sibling_retry_after_ms, rpc_workers=args.rpc_workers,
                          registry_endpoint=args.registry, fingerprint=fingerprint, metrics_port=args.metrics_port,
                          peer_transport=args.peer_transport, staging_mib=args.staging_mib,
                          gather_min_descriptors=args.gather_min_descriptors,
                          gather_max_piece_kib=args.gather_max_piece_kib,
                          curve=CurveServerConfig.from_files(args.curve_secret, args.curve_allowed)
                          if args.curve_secret else None)
    service = maybe_start_source_service(pool, worker_id=worker_id, config=config, tp_size=args.tp_size,
                                         comm=comm)
    assert service is not None and service.rank == rank and service.tp_size == tp
    if rank == 0:
        write_json(d / f"endpoint{tag}.json", {"endpoint": service.endpoint, "epoch": service.epoch, "pid": os.getpid(),
                                         "tp_size": tp})

    deadline = time.monotonic() + args.lifetime_s
    churn_stop = threading.Event()
    churn = None
    if args.churn_hashes > 0 and args.churn_per_s > 0:
        churn = Churn(pool, fill_rank, key_space=args.churn_hashes, per_s=args.churn_per_s, batch=args.churn_batch,
                      seed=args.churn_seed + (rank if args.churn_rank_seeds else 0), stop=churn_stop, deadline=deadline)
        churn.start()
    cmd = d / f"cmd{tag}-{rank}.json"
    state = d / f"state{tag}-{rank}.json"
    try:
        while not (d / "stop").exists() and time.monotonic() < deadline:
            if cmd.exists():
                for op in json.loads(cmd.read_text()):
                    hs = [hash_of(i) for i in op["hashes"]]
                    if op["op"] == "store":
                        pool.store(hs, [block_bytes_for(fill_rank, h, layout.block_bytes) for h in hs])
                    elif op["op"] == "remove":
                        pool.remove(hs)
                os.replace(cmd, cmd.with_suffix(".done"))
            st = pool.stats()
            write_json(state, {"pid": os.getpid(), "rank": rank, "total_pins": st["total_pins"],
                               "pinned_blocks": st["pinned_blocks"], "evictions": st["evictions"],
                               "hits": st["hits"], "churn": None if churn is None else dict(churn.counts),
                               "service": service.stats(), "t": time.time()})
            time.sleep(0.05)
    finally:
        churn_stop.set()
        if churn is not None:
            churn.join(10)
        service.shutdown()
        st = pool.stats()
        write_json(d / f"done{tag}-{rank}", {"total_pins": st["total_pins"], "evictions": st["evictions"],
                                             "hits": st["hits"],
                                             "churn": None if churn is None else dict(churn.counts)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
