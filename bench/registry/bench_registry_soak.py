"""Registry consistency soak: publishers stream block events while clients look up; every answer is checked.

Everything real, on this machine: a ``remote-g2 serve`` process (memory store,
or ``--redis-url`` on a private ``redis-server``), --publishers processes each
running a :class:`SourcePublisher`, --clients processes looking up as fast as
they can, for --seconds.

The invariant. Publisher P owns chains nobody else touches and keeps each one
a *prefix*: an event extends it (``stored`` of the next hashes), cuts its tail
(``removed``) or empties every chain of P (``cleared``). P logs every state
change (the prefix length, stamped with ``time.monotonic()`` *before* the
event is queued) and, each time ``flush()`` returns True, how many events the
registry has accepted (stamped *after*). A client logs each lookup (chain,
asked length k, sent and received on the same clock, the answer). Offline:

* ``a`` = the chain's state after the last event P had acknowledged before
  the lookup was sent; ``b`` = its state after the last event P had queued
  before the reply arrived. The registry applies one batch atomically (memory:
  one lock; Redis: one Lua script), so the answer is ``min(L, k)`` for some
  state ``L`` between ``a`` and ``b`` — and names P, or no one when that is 0.
* A chain of a publisher that does not exist is answered by no one.

Anything else is a violation. Timestamps err on the permissive side only by
the width of one ``time.monotonic()`` call, never towards a false alarm.

    python -m bench.registry.bench_registry_soak [--seconds 60] [--store both] [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import sys
import tempfile
import threading
import time
from array import array
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.common import start_redis, start_registry, stop, write_result
from remote_g2.errors import RemoteG2Error
from remote_g2.protocol.messages import LayoutFingerprint

FP = LayoutFingerprint(model_id="soak", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=4, num_kv_heads=2, head_dim=64, tp_size=1)
#: Publisher index of lookups for chains nobody owns.
GHOST = 255
#: Owner code of an answer that names a worker id this soak did not start.
STRANGER = -2
REASONS = ["ok", "no_candidate", "incompatible_layout", "source_is_target"]


@dataclass(frozen=True)
class SoakSpec:
    """What every process of one soak run does."""

    seconds: float = 60.0
    publishers: int = 4
    clients: int = 4
    chains: int = 32            # per publisher; chains * chain_len stays < one resync chunk (16384)
    chain_len: int = 32
    max_burst: int = 24         # events queued back to back before a pause or a flush
    flush_prob: float = 0.25    # after a burst: wait for the registry's acknowledgement
    clear_prob: float = 0.002   # per event: a ``cleared`` instead of a prefix change
    resync_prob: float = 0.003  # per burst: ask the publisher to send a full snapshot
    ghost_prob: float = 0.03    # per lookup: a chain nobody owns
    max_pause_s: float = 0.005  # after a burst that is not flushed: sleep up to this (leaves CPU to the lookups)
    seed: int = 1


def chain_hashes(publisher: int, chain: int, n: int) -> list[bytes]:
    """The hashes of ``chain`` of ``publisher``: 8-byte u64s, distinct across (publisher, chain, position)."""
    base = (publisher + 1) << 48 | (chain + 1) << 24
    return [(base + i + 1).to_bytes(8, "big") for i in range(n)]


def worker_id(publisher: int) -> str:
    return f"soak-p{publisher}"


def owner_code(wid: str | None) -> int:
    """A lookup answer's worker as a publisher index; -1 for no one, STRANGER for an id we did not start."""
    if wid is None:
        return -1
    if wid.startswith("soak-p") and wid[6:].isdigit():
        return int(wid[6:])
    return STRANGER


# -- the processes ---------------------------------------------------------------------------------------


