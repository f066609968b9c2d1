"""The simulated fleet of ``bench.registry.bench_fleet``: what its workers draw, hold and send, and how they run.

* :class:`Catalogue` and :func:`fingerprint`: the prefix chains of each layout, drawn by Zipf popularity, the
  same in every process (workers store them, targets look them up);
* :class:`SimWorker`: one worker, its pool (chains in LRU order, block reference counts) and its own registry
  session (register, events, resync, restart);
* :func:`worker_proc`: one OS process of the fleet, whose threads drive their share of the workers through the
  phases (fill, the steady phases, hold) and report counters per phase on the run's queue;
* :data:`PHASES`, :func:`phase_ctl` and :func:`merge`: the steady phases, the controls every process of a
  configuration shares, and how counters of threads and processes add up.

Nothing here starts a server or reads a result: ``fleet_run`` does, ``bench_fleet`` reports.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import threading
import time
from collections import OrderedDict
from typing import Any

from remote_g2.protocol.messages import BlockEvent, LayoutFingerprint

MIN_CHAIN, MAX_CHAIN = 16, 128


# -- the catalogue: layouts, chains, Zipf -------------------------------------------------------


def fingerprint(layout: int) -> LayoutFingerprint:
    return LayoutFingerprint(model_id=f"fleet-model-{layout}", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                             num_layers=32, num_kv_heads=8, head_dim=128, tp_size=1)


class Catalogue:
    """Chains of 32-byte block hashes per layout, drawn by Zipf popularity; the same in every process."""

    def __init__(self, chains: int, zipf: float, groups: int, shared_blocks: int, seed: int = 7) -> None:
        self.chains, self.groups, self.shared = chains, max(1, groups), shared_blocks
        rng = random.Random(seed)
        self.lengths = [rng.randint(MIN_CHAIN, MAX_CHAIN) for _ in range(chains)]
        self.cum = list(itertools.accumulate(1.0 / (r + 1) ** zipf for r in range(chains)))
        self._cache: dict[tuple[int, int], list[bytes]] = {}

    def draw(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self.cum, rng.random() * self.cum[-1]), self.chains - 1)

    def hashes(self, layout: int, c: int) -> list[bytes]:
        key = (layout, c)
        got = self._cache.get(key)
        if got is None:
            g = c % self.groups
            got = [hashlib.blake2b(f"{layout}:g{g}:{i}".encode() if i < self.shared else
                                   f"{layout}:c{c}:{i}".encode(), digest_size=32).digest()
                   for i in range(self.lengths[c])]
            if len(self._cache) > 50_000:
                self._cache.clear()
            self._cache[key] = got
        return got


# -- workers --------------------------------------------------------------------------------------


class SimWorker:
    """One worker's pool (chains in LRU order, block reference counts) and its registry session."""

    def __init__(self, idx: int, layout: int, endpoints: list[str], pool_blocks: int, timeout_s: float) -> None:
        from remote_g2.registry import RegistryClient

        self.idx, self.layout = idx, layout
        self.worker_id = f"fleet-w{idx:05d}"
        self.endpoint = f"tcp://127.0.0.1:{30000 + idx}"  # never dialled: no source runs here
        self.fp = fingerprint(layout)
        self.client = RegistryClient(endpoints, timeout_s=timeout_s)
        self.pool_blocks = pool_blocks
        self.chains: OrderedDict[int, list[bytes]] = OrderedDict()
        self.refs: dict[bytes, int] = {}
        self.epoch = 0
        self.seq = 1
        self.next_hb = 0.0
        self.next_restart = float("inf")
        self.need_resync = False

    def register(self, hb_interval: float) -> None:
        self.epoch = max(time.time_ns(), self.epoch + 1)
        reply = self.client.register_worker(self.worker_id, self.endpoint, self.fp, self.epoch)
        self.seq = reply.next_seq
        self.next_hb = time.time() + hb_interval

    def restart(self, hb_interval: float) -> None:
        """A new process: empty pool, new epoch (the old incarnation and its blocks are retired)."""
        self.chains.clear()
        self.refs.clear()
        self.need_resync = False
        self.register(hb_interval)

    def full(self) -> bool:
        return len(self.refs) >= self.pool_blocks - MAX_CHAIN

    def serve(self, cat: Catalogue, rng: random.Random, batch: int, events: list[BlockEvent]) -> int:
        """Serve requests until ``batch`` hashes of events are queued in ``events`` (or 4 x batch draws)."""
        queued = 0

        def emit(kind: str, hashes: list[bytes]) -> None:
            if events and events[-1].kind == kind:
                events[-1].hashes.extend(hashes)
            else:
                events.append(BlockEvent(kind, list(hashes)))

        for _ in range(4 * batch):
            if queued >= batch:
                break
            c = cat.draw(rng)
            if c in self.chains:
                self.chains.move_to_end(c)  # a local hit
                continue
            hashes = cat.hashes(self.layout, c)
            new = [h for h in hashes if h not in self.refs]
            while self.chains and len(self.refs) + len(new) > self.pool_blocks:
                _, old = self.chains.popitem(last=False)
                gone = []
                for h in old:
                    n = self.refs[h] - 1
                    if n:
                        self.refs[h] = n
                    else:
                        del self.refs[h]
                        gone.append(h)
                if gone:
                    emit("removed", gone)
                    queued += len(gone)
                new = [h for h in hashes if h not in self.refs]
            for h in hashes:
                self.refs[h] = self.refs.get(h, 0) + 1
            self.chains[c] = hashes
            if new:
                emit("stored", new)
                queued += len(new)
        return queued

    def resync(self, hb_interval: float) -> int:
        from remote_g2.registry.client.publisher import resync_chunks

        sent = 0
        for _ in range(3):
            status = "ok"
            for chunk, first, last in resync_chunks(list(self.refs)):
                reply = self.client.resync(self.worker_id, self.epoch, self.seq, chunk, first=first, last=last)
                if reply.status != "ok":
                    status = reply.status
                    break
                sent += len(chunk)
                if last:
                    self.seq = reply.expected_seq
            if status == "ok":
                self.need_resync = False
                return sent
            self.register(hb_interval)  # unknown_worker: register, then send the pool again
        return sent


