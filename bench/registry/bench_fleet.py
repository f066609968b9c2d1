"""Fleet simulation: N workers publishing with churn, M targets looking up, against 1-3 registry servers.

    python -m bench.registry.bench_fleet [--servers 1,3] [--store redis,cluster] [--workers 100,1000]
                                [--lookups server,mirror] [--seconds 8] [--json bench/results/fleet.json]

The defaults run the whole matrix (16 configurations) in about 10 minutes on
the 2-core development VM; a smoke run: ``--servers 1 --store redis
--workers 20 --lookups server --seconds 3``.

What it plays, per configuration (servers x store x workers x lookups), each
on a fresh private ``redis-server`` (``--store redis``) or a fresh 3-master
Redis Cluster without replicas (``--store cluster``), with S ``remote-g2
serve`` processes in front of it (lease ``--lease-s``, 10 s as the server's
default; change feed on), everything on 127.0.0.1:

* **Workers** (``--workers`` N): each registers (epoch = wall-clock ns) with a
  failover list that starts at "its" server (worker ``i`` at server ``i % S``,
  then the others), heartbeats every third of the lease, and serves requests:
  it draws a prefix chain from a Zipf distribution (``--zipf`` s over
  ``--chains`` chains per layout, rank 1 most popular; chain lengths 16-128
  blocks of 32-byte hashes, the first ``--shared-blocks`` of each chain shared
  with the other chains of its group, ``--groups`` groups, as a system prompt
  is). A chain it holds is a local hit (moved to the front of its LRU); any
  other chain is stored: ``removed`` events for the least recently used
  chains it evicts to stay within ``--pool-blocks`` blocks (a block two of
  its chains share goes with the last of them), then ``stored`` events for
  the chain's blocks it does not hold yet. Events go out in ``events``
  batches of at least ``--batch`` hashes, in order, under the worker's own
  sequence numbers; a ``resync_needed`` answer sends its whole pool
  (``resync``), an ``unknown_worker`` one registers it again first. Churn:
  workers restart at random (exponential) times, ``--churn-per-min`` of the
  fleet per minute on average: a new epoch, an empty pool filled again by
  its traffic. Workers are split over ``--layouts`` layouts (model ids):
  their hashes never meet.
* **How they run**: ``--procs`` OS processes with ``--threads`` threads each;
  a thread drives its share of the workers round-robin, one call at a time
  (so at most ``procs x threads`` calls are in flight). Every worker has its
  own :class:`RegistryClient` (its own DEALER socket per server and its own
  failover state), so the servers see N peers, as with a real fleet; what
  the simulation does not have is N processes' worth of CPU, and it needs
  none: a worker's engine work is not simulated, only its registry traffic,
  and a thread per worker would spend this box's two cores on switching.
* **Phases**: *fill* — workers store until every pool is full (at most
  ``--fill-seconds``), no churn; *saturated* — ``--seconds`` with the
  publishers closed-loop (each thread sends its next batch as soon as the
  last is answered), every store evicting, churn on, targets looking up,
  followers counting: the event rate is what this box sustains, not a
  fleet's demand; *paced* — ``--seconds`` more with the publishers held to
  ``--load`` (0.5) of the saturated phase's rate: lookup latency with
  headroom.
* **Targets** (``--targets`` M processes): lookups of Zipf-drawn chains (the
  chain's hashes and 4 blocks of the request's own, which no worker holds)
  with their layout's compat key, paced at ``--lookup-rate`` lookups/s each
  (0: back to back). ``--lookups server``: a round trip through a failover
  list starting at server ``t % S`` (the store's lookup script);
  ``--lookups mirror``: each target keeps a :class:`RegistryMirror` of its
  layout (what ``REMOTE_G2_TARGET_REGISTRY_MIRROR=1`` gives a target leader)
  and looks up there, asking the server only until it is ready.
* **Feed followers** (``--followers`` K): raw ZMQ SUB sockets on every
  server's change feed (what each registry mirror receives before it filters
  by layout), counting frames, bytes and gaps (frames the PUB dropped); and
  one :class:`RegistryMirror` of layout 0 in a process of its own, checked
  at the end against the workers' pools. The targets' mirrors (``--lookups
  mirror``) are followers too.

Columns of the table (the JSON has these and more per row: each phase's
counts, lookup reasons, heartbeats/s, restarts, the cores each group of
processes kept busy, the mirror's state):

    srv / store / workers / lookups   the configuration
    entries        (hash, holder) entries at the end (the servers' ``stats``, after the sweep)
    fill ev/s      block events/s applied while filling (stored only), from the publishers' ok answers
    sat ev/s       block events/s applied in the saturated phase (stored + removed), ditto
    ev p50/p99     the publishers' ``events`` round trip in the saturated phase, ms
    lk p50/p99     lookup round trip (or mirror call) in the saturated phase, ms
    paced ev/s     block events/s applied in the paced phase
    lk/s, p50/p99  lookups answered per second (all targets) and their latency in the paced phase, ms
    hit%           paced-phase lookups that found a holder
    B/entry        Redis ``used_memory`` growth (summed over the masters on Cluster) / entries, once the
                   sweepers deleted every retired incarnation
    feed msg/s, MB/s   change-feed frames and bytes per second ONE follower received (all the servers'
                   feeds), saturated phase
    flw            followers attached: raw ones, the layout-0 mirror, the targets' mirrors
    gaps           feed frames the followers missed (all of them)
    ok             every check passed: the block events the servers counted == those the publishers
                   were told were applied; entries == the workers' pools; every retired incarnation
                   swept; the layout-0 mirror holds exactly layout 0's pools

Checks that fail are reported (``problems``), not raised, so a run always
writes its JSON; the exit code is 1 when any configuration has a problem.

Not simulated: engines, sources and NIXL (nothing listens on the workers'
endpoints; no resolve follows a lookup); ``serve --mirror-lookups``;
failures (servers and Redis stay up: ``tests/test_faults_registry.py``);
hosts (everything shares this box's 2 cores with the simulation itself, so
every rate is CPU-bound here and the split between ingest and lookups is
the scheduler's; the JSON's ``cpu_cores`` says who used what); Redis
replicas (the Cluster runs without: a replica per master doubles its
memory and adds the replication stream); and time: the registry holds the
fleet's full state after the fill, but a run lasts seconds, not days.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import itertools
import multiprocessing as mp
import os
import random
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from bench import common
from bench.common import percentiles, proc_cpu_s
from tests.conftest import cluster_masters, start_redis_cluster  # (the test suite's cluster builder)

from remote_g2.protocol.messages import BlockEvent, LayoutFingerprint

MIN_CHAIN, MAX_CHAIN = 16, 128
LOOKUP_TAIL = 4  # a request's own new blocks after the cached prefix: never stored anywhere
KEY_PREFIX = "rg2:"


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


def _merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed, latency samples joined, the phase's span from the first start to the last end."""
    agg = _new_counters()
    for r in reports:
        for k, v in r.items():
            agg[k] = min(agg[k], v) if k == "t0" else max(agg[k], v) if k == "t1" else agg[k] + v
    return agg