def publisher_main(index: int, endpoint: str, spec: SoakSpec, ready: Any, go: Any, out: Any) -> None:
    """One worker: stream prefix changes of its own chains, acknowledge with ``flush()``, log both."""
    from remote_g2.registry import RegistryClient, SourcePublisher

    rng = random.Random(spec.seed * 7919 + index)
    chains = [chain_hashes(index, c, spec.chain_len) for c in range(spec.chains)]
    held = [0] * spec.chains
    lock = threading.Lock()  # makes (pool change, enqueue) atomic against snapshot()

    def snapshot() -> list[bytes]:
        with lock:
            return [h for c, n in enumerate(held) for h in chains[c][:n]]

    # Event i+1: when it was queued, its chain (-1: every chain, ``cleared``), the chain's new length.
    ev_t, ev_chain, ev_len = array("d"), array("i"), array("i")
    ack_t, ack_idx = array("d"), array("q")
    counters = {"events": 0, "block_events": 0, "flushes": 0, "flush_timeouts": 0, "resync_requests": 0}
    client = RegistryClient(endpoint, timeout_s=10)
    pub = SourcePublisher(client, worker_id=worker_id(index), endpoint=f"tcp://127.0.0.1:{30000 + index}",
                          fingerprint=FP, snapshot=snapshot, flush_interval_s=0.005)
    ready.put(index)
    go.wait(120)
    deadline = time.monotonic() + spec.seconds
    pub.start()
    n = spec.chain_len
    try:
        while time.monotonic() < deadline:
            for _ in range(rng.randint(1, spec.max_burst)):
                c = rng.randrange(spec.chains)
                with lock:
                    length = held[c]
                    if rng.random() < spec.clear_prob:
                        ev_t.append(time.monotonic())
                        ev_chain.append(-1)
                        ev_len.append(0)
                        counters["block_events"] += sum(held)
                        held[:] = [0] * spec.chains
                        pub.cleared()
                        continue
                    if length == 0 or (length < n and rng.random() < 0.55):
                        new = rng.randint(length + 1, n)
                    else:
                        new = rng.randint(0, length - 1)
                    ev_t.append(time.monotonic())
                    ev_chain.append(c)
                    ev_len.append(new)
                    held[c] = new
                    if new > length:
                        pub.stored(chains[c][length:new], parent=chains[c][length - 1] if length else None)
                    else:
                        pub.removed(chains[c][new:length][::-1])
                    counters["block_events"] += abs(new - length)
            if rng.random() < spec.resync_prob:
                pub.request_resync()
                counters["resync_requests"] += 1
            if rng.random() < spec.flush_prob:
                upto = len(ev_t)
                counters["flushes"] += 1
                if pub.flush(10):
                    ack_t.append(time.monotonic())
                    ack_idx.append(upto)
                else:
                    counters["flush_timeouts"] += 1
            else:
                time.sleep(rng.random() * spec.max_pause_s)
        upto = len(ev_t)
        if pub.flush(10):
            ack_t.append(time.monotonic())
            ack_idx.append(upto)
        else:
            counters["flush_timeouts"] += 1
    finally:
        counters["events"] = len(ev_t)
        counters.update(registrations=pub.registrations, resyncs=pub.resyncs, batches=pub.batches_sent)
        pub.close()
        client.close()
    out.put(("publisher", index, {"ev_t": ev_t, "ev_chain": ev_chain, "ev_len": ev_len,
                                  "ack_t": ack_t, "ack_idx": ack_idx, "counters": counters}))


