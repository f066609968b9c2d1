"""The readers of ``bench.registry.bench_fleet``'s fleet, each an OS process of its own.

* :func:`target_proc`: one target, paced Zipf-drawn lookups of its layout through a failover list (or its own
  registry mirror, ``--lookups mirror``), latencies and reasons per steady phase;
* :func:`follower_proc`: ``--followers`` raw SUB sockets on every server's change feed, counting frames, bytes
  and gaps per steady phase;
* :func:`mirror_proc`: the layout-0 registry mirror, reporting its state until the run stops it.

Each reports on the run's queue as ``(kind, value)`` and follows the phase controls of
:func:`~bench.registry.fleet_workers.phase_ctl`.
"""

from __future__ import annotations

import random
import time
from typing import Any

from bench.registry.fleet_workers import PHASES, Catalogue, fingerprint

LOOKUP_TAIL = 4  # a request's own new blocks after the cached prefix: never stored anywhere


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