def _new_counters() -> dict[str, Any]:
    return {"applied": 0, "sent": 0, "batches": 0, "resync_hashes": 0, "resyncs": 0, "resync_needed": 0,
            "unknown": 0, "restarts": 0, "heartbeats": 0, "hb_not_ok": 0, "errors": 0, "failovers": 0, "lat": [],
            "t0": float("inf"), "t1": 0.0}


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed, latency samples joined, the phase's span from the first start to the last end."""
    agg = _new_counters()
    for r in reports:
        for k, v in r.items():
            agg[k] = min(agg[k], v) if k == "t0" else max(agg[k], v) if k == "t1" else agg[k] + v
    return agg


PHASES = ("saturated", "paced")  # the two steady phases, in order


def phase_ctl(ctx: Any) -> dict[str, Any]:
    """What the processes share: per steady phase a start event and its window; the paced rate; report, stop."""
    return {"go": [ctx.Event() for _ in PHASES], "win": ctx.Array("d", 2 * len(PHASES)), "rate": ctx.Value("d", 0.0),
            "report": ctx.Event(), "stop": ctx.Event()}


def _driver_thread(workers: list[SimWorker], cfg: dict[str, Any], ph: dict[str, Any], cat: Catalogue, seed: int,
                   counters: dict[str, dict[str, Any]], done: dict[str, threading.Event]) -> None:
    """Drive ``workers`` through fill, the steady phases and the wait for the end; counters per phase."""
    from remote_g2.errors import RemoteG2Error

    rng = random.Random(seed)
    hb = cfg["hb_interval"]
    churn_rate = cfg["churn_per_min"] / 60.0

    def heartbeats(c: dict[str, Any], now: float) -> None:
        for w in workers:
            if now >= w.next_hb:
                w.next_hb = now + hb
                status = w.client.heartbeat(w.worker_id, w.epoch).status
                c["heartbeats"] += 1
                if status != "ok":
                    c["hb_not_ok"] += 1
                    if status == "unknown_worker":
                        c["unknown"] += 1
                        w.register(hb)
                    w.need_resync = True

    def step(w: SimWorker, c: dict[str, Any], churn: bool, now: float) -> None:
        if churn and now >= w.next_restart:
            w.restart(hb)
            c["restarts"] += 1
            w.next_restart = now + rng.expovariate(churn_rate)
        if w.need_resync:
            c["resync_hashes"] += w.resync(hb)
            c["resyncs"] += 1
        events: list[BlockEvent] = []
        n = w.serve(cat, rng, cfg["batch"], events)
        if not n:
            return
        t0 = time.perf_counter()
        try:
            reply = w.client.events(w.worker_id, w.epoch, w.seq, events)
        except RemoteG2Error:
            w.need_resync = True  # these events are in the pool: the resync carries them
            raise
        dt = time.perf_counter() - t0
        if reply.status == "ok":
            w.seq = reply.expected_seq
            c["applied"] += reply.applied
            c["sent"] += n
            c["batches"] += 1
            c["lat"].append(dt)
            return
        # the registry lost track of this worker's blocks: send its pool (these events are in it)
        if reply.status == "resync_needed":
            c["resync_needed"] += 1
            w.seq = reply.expected_seq
        else:
            c["unknown"] += 1
            w.register(hb)
        w.need_resync = True

    def run(phase: str, until: Any, churn: bool = False, traffic: bool = False, rate: float = 0.0) -> None:
        """Heartbeats, and with ``traffic`` event batches (at most ``rate`` block events/s when > 0)."""
        c = counters[phase] = _new_counters()
        c["t0"] = start = time.time()
        failovers0 = sum(w.client.failovers for w in workers)
        rr = itertools.cycle(workers)
        while not until():
            now = time.time()
            try:
                heartbeats(c, now)
                if not traffic:
                    time.sleep(0.05)
                    continue
                if rate > 0 and c["sent"] > rate * (now - start):
                    time.sleep(min(0.05, c["sent"] / rate - (now - start)))
                    continue
                w = next(rr)
                if phase == "fill":
                    pending = [x for x in workers if not x.full()]
                    if not pending:
                        break
                    w = pending[rng.randrange(len(pending))]
                step(w, c, churn, now)
            except RemoteG2Error:
                c["errors"] += 1
                time.sleep(0.05)
        c["t1"] = time.time()
        c["failovers"] = sum(w.client.failovers for w in workers) - failovers0
        done[phase].set()

    for w in workers:
        w.register(hb)
    fill_end = time.time() + cfg["fill_seconds"]
    run("fill", lambda: time.time() >= fill_end, traffic=True)
    for k, phase in enumerate(PHASES):
        run(f"wait-{phase}", lambda: ph["go"][k].is_set() or time.time() >= fill_end + 300)
        for w in workers:  # restarts are drawn from the start of each steady phase
            w.next_restart = time.time() + rng.expovariate(churn_rate) if churn_rate > 0 else float("inf")
        end = ph["win"][2 * k + 1]
        rate = ph["rate"].value / cfg["driver_threads"] if phase == "paced" else 0.0
        run(phase, lambda: time.time() >= end, churn=True, traffic=True, rate=rate)
    run("hold", lambda: ph["stop"].is_set() or time.time() >= fill_end + 900)