def client_main(index: int, endpoint: str, spec: SoakSpec, ready: Any, go: Any, out: Any) -> None:
    """One reader: look up random chains (full or a prefix of them) and log every answer with its send/receive time."""
    from remote_g2.registry import RegistryClient

    rng = random.Random(spec.seed * 104729 + index)
    n = spec.chain_len
    chains = {(p, c): chain_hashes(p, c, n) for p in list(range(spec.publishers)) + [GHOST] for c in range(spec.chains)}
    log = {"pub": array("i"), "chain": array("i"), "k": array("i"), "t_send": array("d"), "t_recv": array("d"),
           "reason": array("b"), "owner": array("i"), "matched": array("i"), "holders_ok": array("b")}
    errors: dict[str, int] = {}
    client = RegistryClient(endpoint, timeout_s=10)
    ready.put(index)
    go.wait(120)
    deadline = time.monotonic() + spec.seconds
    try:
        while time.monotonic() < deadline:
            p = GHOST if rng.random() < spec.ghost_prob else rng.randrange(spec.publishers)
            c = rng.randrange(spec.chains)
            k = n if rng.random() < 0.5 else rng.randint(1, n)
            want_all = rng.random() < 0.5
            t0 = time.monotonic()
            try:
                reply = client.lookup(chains[p, c][:k], want_all_holders=want_all)
            except RemoteG2Error as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                continue
            t1 = time.monotonic()
            best = reply.best.worker_id if reply.best is not None else None
            # With every holder asked for, the list must be exactly the best one (chains are not shared).
            holders_ok = (not want_all or [(h.worker_id, h.matched) for h in reply.holders]
                          == ([] if reply.best is None else [(best, reply.matched)]))
            log["pub"].append(p)
            log["chain"].append(c)
            log["k"].append(k)
            log["t_send"].append(t0)
            log["t_recv"].append(t1)
            log["reason"].append(REASONS.index(reply.reason) if reply.reason in REASONS else -1)
            log["owner"].append(owner_code(best))
            log["matched"].append(reply.matched)
            log["holders_ok"].append(1 if holders_ok else 0)
    finally:
        client.close()
    out.put(("client", index, {"log": log, "errors": errors}))


# -- the check ------------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    lookups: int = 0
    violations: int = 0
    hits: int = 0               # answers naming the owner with matched >= 1
    ghost_lookups: int = 0
    open_windows: int = 0       # lookups whose [a, b] window held more than one answer: concurrency was exercised
    examples: list[dict[str, Any]] = field(default_factory=list)


def check(publishers: dict[int, dict[str, Any]], clients: list[dict[str, Any]], *, chains: int,
          atomic: bool = True, max_examples: int = 10) -> CheckResult:
    """Check every logged lookup against the publishers' logs; see the module docstring.

    ``atomic=False`` (a store that applies a batch in several steps) widens the
    allowed answers from the window's states to the range they span.
    """
    # Per (publisher, chain): the states in order, each with when it was queued and the event that made it.
    hist: dict[tuple[int, int], tuple[list[float], list[int], list[int]]] = {}
    acks: dict[int, tuple[array, array]] = {}
    for p, log in publishers.items():
        per = {c: ([float("-inf")], [0], [0]) for c in range(chains)}
        for i, (t, c, length) in enumerate(zip(log["ev_t"], log["ev_chain"], log["ev_len"]), start=1):
            for cc in (range(chains) if c < 0 else (c,)):
                ts, idx, lens = per[cc]
                ts.append(t)
                idx.append(i)
                lens.append(length)
        for c, h in per.items():
            hist[p, c] = h
        acks[p] = (log["ack_t"], log["ack_idx"])
    res = CheckResult()
    for cl in clients:
        log = cl["log"]
        for j in range(len(log["pub"])):
            p, c, k = log["pub"][j], log["chain"][j], log["k"][j]
            t_send, t_recv = log["t_send"][j], log["t_recv"][j]
            reason, owner, matched = log["reason"][j], log["owner"][j], log["matched"][j]
            res.lookups += 1
            if p == GHOST:
                res.ghost_lookups += 1
                allowed: set[int] | range = {0}
                window_lens: list[int] = [0]
            else:
                ack_t, ack_idx = acks[p]
                pos = bisect_right(ack_t, t_send)
                acked = ack_idx[pos - 1] if pos else 0
                ts, idx, lens = hist[p, c]
                a = bisect_right(idx, acked) - 1
                b = max(a, bisect_right(ts, t_recv) - 1)
                window_lens = [min(x, k) for x in lens[a:b + 1]]
                allowed = set(window_lens) if atomic else range(min(window_lens), max(window_lens) + 1)
                if len(set(window_lens)) > 1:
                    res.open_windows += 1
            if reason == REASONS.index("ok"):
                good = owner == p and matched >= 1 and matched in allowed
                res.hits += good
            elif reason == REASONS.index("no_candidate"):
                good = owner == -1 and matched == 0 and 0 in allowed
            else:
                good = False
            good = good and bool(log["holders_ok"][j])
            if not good:
                res.violations += 1
                if len(res.examples) < max_examples:
                    res.examples.append({
                        "publisher": p, "chain": c, "asked": k, "t_send": t_send, "t_recv": t_recv,
                        "reason": REASONS[reason] if 0 <= reason < len(REASONS) else "?", "owner": owner,
                        "matched": matched, "allowed": sorted(set(window_lens)) if atomic else
                        [min(window_lens), max(window_lens)], "holders_ok": bool(log["holders_ok"][j])})
    return res