PHASES = ("saturated", "paced")  # the two steady phases, in order


def _phase_ctl(ctx: Any) -> dict[str, Any]:
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
        out.put((phase, _merge([c.get(phase, {}) for c in counters])))
    # pools stay as they are from here on (the workers only heartbeat until told to stop)
    out.put(("pools", {w.worker_id: (w.layout, len(w.refs)) for w in workers}))
    for d in done[:len(threads)]:
        d["hold"].wait(max(0.0, limit - time.time()))
    for t in threads:
        t.join(10)
    hold = _merge([c.get(p, {}) for c in counters for p in ("hold", *(f"wait-{p}" for p in PHASES))])
    for w in workers:
        w.client.close()
    out.put(("final", hold))


# -- targets, followers, mirror ----------------------------------------------------------------------


def target_proc(t: int, cfg: dict[str, Any], ph: dict[str, Any], out: Any) -> None:
    """Zipf-drawn lookups of one layout through a failover list, paced; latencies per steady phase."""
    from remote_g2.errors import MirrorNotReady, RemoteG2Error
    from remote_g2.registry import RegistryClient

    servers: list[str] = cfg["servers"]
    s = len(servers)
    layout = t % cfg["layouts"]
    compat = fingerprint(layout).compat_key()
    cat = Catalogue(cfg["chains"], cfg["zipf"], cfg["groups"], cfg["shared_blocks"])
    rng = random.Random(cfg["seed"] * 7 + t)
    period = 1.0 / cfg["lookup_rate"] if cfg["lookup_rate"] > 0 else 0.0
    report: dict[str, Any] = {}
    mirror = None
    if cfg["target_mirror"]:  # the leader's own copy of its layout (REMOTE_G2_TARGET_REGISTRY_MIRROR)
        from remote_g2.registry import RegistryMirror

        mirror = RegistryMirror(servers, compat_key=compat, timeout_s=30).start()
    with RegistryClient(servers[t % s:] + servers[:t % s], timeout_s=cfg["timeout_s"]) as client:
        def lookup(hashes: list[bytes]) -> Any:
            if mirror is not None and mirror.ready:
                try:
                    return mirror.lookup(hashes, requester=f"fleet-target-{t}", compat_key=compat)
                except MirrorNotReady:
                    pass
            return client.lookup(hashes, requester=f"fleet-target-{t}", compat_key=compat)

        for k, phase in enumerate(PHASES):
            ph["go"][k].wait(cfg["fill_seconds"] + 300)
            from_mirror = 0
            end = ph["win"][2 * k + 1]
            lat: list[float] = []
            reasons: dict[str, int] = {}
            matched = errors = 0
            next_at = time.time()
            while (now := time.time()) < end:
                if period and now < next_at:
                    time.sleep(min(next_at - now, end - now))
                    continue
                next_at = max(next_at + period, now - 1.0)  # behind by more than 1 s: do not catch up
                hashes = cat.hashes(layout, cat.draw(rng)) + [rng.randbytes(32) for _ in range(LOOKUP_TAIL)]
                t0 = time.perf_counter()
                ready = mirror is not None and mirror.ready
                try:
                    reply = lookup(hashes)
                except RemoteG2Error:
                    errors += 1
                    continue
                lat.append(time.perf_counter() - t0)
                reasons[reply.reason] = reasons.get(reply.reason, 0) + 1
                matched += reply.matched
                from_mirror += ready
            report[phase] = {"lat": lat, "reasons": reasons, "matched": matched, "errors": errors,
                             "from_mirror": from_mirror}
    if mirror is not None:
        mirror.close()
    out.put(("target", report))