def worker_proc(indices: list[int], cfg: dict[str, Any], ph: dict[str, Any], out: Any) -> None:
    """One OS process: ``cfg['threads']`` threads driving the workers of ``indices``; reports per phase."""
    servers: list[str] = cfg["servers"]
    s = len(servers)
    cat = Catalogue(cfg["chains"], cfg["zipf"], cfg["groups"], cfg["shared_blocks"])
    workers = [SimWorker(i, i % cfg["layouts"], servers[i % s:] + servers[:i % s], cfg["pool_blocks"],
                         cfg["timeout_s"]) for i in indices]
    shares = [workers[t::cfg["threads"]] for t in range(cfg["threads"])]
    phases = ("fill", *(f"wait-{p}" for p in PHASES), *PHASES, "hold")
    counters: list[dict[str, dict[str, Any]]] = [{} for _ in shares]
    done = [{p: threading.Event() for p in phases} for _ in shares]
    threads = [threading.Thread(target=_driver_thread, args=(share, cfg, ph, cat, cfg["seed"] * 1000 + indices[0] + t,
                                                             counters[t], done[t]), daemon=True)
               for t, share in enumerate(shares) if share]
    for t in threads:
        t.start()
    limit = time.time() + cfg["fill_seconds"] + 2 * cfg["seconds"] + 600
    for phase in ("fill", *PHASES):
        for d in done[:len(threads)]:
            d[phase].wait(max(0.0, limit - time.time()))
        out.put((phase, merge([c.get(phase, {}) for c in counters])))
    # pools stay as they are from here on (the workers only heartbeat until told to stop)
    out.put(("pools", {w.worker_id: (w.layout, len(w.refs)) for w in workers}))
    for d in done[:len(threads)]:
        d["hold"].wait(max(0.0, limit - time.time()))
    for t in threads:
        t.join(10)
    hold = merge([c.get(p, {}) for c in counters for p in ("hold", *(f"wait-{p}" for p in PHASES))])
    for w in workers:
        w.client.close()
    out.put(("final", hold))