# -- the run --------------------------------------------------------------------------------------------


def run_soak(store: str, spec: SoakSpec, *, redis_url: str | None = None, workdir: str | None = None) -> dict[str, Any]:
    """One soak against a fresh ``remote-g2 serve`` on ``store`` ("memory" or "redis"); returns the numbers.

    ``redis_url`` (an emptied server) is used for "redis" when given, else a
    private ``redis-server`` is started and stopped.
    """
    if store not in ("memory", "redis"):
        raise ValueError(f"store must be memory or redis, not {store!r}")
    own_tmp = tempfile.TemporaryDirectory() if workdir is None else None
    tmp = workdir or own_tmp.name  # type: ignore[union-attr]
    redis_proc = None
    procs: list[Any] = []
    registry = None
    try:
        if store == "redis" and redis_url is None:
            redis_proc, redis_url = start_redis(tmp)
        registry, endpoint = start_registry(*(["--redis-url", redis_url] if store == "redis" else []),
                                            log_path=os.path.join(tmp, f"registry-{store}.log"))
        ctx = mp.get_context("spawn")
        ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        for i in range(spec.publishers):
            procs.append(ctx.Process(target=publisher_main, args=(i, endpoint, spec, ready, go, out), daemon=True))
        for i in range(spec.clients):
            procs.append(ctx.Process(target=client_main, args=(i, endpoint, spec, ready, go, out), daemon=True))
        for proc in procs:
            proc.start()
        for _ in procs:
            ready.get(timeout=60)
        go.set()
        t0 = time.monotonic()
        publishers: dict[int, dict[str, Any]] = {}
        clients: list[dict[str, Any]] = []
        for _ in procs:
            try:
                kind, index, data = out.get(timeout=spec.seconds + 60)
            except queue.Empty:
                dead = [p.exitcode for p in procs]
                raise RuntimeError(f"a soak process did not report (exit codes {dead})") from None
            if kind == "publisher":
                publishers[index] = data
            else:
                clients.append(data)
        wall = time.monotonic() - t0
        for proc in procs:
            proc.join(30)
        registry_alive = registry.poll() is None
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        if registry is not None:
            stop(registry)
        if redis_proc is not None:
            stop(redis_proc)
        if own_tmp is not None:
            own_tmp.cleanup()
    t_check = time.monotonic()
    res = check(publishers, clients, chains=spec.chains, atomic=True)
    check_s = time.monotonic() - t_check
    counters = [publishers[i]["counters"] for i in sorted(publishers)]
    events = sum(c["events"] for c in counters)
    block_events = sum(c["block_events"] for c in counters)
    errors: dict[str, int] = {}
    for cl in clients:
        for name, n in cl["errors"].items():
            errors[name] = errors.get(name, 0) + n
    return {
        "store": store, "seconds": spec.seconds, "wall_s": wall, "check_s": check_s,
        "publishers": spec.publishers, "clients": spec.clients, "registry_alive": registry_alive,
        "lookups": res.lookups, "violations": res.violations, "hits": res.hits, "ghost_lookups": res.ghost_lookups,
        "open_windows": res.open_windows, "lookup_errors": errors, "examples": res.examples,
        "events": events, "block_events": block_events,
        "events_per_s": events / spec.seconds, "block_events_per_s": block_events / spec.seconds,
        "lookups_per_s": res.lookups / spec.seconds,
        "acks": sum(len(publishers[i]["ack_t"]) for i in publishers),
        "flush_timeouts": sum(c["flush_timeouts"] for c in counters),
        "resync_requests": sum(c["resync_requests"] for c in counters),
        "resyncs": sum(c["resyncs"] for c in counters),
        "registrations": sum(c["registrations"] for c in counters),
        "batches": sum(c["batches"] for c in counters),
        "spec": asdict(spec),
    }