def follower_proc(feeds: list[str], n: int, ph: dict[str, Any], out: Any) -> None:
    """``n`` raw SUB sockets on every feed: frames and bytes per steady phase, and gaps, per follower."""
    import zmq

    from remote_g2.protocol.wire import decode_frame

    ctx = zmq.Context()
    socks = []
    for _ in range(n):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1_000_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for f in feeds:
            sub.connect(f)
        socks.append(sub)
    poller = zmq.Poller()
    for sub in socks:
        poller.register(sub, zmq.POLLIN)
    stats: list[dict[str, Any]] = [{"gaps": 0, "ticks": 0, **{f"{p}_{x}": 0 for p in PHASES for x in ("msgs", "bytes")}}
                                   for _ in socks]
    last: list[dict[bytes, int]] = [{} for _ in socks]
    out.put(("follower_ready", None))
    deadline = time.time() + 3600
    try:
        while not ph["stop"].is_set() and time.time() < deadline:
            ready = dict(poller.poll(100))
            now = time.time()
            window = next((p for k, p in enumerate(PHASES)
                           if ph["go"][k].is_set() and now < ph["win"][2 * k + 1]), None)
            for sub, st, seen in zip(socks, stats, last):
                if sub not in ready:
                    continue
                for _ in range(1000):
                    try:
                        inst, frame = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    f = decode_frame(frame)
                    if f.type == "feed_tick":
                        st["ticks"] += 1
                    else:
                        prev = seen.get(inst)
                        if prev is not None and f.id != prev + 1:
                            st["gaps"] += f.id - prev - 1
                        seen[inst] = f.id
                    if window is not None:
                        st[f"{window}_msgs"] += 1
                        st[f"{window}_bytes"] += len(inst) + len(frame)
    finally:
        for sub in socks:
            sub.close(0)
        ctx.term()
    out.put(("followers", stats))


