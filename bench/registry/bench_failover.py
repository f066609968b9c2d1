"""How long a worker takes to leave a registry server that dies (SIGKILL) or hangs (SIGSTOP).

Each round: a private ``redis-server`` (one for the run), two ``remote-g2
serve`` in front of it, and in this process a :class:`SourcePublisher`
streaming a block every ~2 ms, a lookup :class:`RegistryClient` and a
:class:`RegistryMirror`, all given both servers (first one first) and the
default 5 s RPC timeout. The first server is sent the fault; then, from
that moment:

* ``lookup``: the first lookup's round trip (it must move to the second server);
* ``publish``: until a prefix stored right after the fault is in the store
  (looked up through the second server);
* ``mirror``: until the mirror answers that prefix from its copy.

At the end of each round every block streamed is checked in the store and
the mirror (``lost`` counts rounds where some were not). The table gives
p50 and max per fault and part; ``--json`` writes every round.

    python -m bench.registry.bench_failover --rounds 5 --json bench/results/failover.json
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from bench import common
from remote_g2.rpc.connection_watch import DEFAULT_HEARTBEAT_S
from remote_g2.errors import MirrorNotReady
from remote_g2.protocol.messages import LayoutFingerprint
from remote_g2.registry import RegistryClient, RegistryMirror, SourcePublisher

FP = LayoutFingerprint(model_id="bench-failover", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=2, num_kv_heads=4, head_dim=32, tp_size=1)
PARTS = ("lookup", "publish", "mirror")


def _right(reply: Any, worker: str, chain: list[bytes]) -> bool:
    return reply.best is not None and reply.best.worker_id == worker and reply.matched == len(chain)


def _mirror_holds(mirror: RegistryMirror, worker: str, chain: list[bytes]) -> bool:
    try:
        return _right(mirror.lookup(chain, compat_key=FP.compat_key()), worker, chain)
    except MirrorNotReady:
        return False


def one_round(redis_url: str, fault: signal.Signals, index: int, logdir: str) -> dict[str, Any]:
    """Two servers, one fault; the seconds each part took to answer through the second server."""
    servers = [common.start_registry("--redis-url", redis_url, lease_ttl_s=30,
                                            log_path=os.path.join(logdir, f"serve-{index}-{i}.log")) for i in range(2)]
    endpoints = ",".join(ep for _, ep in servers)
    worker = f"bench-{index}"
    grow = [(index << 40 | i + 1).to_bytes(8, "big") for i in range(20_000)]
    grown = [0]
    lock = threading.Lock()

    def snapshot() -> list[bytes]:
        with lock:
            return grow[:grown[0]]

    client = RegistryClient(endpoints)
    pub = SourcePublisher(client, worker_id=worker, endpoint="tcp://127.0.0.1:31997", fingerprint=FP,
                          snapshot=snapshot, flush_interval_s=0.01).start()
    lookups = RegistryClient(endpoints)
    mirror = RegistryMirror(endpoints).start()
    stop = threading.Event()

    def add(n: int) -> list[bytes]:
        with lock:
            parent = grow[grown[0] - 1] if grown[0] else None
            pub.stored(grow[grown[0]:grown[0] + n], parent=parent)
            grown[0] += n
            return grow[:grown[0]]

    def stream() -> None:
        while not stop.wait(0.002) and grown[0] < len(grow) - 100:
            add(1)

    streamer = threading.Thread(target=stream, daemon=True)
    try:
        first = add(16)
        if not (pub.flush(10) and mirror.wait_ready(10)):
            raise RuntimeError("publisher or mirror never ready")
        deadline = time.monotonic() + 10
        while not _mirror_holds(mirror, worker, first):
            if time.monotonic() > deadline:
                raise RuntimeError("the mirror never held the first blocks")
            time.sleep(0.01)
        streamer.start()
        time.sleep(0.3)
        os.kill(servers[0][0].pid, fault)
        t0 = time.monotonic()
        chain = add(4)
        times: dict[str, float] = {}
        lookups.lookup(first)
        times["lookup"] = time.monotonic() - t0
        while len(times) < 3 and time.monotonic() - t0 < 20:
            if "publish" not in times and client.failovers and _right(lookups.lookup(chain), worker, chain):
                times["publish"] = time.monotonic() - t0
            if "mirror" not in times and _mirror_holds(mirror, worker, chain):
                times["mirror"] = time.monotonic() - t0
            time.sleep(0.005)
        stop.set()
        streamer.join(5)
        whole = snapshot()
        lost = not (pub.flush(10) and _right(lookups.lookup(whole), worker, whole))
        deadline = time.monotonic() + 10
        while not lost and not _mirror_holds(mirror, worker, whole):
            if time.monotonic() > deadline:
                lost = True
            time.sleep(0.02)
        return {"fault": fault.name, "round": index, **{k: times.get(k) for k in PARTS}, "lost": lost,
                "blocks": len(whole), "mirror_resyncs": mirror.stats().resyncs}
    finally:
        stop.set()
        mirror.close()
        lookups.close()
        pub.close(flush_timeout_s=1)
        client.close()
        for proc, _ in servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
            common.stop(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write every round and the summary here")
    a = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        redis_proc, redis_url = common.start_redis(tmp)
        try:
            for fault in (signal.SIGKILL, signal.SIGSTOP):
                for r in range(a.rounds):
                    rows.append(one_round(redis_url, fault, len(rows) + 1, tmp))
        finally:
            common.stop(redis_proc)
    heartbeat = float(os.environ.get("REMOTE_G2_REGISTRY_HEARTBEAT_S") or DEFAULT_HEARTBEAT_S)
    summary = []
    print(f"registry failover, {a.rounds} rounds per fault, heartbeat {heartbeat:g} s, RPC timeout 5 s")
    print(f"{'fault':8} {'part':8} {'p50_ms':>8} {'max_ms':>8} {'lost':>5}")
    for fault in ("SIGKILL", "SIGSTOP"):
        mine = [r for r in rows if r["fault"] == fault]
        for part in PARTS:
            vals = [r[part] for r in mine if r[part] is not None]
            p50 = statistics.median(vals) * 1000 if vals else float("nan")
            mx = max(vals) * 1000 if vals else float("nan")
            lost = sum(r["lost"] for r in mine) + sum(r[part] is None for r in mine)
            summary.append({"fault": fault, "part": part, "p50_ms": p50, "max_ms": mx, "lost_rounds": lost})
            print(f"{fault:8} {part:8} {p50:8.0f} {mx:8.0f} {lost:5d}")
    if a.json:
        common.write_result(a.json, "failover", args=vars(a), heartbeat_s=heartbeat, rounds=rows, summary=summary)
    return 0 if not any(r["lost"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