def print_table(results: list[dict[str, Any]]) -> None:
    rows = [("lookups", "{lookups:,}"), ("violations", "{violations:,}"), ("lookups/s", "{lookups_per_s:,.0f}"),
            ("events/s (event messages)", "{events_per_s:,.0f}"),
            ("block events/s (hashes)", "{block_events_per_s:,.0f}"),
            ("hits (owner named, matched >= 1)", "{hits:,}"), ("lookups with a moving window", "{open_windows:,}"),
            ("ghost-chain lookups", "{ghost_lookups:,}"), ("publisher acknowledgements (flush)", "{acks:,}"),
            ("event batches sent", "{batches:,}"), ("resyncs (asked / done)", "{resync_requests:,} / {resyncs:,}"),
            ("lookup errors", "{errors}"), ("flush timeouts", "{flush_timeouts:,}")]
    cells = [[fmt.format(**r, errors=sum(r["lookup_errors"].values())) for r in results] for _, fmt in rows]
    w = max(len(name) for name, _ in rows)
    cw = [max(14, len(r["store"])) for r in results]
    spec = results[0]["spec"]
    print(f"\nregistry consistency soak: {spec['publishers']} publishers, {spec['clients']} clients, "
          f"{spec['seconds']:g} s, {spec['chains']} chains x {spec['chain_len']} hashes per publisher, "
          f"{os.cpu_count()} cores")
    print(f"{'measure':<{w}}  " + "  ".join(f"{r['store']:>{c}}" for r, c in zip(results, cw)))
    print(f"{'-' * w}  " + "  ".join("-" * c for c in cw))
    for (name, _), row in zip(rows, cells):
        print(f"{name:<{w}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(row, cw)))
    for r in results:
        for ex in r["examples"]:
            print(f"  {r['store']} violation: {ex}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="soak duration per store (default 60)")
    ap.add_argument("--store", choices=["memory", "redis", "both"], default="both")
    ap.add_argument("--publishers", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--chains", type=int, default=32, help="chains per publisher")
    ap.add_argument("--chain-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.chains * args.chain_len >= 16_384:
        ap.error("--chains x --chain-len must stay below one resync chunk (16384): a longer snapshot is not atomic")
    spec = SoakSpec(seconds=args.seconds, publishers=args.publishers, clients=args.clients, chains=args.chains,
                    chain_len=args.chain_len, seed=args.seed)
    stores = ["memory", "redis"] if args.store == "both" else [args.store]
    results = []
    for store in stores:
        print(f"soak on {store} for {args.seconds:g} s ...", file=sys.stderr)
        results.append(run_soak(store, spec))
    print_table(results)
    if args.json:
        print()
        write_result(args.json, "registry_soak", args=vars(args), stores=results)
    return 1 if any(r["violations"] or not r["registry_alive"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
