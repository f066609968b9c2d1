"""The Redis Cluster registry after its meta slot lost writes: no id repeats, no wrong answer, leftovers swept.

Real processes: a private 3-master Redis Cluster for the test. The master
that holds the meta slot (``rg2:{m}:*``: the incarnation counter, leases,
worker records) is SIGKILLed and started again empty on its port — no
persistence, so the node keeps its slots (``nodes.conf``) and loses every
key, as a master restarted without persistence does, and as a replica
promoted before it had the last writes does for those writes. The block
sets on the other two masters still name the incarnations of before.

What must hold: a worker registered after the loss never inherits those
block sets (its incarnation id is new although the counter started over,
``fresh_inc`` in ``registry/stores/lua/_lib.lua``), so no lookup names it for a
block it never stored; workers that re-register and resync (as their
publishers do on ``unknown_worker``) are found again; and the sweeper's
audit deletes every leftover membership and ``wb`` set of the forgotten
incarnations, so the block sets end up naming live incarnations only.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from conftest import _need_redis_binaries, cluster_node_args, start_redis, start_redis_cluster, stop_redis, \
    wait_cluster_ok

from remote_g2.protocol.messages import BlockEvent, Events, LayoutFingerprint, RegisterWorker, Resync
from remote_g2.registry.stores.redis_store import RedisClusterStore

pytestmark = pytest.mark.cluster

FP = LayoutFingerprint(model_id="m", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=4, num_kv_heads=8, head_dim=64, tp_size=1)
WORKERS = 6
CHAIN = 40


def chain(worker: int) -> list[bytes]:
    """Worker ``worker``'s blocks: its own hashes, spread over every node's slots."""
    return [(worker << 32 | i).to_bytes(16, "big") for i in range(CHAIN)]


def register_and_store(store: RedisClusterStore, wid: str, hashes: list[bytes], epoch: int) -> None:
    store.register_worker(RegisterWorker(wid, f"tcp://127.0.0.1:{20000 + epoch}", FP, epoch))
    assert store.apply_events(Events(wid, epoch, 1, [BlockEvent("stored", hashes)])).status == "ok"


def answers(store: RedisClusterStore, who: dict[str, list[bytes]]) -> list[tuple[str, str | None, int]]:
    """For every worker's chain: (worker, the holder a lookup names, how many blocks it says it holds)."""
    out = []
    for wid, hashes in who.items():
        r = store.lookup(hashes)
        out.append((wid, r.best.worker_id if r.best else None, r.matched))
    return out


def memberships(ports: list[int]) -> set[bytes]:
    """Every incarnation id any block set on any master names."""
    out: set[bytes] = set()
    for port in ports:
        with redis.Redis(port=port) as c:
            for key in c.scan_iter(match=b"rg2:b:*", count=1000):
                out |= c.smembers(key)
    return out


def wb_sets(ports: list[int]) -> set[bytes]:
    out: set[bytes] = set()
    for port in ports:
        with redis.Redis(port=port) as c:
            out |= set(c.scan_iter(match=b"rg2:wb:*", count=1000))
    return out


def test_a_meta_slot_restarted_empty_gives_no_wrong_answer_and_its_leftovers_are_swept(tmp_path: Path) -> None:
    _need_redis_binaries("redis-server", "redis-cli")
    procs, url = start_redis_cluster(tmp_path)
    store = RedisClusterStore(url, lease_ttl_ms=60_000, sweep_grace_ms=0)
    try:
        ports = sorted(int(str(p.args[2])) for p in procs)
        before = {f"old{w}": chain(w) for w in range(WORKERS)}
        for wid, hashes in before.items():
            register_and_store(store, wid, hashes, epoch=1)
        assert answers(store, before) == [(wid, wid, CHAIN) for wid in before]
        old_ids = memberships(ports)
        assert len(old_ids) == WORKERS

        meta_name, _ = store.space.nodes.node(b"rg2:{m}:lease")
        meta_port = int(meta_name.rsplit(":", 1)[1])
        (meta_proc,) = [p for p in procs if int(str(p.args[2])) == meta_port]
        meta_proc.kill()  # SIGKILL: nothing saved, nothing handed over
        meta_proc.wait(5)
        procs.remove(meta_proc)
        procs.append(start_redis(meta_port, tmp_path, *cluster_node_args(tmp_path, meta_port)))
        wait_cluster_ok(ports)
        deadline = time.monotonic() + 20
        while True:  # the store finds the node again by itself (a failed call refreshes its slot table)
            try:
                store.ping()
                break
            except Exception:
                assert time.monotonic() < deadline, "the store never reached the restarted meta node"
                time.sleep(0.1)

        # The registry forgot everyone: nobody is named for the old chains (their block sets remain).
        assert answers(store, before) == [(wid, None, 0) for wid in before]
        # New workers register from a counter that started over, and store blocks of their own. None may
        # inherit an old incarnation's block sets: no lookup of an old chain names a new worker.
        after = {f"new{w}": chain(100 + w) for w in range(WORKERS)}
        for wid, hashes in after.items():
            register_and_store(store, wid, hashes, epoch=2)
        assert answers(store, after) == [(wid, wid, CHAIN) for wid in after]
        assert answers(store, before) == [(wid, None, 0) for wid in before]
        new_ids = memberships(ports) - old_ids
        assert len(new_ids) == WORKERS and not new_ids & old_ids

        # The old workers come back as their publishers would (unknown_worker -> register, resync).
        for wid, hashes in before.items():
            store.register_worker(RegisterWorker(wid, "tcp://127.0.0.1:20003", FP, 3))
            assert store.resync(Resync(wid, 3, 1, hashes, True, True)).status == "ok"
        everyone = {**before, **after}
        assert answers(store, everyone) == [(wid, wid, CHAIN) for wid in everyone]

        # The audit finds the forgotten incarnations' leftovers; the sweeper deletes them.
        for _ in range(20):
            store.sweep()
            if not memberships(ports) & old_ids:
                break
        live = memberships(ports)
        assert not live & old_ids, "memberships of forgotten incarnations were never swept"
        assert len(live) == 2 * WORKERS
        assert not {w for w in wb_sets(ports) if w[len(b"rg2:wb:{"):-1] in old_ids}
        assert answers(store, everyone) == [(wid, wid, CHAIN) for wid in everyone]
    finally:
        store.close()
        for proc in procs:
            stop_redis(proc)