def mirror_proc(servers: list[str], compat: str, ph: dict[str, Any], out: Any) -> None:
    """A registry mirror of one layout (as a target leader keeps); reports its state twice a second from
    ``report`` until ``stop``."""
    from remote_g2.registry import RegistryMirror

    mirror = RegistryMirror(servers, compat_key=compat, timeout_s=30).start()
    try:
        ph["report"].wait(3600)
        deadline = time.time() + 600
        while not ph["stop"].is_set() and time.time() < deadline:
            st = mirror.stats()
            out.put(("mirror", {"ready": st.ready, "entries": st.block_entries, "workers": st.workers_live,
                                "applied": st.applied, "snapshots": st.snapshots, "resyncs": st.resyncs}))
            ph["stop"].wait(0.5)
    finally:
        mirror.close()


# -- one configuration --------------------------------------------------------------------------------


def _redis_nodes(store: str, url: str) -> list[Any]:
    import redis

    if store == "cluster":
        return [redis.Redis(host=h, port=p, socket_timeout=5) for h, p in cluster_masters(url)]
    return [redis.Redis.from_url(url, socket_timeout=5)]


def _used_memory(nodes: list[Any]) -> int:
    return sum(int(n.info("memory")["used_memory"]) for n in nodes)


def _gone(nodes: list[Any]) -> int:
    """Retired incarnations still waiting for the sweeper (the meta slot's ``gone`` set, wherever it lives)."""
    key = KEY_PREFIX + "{m}:gone"
    total = 0
    for n in nodes:
        try:
            total += int(n.zcard(key))
        except Exception:  # noqa: BLE001 - MOVED: another master holds the meta slot
            pass
    return total


def _cpu_snapshot(groups: dict[str, list[int]]) -> tuple[float, dict[str, float]]:
    return time.time(), {g: sum(proc_cpu_s(p) for p in pids) for g, pids in groups.items()}


def _cpu_share(before: tuple[float, dict[str, float]], after: tuple[float, dict[str, float]]) -> dict[str, float]:
    """Cores each group of processes kept busy between two snapshots."""
    secs = after[0] - before[0]
    return {g: (after[1][g] - before[1][g]) / secs for g in before[1]}


def _get(q: Any, kind: str, timeout: float, stash: list[tuple[str, Any]]) -> Any:
    """The next message of ``kind`` from ``q`` (others are kept in ``stash``)."""
    for i, (k, v) in enumerate(stash):
        if k == kind:
            del stash[i]
            return v
    deadline = time.time() + timeout
    while True:
        left = deadline - time.time()
        if left <= 0:
            raise TimeoutError(f"no {kind!r} report within {timeout:.0f} s")
        k, v = q.get(timeout=left)
        if k == kind:
            return v
        stash.append((k, v))


def _window(ph: dict[str, Any], k: int, seconds: float) -> None:
    """Open steady phase ``k`` for ``seconds``, starting in 0.2 s (every process reads the window first)."""
    start = time.time() + 0.2
    ph["win"][2 * k], ph["win"][2 * k + 1] = start, start + seconds
    ph["go"][k].set()
    time.sleep(max(0.0, start - time.time()))


def run_config(n_servers: int, store: str, n_workers: int, lookups: str, args: argparse.Namespace) -> dict[str, Any]:
    from remote_g2.registry import RegistryClient

    ctx = mp.get_context("spawn")
    row: dict[str, Any] = {"servers": n_servers, "store": store, "workers": n_workers,
                           "lookups_from": lookups}
    problems: list[str] = []
    procs: list[Any] = []    # servers and Redis we started (stopped by PID)
    children: list[Any] = []  # our simulation processes
    tag = f"[{n_servers} srv, {store}, {n_workers} workers, lookups from {lookups}]"
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        try:
            if store == "cluster":
                cprocs, url = start_redis_cluster(Path(tmp))
                procs.extend(cprocs)
                store_args = ("--redis-cluster-url", url)
            else:
                rproc, url = common.start_redis(tmp)
                procs.append(rproc)
                store_args = ("--redis-url", url)
            servers = []
            for k in range(n_servers):
                sproc, ep = common.start_registry(*store_args, log_path=str(Path(tmp) / f"serve{k}.log"),
                                                         lease_ttl_s=args.lease_s)
                procs.append(sproc)
                servers.append(ep)
            nodes = _redis_nodes(store, url)
            mem0 = _used_memory(nodes)
            feeds = []
            for ep in servers:
                with RegistryClient(ep, timeout_s=10) as c:
                    feeds.append(c.feed_info().endpoint)

            nproc = max(1, min(args.procs, n_workers))
            threads = max(1, min(args.threads, n_workers // nproc))
            cfg = {"servers": servers, "chains": args.chains, "zipf": args.zipf, "groups": args.groups,
                   "shared_blocks": args.shared_blocks, "layouts": args.layouts, "pool_blocks": args.pool_blocks,
                   "batch": args.batch, "threads": threads, "driver_threads": nproc * threads,
                   "hb_interval": args.lease_s / 3, "churn_per_min": args.churn_per_min,
                   "fill_seconds": args.fill_seconds, "seconds": args.seconds, "timeout_s": args.timeout_s,
                   "lookup_rate": args.lookup_rate, "target_mirror": lookups == "mirror", "seed": args.seed}
            ph = _phase_ctl(ctx)
            q = ctx.Queue()
            stash: list[tuple[str, Any]] = []
            for p in range(nproc):
                children.append(ctx.Process(target=worker_proc, args=(list(range(p, n_workers, nproc)), cfg, ph, q),
                                            daemon=True))
            for t in range(args.targets):
                children.append(ctx.Process(target=target_proc, args=(t, cfg, ph, q), daemon=True))
            if args.followers:
                children.append(ctx.Process(target=follower_proc, args=(feeds, args.followers, ph, q), daemon=True))
            if args.mirror:
                children.append(ctx.Process(target=mirror_proc, args=(servers, fingerprint(0).compat_key(), ph, q),
                                            daemon=True))
            for ch in children:
                ch.start()
            kinds = ["workers"] * nproc + ["targets"] * args.targets + ["followers"] * bool(args.followers) + \
                ["mirror"] * bool(args.mirror)
            groups: dict[str, list[int]] = {"redis": [p.pid for p in procs[:len(procs) - n_servers]],
                                            "servers": [p.pid for p in procs[len(procs) - n_servers:]]}
            for kind, ch in zip(kinds, children):
                groups.setdefault(kind, []).append(ch.pid)
            if args.followers:
                _get(q, "follower_ready", 60, stash)

            fill = _merge([_get(q, "fill", args.fill_seconds + 120, stash) for _ in range(nproc)])
            print(f"  {tag} filled in {fill['t1'] - fill['t0']:.1f} s; two steady phases of {args.seconds:.0f} s",
                  file=sys.stderr)
            phase: dict[str, dict[str, Any]] = {}
            cpu: dict[str, dict[str, float]] = {}
            for k, name in enumerate(PHASES):
                if name == "paced":
                    sat = phase["saturated"]
                    ph["rate"].value = args.load * sat["applied"] / (sat["t1"] - sat["t0"])
                _window(ph, k, args.seconds)
                before = _cpu_snapshot(groups)
                phase[name] = _merge([_get(q, name, args.seconds + 120, stash) for _ in range(nproc)])
                cpu[name] = _cpu_share(before, _cpu_snapshot(groups))
            pools: dict[str, tuple[int, int]] = {}
            for _ in range(nproc):
                pools.update(_get(q, "pools", 60, stash))
            expected = sum(n for _, n in pools.values())
            expected_l0 = sum(n for layout, n in pools.values() if layout == 0)
            ph["report"].set()
            targets = [_get(q, "target", 120, stash) for _ in range(args.targets)]
            server_events = 0
            for ep in servers:
                with RegistryClient(ep, timeout_s=30) as c:
                    server_events += c.stats().events_ingested
            mirror = None
            if args.mirror:  # the copy has caught up once it holds exactly the layout-0 workers' pools
                deadline = time.time() + 60
                while time.time() < deadline:
                    mirror = _get(q, "mirror", 60, stash)
                    if mirror["ready"] and mirror["entries"] == expected_l0:
                        break
            # entries and memory once the sweepers have deleted every retired incarnation (churn; the
            # servers' block_entries counts those too until then)
            deadline = time.time() + args.sweep_wait_s
            while (gone := _gone(nodes)) and time.time() < deadline:
                time.sleep(0.25)
            with RegistryClient(servers, timeout_s=30) as c:
                entries = c.stats().block_entries
            mem1 = _used_memory(nodes)
            keys = sum(int(n.dbsize()) for n in nodes)
            ph["stop"].set()
            hold = _merge([_get(q, "final", 60, stash) for _ in range(nproc)])
            followers = _get(q, "followers", 60, stash) if args.followers else []
            for ch in children:
                ch.join(30)
        finally:
            for ch in children:
                if ch.is_alive():
                    ch.terminate()
                    ch.join(10)
            for p in reversed(procs):
                common.stop(p)

    every = [fill, *phase.values(), hold]
    publisher_applied = sum(r["applied"] for r in every)
    if server_events != publisher_applied:
        problems.append(f"servers counted {server_events} block events, publishers were told {publisher_applied}")
    if any(r["applied"] != r["sent"] for r in every):
        problems.append("an ok batch was answered with another applied count than the hashes it carried")
    if entries != expected:
        problems.append(f"registry holds {entries} entries, the workers' pools {expected}")
    if gone:
        problems.append(f"{gone} retired incarnations still unswept after {args.sweep_wait_s:.0f} s")
    if mirror is not None and not (mirror["ready"] and mirror["entries"] == expected_l0):
        problems.append(f"layout-0 mirror: ready={mirror['ready']}, {mirror['entries']} entries, "
                        f"pools hold {expected_l0}")
    row.update({
        "entries": entries, "entries_expected": expected, "entries_layout0": expected_l0, "redis_keys": keys,
        "fill_s": fill["t1"] - fill["t0"], "fill_block_events": fill["applied"],
        "fill_events_per_s": fill["applied"] / max(1e-9, fill["t1"] - fill["t0"]),
        "server_events_ingested": server_events, "publisher_applied": publisher_applied,
        "redis_used_memory_bytes": mem1 - mem0, "bytes_per_entry": (mem1 - mem0) / entries if entries else 0.0,
        "unswept_incarnations": gone,
        "followers": len(followers) + (1 if mirror is not None else 0) + (args.targets if lookups == "mirror" else 0),
        "raw_followers": len(followers),
        "feed_gaps": sum(f["gaps"] for f in followers), "mirror": mirror,
        # what a healthy run never sees: batches answered resync_needed, heartbeats not ok, lapses, errors
        **{k: sum(r[key] for r in every) for k, key in (
            ("resync_needed", "resync_needed"), ("resyncs", "resyncs"), ("resync_hashes", "resync_hashes"),
            ("hb_not_ok", "hb_not_ok"), ("unknown_worker", "unknown"), ("failovers", "failovers"),
            ("errors", "errors"))},
    })
    for name, r in phase.items():
        secs = r["t1"] - r["t0"]
        ev = percentiles(r["lat"])
        lat = [x for t in targets for x in t[name]["lat"]]
        lk = percentiles(lat)
        reasons: dict[str, int] = {}
        for t in targets:
            for k, v in t[name]["reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
        looked = sum(reasons.values())
        row[name] = {
            "seconds": secs, "block_events": r["applied"], "events_per_s": r["applied"] / secs,
            "batches_per_s": r["batches"] / secs, "events_p50_ms": ev["p50_ms"], "events_p99_ms": ev["p99_ms"],
            "restarts": r["restarts"], "heartbeats_per_s": r["heartbeats"] / secs,
            "lookups": looked, "lookups_per_s": looked / secs, "lookup_p50_ms": lk["p50_ms"],
            "lookup_p99_ms": lk["p99_ms"], "lookup_reasons": reasons,
            "lookup_errors": sum(t[name]["errors"] for t in targets),
            "lookups_from_target_mirror": sum(t[name]["from_mirror"] for t in targets),
            "lookup_hit_rate": reasons.get("ok", 0) / looked if looked else 0.0,
            "mean_matched_blocks": sum(t[name]["matched"] for t in targets) / max(1, reasons.get("ok", 0)),
            "feed_msgs_per_s_per_follower": (sum(f[f"{name}_msgs"] for f in followers) / len(followers) / secs
                                             if followers else 0.0),
            "feed_bytes_per_s_per_follower": (sum(f[f"{name}_bytes"] for f in followers) / len(followers) / secs
                                              if followers else 0.0),
            "cpu_cores": cpu[name],  # cores each group of processes kept busy (of this box's two)
        }
        row["lookup_errors"] = row.get("lookup_errors", 0) + row[name]["lookup_errors"]
    row["target_paced_rate"] = ph["rate"].value
    row["problems"] = problems
    return row


# -- output -----------------------------------------------------------------------------------------------

COLUMNS = [("srv", "servers", "{}"), ("store", "store", "{}"), ("workers", "workers", "{:,}"),
           ("lookups", "lookups_from", "{}"),
           ("entries", "entries", "{:,}"), ("fill ev/s", "fill_events_per_s", "{:,.0f}"),
           ("sat ev/s", "saturated.events_per_s", "{:,.0f}"), ("ev p50", "saturated.events_p50_ms", "{:.1f}"),
           ("ev p99", "saturated.events_p99_ms", "{:.1f}"), ("lk p50", "saturated.lookup_p50_ms", "{:.2f}"),
           ("lk p99", "saturated.lookup_p99_ms", "{:.2f}"), ("paced ev/s", "paced.events_per_s", "{:,.0f}"),
           ("lk/s", "paced.lookups_per_s", "{:,.0f}"), ("lk p50", "paced.lookup_p50_ms", "{:.2f}"),
           ("lk p99", "paced.lookup_p99_ms", "{:.2f}"), ("hit%", "paced.lookup_hit_rate", "{:.0%}"),
           ("B/entry", "bytes_per_entry", "{:.0f}"),
           ("feed msg/s", "saturated.feed_msgs_per_s_per_follower", "{:,.0f}"),
           ("feed MB/s", "saturated.feed_bytes_per_s_per_follower", "{:.2f}"), ("flw", "followers", "{}"),
           ("gaps", "feed_gaps", "{}")]


def _value(row: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        row = row.get(part, {}) if isinstance(row, dict) else {}
    return row if row != {} else 0


def table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration; ``sat``: the saturated phase, ``paced``: publishers at ``--load`` of it."""
    cells = [[h for h, _, _ in COLUMNS] + ["ok"]]
    for r in rows:
        vals = []
        for _, key, fmt in COLUMNS:
            v = _value(r, key)
            vals.append(fmt.format(v / 1e6 if key.endswith("feed_bytes_per_s_per_follower") else v))
        cells.append(vals + ["yes" if not r.get("problems") else "NO"])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) if i in (1, 3) else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="1,3", help="registry servers per configuration, comma-separated (1-3)")
    ap.add_argument("--store", default="redis,cluster", help="redis and/or cluster, comma-separated")
    ap.add_argument("--workers", default="100,1000", help="simulated workers per configuration, comma-separated")
    ap.add_argument("--seconds", type=float, default=8.0, help="each steady phase (saturated, paced)")
    ap.add_argument("--load", type=float, default=0.5,
                    help="the paced phase's event rate, as a fraction of the saturated phase's")
    ap.add_argument("--fill-seconds", type=float, default=40.0, help="at most this long to fill the pools")
    ap.add_argument("--procs", type=int, default=2, help="worker processes")
    ap.add_argument("--threads", type=int, default=4, help="driver threads per worker process")
    ap.add_argument("--targets", type=int, default=2, help="target processes looking up")
    ap.add_argument("--lookup-rate", type=float, default=500.0, help="lookups/s per target (0: back to back)")
    ap.add_argument("--lookups", default="server,mirror",
                    help="where targets look up, comma-separated: server (a round trip; the store's script), "
                         "mirror (their own registry mirror of their layout; the server until it is ready)")
    ap.add_argument("--followers", type=int, default=2, help="raw change-feed followers (besides the mirror)")
    ap.add_argument("--no-mirror", dest="mirror", action="store_false", help="no layout-0 registry mirror")
    ap.add_argument("--pool-blocks", type=int, default=2048, help="blocks each worker holds (its G2 pool)")
    ap.add_argument("--batch", type=int, default=256, help="hashes per events batch (at least)")
    ap.add_argument("--chains", type=int, default=20_000, help="prefix chains per layout")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of chain popularity")
    ap.add_argument("--groups", type=int, default=64, help="chain groups sharing a prefix (system prompts)")
    ap.add_argument("--shared-blocks", type=int, default=8, help="leading blocks a group's chains share")
    ap.add_argument("--layouts", type=int, default=2, help="model layouts the fleet is split over")
    ap.add_argument("--churn-per-min", type=float, default=0.05, help="fraction of workers restarting a minute")
    ap.add_argument("--lease-s", type=float, default=10.0, help="the servers' --lease-ttl-s")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="client call timeout")
    ap.add_argument("--sweep-wait-s", type=float, default=30.0,
                    help="at the end, wait this long at most for the sweepers before reading Redis memory")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    servers, stores, fleet = _ints(args.servers), args.store.split(","), _ints(args.workers)
    modes = args.lookups.split(",")
    if not all(1 <= s <= 3 for s in servers) or not set(stores) <= {"redis", "cluster"} or not fleet \
            or not set(modes) <= {"server", "mirror"}:
        ap.error("--servers takes 1-3, --store redis and/or cluster, --lookups server and/or mirror, "
                 "--workers at least one count")
    if args.pool_blocks < 2 * MAX_CHAIN:
        ap.error(f"--pool-blocks must hold two of the longest chains ({2 * MAX_CHAIN})")
    rows = []
    t0 = time.time()
    for store in stores:
        for s in servers:
            for n in fleet:
                for mode in modes:
                    print(f"config: {s} server(s), {store}, {n} workers, lookups from {mode}", file=sys.stderr)
                    rows.append(run_config(s, store, n, mode, args))
                    print(table(rows[-1:]), file=sys.stderr)
                    for p in rows[-1]["problems"]:
                        print(f"  PROBLEM: {p}", file=sys.stderr)
    print(table(rows))
    print(f"({time.time() - t0:.0f} s in all; {os.cpu_count()} CPUs)")
    if args.json:
        common.write_result(args.json, "fleet", args=vars(args), rows=rows)
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
