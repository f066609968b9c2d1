"""What only the Redis stores must show: round trips, scripts, sweeping keys, statelessness, outages.

The behaviour every backend shares is in ``test_registry_store.py``.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import redis
from redis.connection import AbstractConnection

from remote_g2.errors import ConfigError, StoreUnavailable
from remote_g2.protocol.messages import BlockEvent, Events, Heartbeat, LayoutFingerprint, RegisterWorker, Resync
from remote_g2.registry.stores.factory import open_store
from remote_g2.registry.stores.memory import MemoryStore
from remote_g2.registry.stores.redis_store import RedisClusterStore, RedisStore

FP = LayoutFingerprint(model_id="m", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=4, num_kv_heads=8, head_dim=64, tp_size=2)
CHAIN = [i.to_bytes(32, "big") for i in range(1, 129)]

BACKENDS = [pytest.param("redis", marks=pytest.mark.redis), pytest.param("redis-cluster", marks=pytest.mark.cluster)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> tuple[str, list[redis.Redis]]:
    """(store kind, a raw client per master), on an emptied server or cluster."""
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        return url, [redis.Redis.from_url(url)]
    url = request.getfixturevalue("redis_cluster_url")
    return url, [redis.Redis(host=h, port=p) for h, p in request.getfixturevalue("redis_cluster_masters")]


def make(url_and_nodes: tuple[str, list[redis.Redis]], **options: object) -> RedisStore:
    url, nodes = url_and_nodes
    cls = RedisStore if len(nodes) == 1 else RedisClusterStore
    return cls(url, **{"lease_ttl_ms": 10_000, **options})  # type: ignore[arg-type]


def register(store: RedisStore, wid: str, epoch: int = 1) -> None:
    store.register_worker(RegisterWorker(wid, f"tcp://127.0.0.1:1{wid[-1]}00", FP, epoch))


def events(store: RedisStore, wid: str, seq: int, *evs: BlockEvent, epoch: int = 1) -> None:
    assert store.apply_events(Events(wid, epoch, seq, list(evs))).status == "ok"


def stored(hashes: list[bytes]) -> BlockEvent:
    return BlockEvent("stored", hashes)


def command_calls(nodes: list[redis.Redis], name: str) -> list[int]:
    return [n.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0) for n in nodes]


@contextmanager
def client_sends() -> Iterator[Counter[int]]:
    """Count the requests (round trips) redis-py sends, by server port, inside the block."""
    sends: Counter[int] = Counter()
    original = AbstractConnection.send_packed_command

    def counting(self: AbstractConnection, command: object, check_health: bool = True) -> None:
        sends[self.port] += 1  # type: ignore[attr-defined]
        return original(self, command, check_health)

    AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        yield sends
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def all_keys(nodes: list[redis.Redis]) -> list[bytes]:
    return sorted(k for n in nodes for k in n.scan_iter(count=1000))


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.redis
def test_single_node_lookup_is_one_evalsha(redis_url: str) -> None:
    store = RedisStore(redis_url)
    node = redis.Redis.from_url(redis_url)
    for w in range(3):
        register(store, f"w{w}")
        events(store, f"w{w}", 1, stored(CHAIN[: 40 * (w + 1)]))
    register(store, "me")
    store.lookup(CHAIN)  # warm: loads the script
    before = command_calls([node], "evalsha")[0]
    with client_sends() as sends:
        r = store.lookup(CHAIN, requester="me", want_all_holders=True, tie_breaker=7)
    assert (r.reason, r.matched, r.best.worker_id, len(r.holders)) == ("ok", 120, "w2", 3)
    assert sum(sends.values()) == 1
    assert command_calls([node], "evalsha")[0] - before == 1
    store.close()


@pytest.mark.redis
def test_single_node_event_batch_is_one_evalsha(redis_url: str) -> None:
    store = RedisStore(redis_url)
    register(store, "w1")
    events(store, "w1", 1, stored(CHAIN[:1]))
    with client_sends() as sends:
        events(store, "w1", 2, stored(CHAIN[:100]), BlockEvent("removed", CHAIN[50:60]), BlockEvent("cleared"),
               stored(CHAIN[:3]))
    assert sum(sends.values()) == 1
    assert store.worker_info("w1").blocks == 3
    store.close()


@pytest.mark.cluster
def test_cluster_lookup_makes_at_most_one_call_per_node(redis_cluster_url: str,
                                                         redis_cluster_masters: list[tuple[str, int]]) -> None:
    store = RedisClusterStore(redis_cluster_url)
    nodes = [redis.Redis(host=h, port=p) for h, p in redis_cluster_masters]
    for w in range(3):
        register(store, f"w{w}")
        events(store, f"w{w}", 1, stored(CHAIN[: 40 * (w + 1)]))
    store.lookup(CHAIN)  # warm: loads the scripts on every node
    before = command_calls(nodes, "evalsha")
    with client_sends() as sends:
        r = store.lookup(CHAIN, want_all_holders=True)
    after = command_calls(nodes, "evalsha")
    assert (r.matched, [h.matched for h in r.holders]) == (120, [120, 80, 40])
    assert set(sends.values()) == {1} and len(sends) == 3  # 128 keys land on every node
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]
    store.close()


# -- scripts -----------------------------------------------------------------------------------------


def test_scripts_are_loaded_once_and_reloaded_after_script_flush(backend: tuple[str, list[redis.Redis]]) -> None:
    _, nodes = backend
    store = make(backend)

    def workload(epoch: int) -> None:
        register(store, "w1", epoch)
        events(store, "w1", 1, stored(CHAIN[:64]), BlockEvent("removed", CHAIN[:1]), epoch=epoch)
        assert store.heartbeat(Heartbeat("w1", epoch)).status == "ok"
        assert store.resync(Resync("w1", epoch, 2, CHAIN[:10], first=True, last=True)).stored == 10
        assert store.lookup(CHAIN[:10], want_all_holders=True).matched == 10
        assert store.who_has(CHAIN[:2]) == [["w1"], ["w1"]]
        assert store.worker_info("w1").blocks == 10
        store.counts()
        store.sweep()

    workload(1)
    loads = sum(command_calls(nodes, "script|load"))
    assert loads > 0
    workload(2)
    assert sum(command_calls(nodes, "script|load")) == loads  # warm: no more loading
    for n in nodes:
        n.script_flush()
    workload(3)  # NOSCRIPT → loaded again, transparently
    assert sum(command_calls(nodes, "script|load")) > loads
    store.close()


# -- sweeping ------------------------------------------------------------------------------------------


def test_sweep_deletes_every_key_of_retired_incarnations(backend: tuple[str, list[redis.Redis]]) -> None:
    _, nodes = backend
    store = make(backend, lease_ttl_ms=1_500, sweep_grace_ms=0)
    register(store, "w1", epoch=1)
    events(store, "w1", 1, stored(CHAIN[:100]))
    register(store, "w1", epoch=2)  # supersedes epoch 1
    events(store, "w1", 1, stored(CHAIN[100:110]), epoch=2)
    register(store, "w2")
    events(store, "w2", 1, stored(CHAIN[:50]), BlockEvent("cleared"), stored(CHAIN[110:115]))
    register(store, "w3")  # will lapse
    t3 = time.monotonic()  # w3's lease runs out by t3 + 1.5 s, whatever the set-up cost on a busy machine
    assert store.heartbeat(Heartbeat("w1", 2)).status == "ok"  # and w1, w2 stay live past t3 + 0.8 s
    assert store.heartbeat(Heartbeat("w2", 1)).status == "ok"
    events(store, "w3", 1, stored(CHAIN[:40]))
    register(store, "w4")  # drained
    events(store, "w4", 1, stored(CHAIN[60:90]))
    assert store.drain_worker("w4").removed_blocks == 30
    time.sleep(max(0.0, 0.8 - (time.monotonic() - t3)))
    assert store.heartbeat(Heartbeat("w1", 2)).status == "ok"  # live until >= t3 + 2.3 s
    assert store.heartbeat(Heartbeat("w2", 1)).status == "ok"
    time.sleep(max(0.0, 1.6 - (time.monotonic() - t3)))
    assert store.counts() == (2, 3, 100 + 10 + 50 + 5 + 40 + 30)  # w3 dead but not yet swept

    removed = 0
    for _ in range(10):
        n = store.sweep()
        removed += n
        if n == 0 and removed:
            break
    assert removed == 4  # w1 epoch 1, w2 before its clear, w3, w4
    assert store.counts() == (2, 2, 15)
    keys = all_keys(nodes)
    block_keys = [k for k in keys if k.startswith(b"rg2:b:")]
    assert sorted(block_keys) == sorted(b"rg2:b:" + h for h in CHAIN[100:115])
    assert len([k for k in keys if k.startswith(b"rg2:wb:")]) == 2
    assert sorted(k for k in keys if k.startswith(b"rg2:{m}:") and b":i:" not in k) == [
        b"rg2:{m}:ctr", b"rg2:{m}:lease", b"rg2:{m}:topo", b"rg2:{m}:workers"]  # the sweep queue is empty, so gone
    assert len([k for k in keys if b"{m}:i:" in k]) == 2
    assert len(keys) == 15 + 2 + 4 + 2
    assert store.lookup(CHAIN[100:115], want_all_holders=True).holders[0].matched == 10
    store.close()


@pytest.mark.redis
def test_sweep_is_bounded_per_call_and_resumes(redis_url: str) -> None:
    store = RedisStore(redis_url, sweep_max_keys=300)
    node = redis.Redis.from_url(redis_url)
    many = [i.to_bytes(8, "big") for i in range(1000)]
    register(store, "w1")
    events(store, "w1", 1, stored(many))
    store.drain_worker("w1")
    sizes = []
    while store.sweep() == 0:
        sizes.append(node.dbsize())
        assert len(sizes) < 10
    assert len(sizes) == 3 and sizes == sorted(sizes, reverse=True)  # 300 block sets per call
    assert node.dbsize() == 2  # only the id counter and the topology the sweeper recorded are left
    store.close()


def test_two_sweepers_at_once_remove_each_incarnation_once(backend: tuple[str, list[redis.Redis]]) -> None:
    _, nodes = backend
    a, b = make(backend, sweep_grace_ms=0, sweep_max_keys=500), make(backend, sweep_grace_ms=0, sweep_max_keys=500)
    many = [i.to_bytes(8, "big") for i in range(3000)]
    for w in range(4):
        register(a, f"w{w}")
        events(a, f"w{w}", 1, stored(many[w * 500:w * 500 + 1000]))
        a.drain_worker(f"w{w}")
    removed = []

    def sweeper(store: RedisStore) -> None:
        for _ in range(40):
            removed.append(store.sweep())

    threads = [threading.Thread(target=sweeper, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(removed) == 4
    assert all_keys(nodes) == [b"rg2:{m}:ctr", b"rg2:{m}:topo"]
    a.close()
    b.close()


@pytest.mark.cluster
def test_cluster_waits_a_grace_period_before_sweeping_retired_blocks(redis_cluster_url: str) -> None:
    store = RedisClusterStore(redis_cluster_url, sweep_grace_ms=400)
    register(store, "w1")
    events(store, "w1", 1, stored(CHAIN[:20]))
    store.drain_worker("w1")
    assert store.sweep() == 0 and store.counts()[2] == 20  # a batch validated before the drain may still write
    time.sleep(0.5)
    assert store.sweep() == 1 and store.counts() == (0, 0, 0)
    store.close()


# -- statelessness -----------------------------------------------------------------------------------


def test_two_store_objects_give_the_same_answers(backend: tuple[str, list[redis.Redis]]) -> None:
    a, b = make(backend), make(backend)
    for w in ("w1", "w2", "w3"):
        register(a, w)
        events(a, w, 1, stored(CHAIN[:8]))
    events(b, "w1", 2, stored(CHAIN[8:12]))  # the sequence lives in Redis, not in the store object
    assert a.apply_events(Events("w1", 1, 2, [stored(CHAIN[:1])])).status == "resync_needed"
    for tb in range(4):
        ra, rb = a.lookup(CHAIN[:12], tie_breaker=tb), b.lookup(CHAIN[:12], tie_breaker=tb)
        assert ra == rb and ra.best.worker_id == "w1"
        ra, rb = a.lookup(CHAIN[:8], tie_breaker=tb), b.lookup(CHAIN[:8], tie_breaker=tb)
        assert ra == rb
    assert b.heartbeat(Heartbeat("w2", 1, load=3)).status == "ok"
    assert a.worker_info("w2").load == 3
    assert [w.worker_id for w in a.list_workers()] == [w.worker_id for w in b.list_workers()]
    assert a.counts() == b.counts() == (3, 3, 28)
    a.close()
    b.close()


# -- outages ------------------------------------------------------------------------------------------


@pytest.mark.redis
def test_unreachable_redis_raises_store_unavailable_and_the_store_recovers(
        spawn_redis: Callable[..., tuple[subprocess.Popen[bytes], str]]) -> None:
    proc, url = spawn_redis()
    store = RedisStore(url, socket_timeout_s=1.0)
    register(store, "w1")
    events(store, "w1", 1, stored(CHAIN[:5]))
    port = url.rsplit(":", 1)[1].split("/")[0]
    proc.kill()  # by PID, without a goodbye
    proc.wait()
    calls: list[Callable[[], object]] = [
        lambda: store.lookup(CHAIN[:5]), lambda: register(store, "w2"), lambda: store.heartbeat(Heartbeat("w1", 1)),
        lambda: store.apply_events(Events("w1", 1, 2, [stored(CHAIN[:1])])), store.counts, store.sweep,
        store.ping, lambda: store.who_has(CHAIN[:1]), store.list_workers, lambda: store.drain_worker("w1")]
    for call in calls:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match=f"redis at 127.0.0.1:{port} unreachable"):
            call()
        assert time.monotonic() - t0 < 5
    spawn_redis(int(port))  # back, empty (no persistence)
    assert store.lookup(CHAIN[:5]).reason == "no_candidate"
    register(store, "w1")
    events(store, "w1", 1, stored(CHAIN[:5]))
    assert store.lookup(CHAIN[:5]).matched == 5
    store.close()


def test_unreachable_cluster_raises_store_unavailable() -> None:
    store = RedisClusterStore("redis://127.0.0.1:1", socket_timeout_s=0.5)  # nothing connects yet
    for call in (lambda: register(store, "w1"), lambda: store.lookup(CHAIN[:3]), store.sweep):
        with pytest.raises(StoreUnavailable, match="redis at 127.0.0.1:1 unreachable"):
            call()
    store.close()


@pytest.mark.cluster
def test_cluster_follows_moved_slots(redis_cluster_url: str, redis_cluster_masters: list[tuple[str, int]]) -> None:
    store = RedisClusterStore(redis_cluster_url)
    for w in ("w1", "w2"):
        register(store, w)
        events(store, w, 1, stored(CHAIN[:30]))
    assert store.lookup(CHAIN[:30]).matched == 30  # the store now holds a slot table
    for key in (b"rg2:b:" + CHAIN[0], b"rg2:{m}:lease"):  # a block's slot, then the meta slot
        move_slot(redis_cluster_masters, redis.crc.key_slot(key))
        assert store.lookup(CHAIN[:30], want_all_holders=True).holders[1].matched == 30
        register(store, "w3")
        assert store.heartbeat(Heartbeat("w1", 1)).status == "ok"
    events(store, "w1", 2, BlockEvent("removed", CHAIN[:1]))
    assert store.who_has(CHAIN[:2]) == [["w2"], ["w1", "w2"]]
    store.close()


def move_slot(masters: list[tuple[str, int]], slot: int) -> None:
    """Migrate one slot, keys and all, to the next master (what a resharding does)."""
    nodes = [redis.Redis(host=h, port=p) for h, p in masters]
    ids = [n.execute_command("CLUSTER MYID").decode() for n in nodes]
    table = nodes[0].execute_command("CLUSTER NODES")  # parsed by redis-py
    owner_id = next(info["node_id"] for info in table.values()
                    if any(int(r[0]) <= slot <= int(r[-1]) for r in info["slots"]))
    src = ids.index(owner_id)
    dst = (src + 1) % len(nodes)
    nodes[dst].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[src])
    nodes[src].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[dst])
    keys = nodes[src].execute_command("CLUSTER GETKEYSINSLOT", slot, 10_000)
    if keys:
        nodes[src].execute_command("MIGRATE", *masters[dst], "", 0, 5000, "KEYS", *keys)
    for n in nodes:
        n.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[dst])


# -- factory --------------------------------------------------------------------------------------------


def test_open_store_picks_the_backend_by_url() -> None:
    assert isinstance(open_store(), MemoryStore)
    assert isinstance(open_store(redis_url="redis://127.0.0.1:1/0"), RedisStore)
    assert isinstance(open_store(redis_cluster_url="redis://127.0.0.1:1"), RedisClusterStore)
    assert open_store(redis_url="redis://127.0.0.1:1/0", key_prefix="x:").name == "redis"
    with pytest.raises(ConfigError):
        open_store(redis_url="redis://a", redis_cluster_url="redis://b")
    with pytest.raises(ConfigError):
        open_store(key_prefix="x:")
    with pytest.raises(ValueError):
        RedisStore("redis://127.0.0.1:1/0", key_prefix="{x}:")


def test_a_server_records_the_topology_before_it_answers_so_the_first_sweep_resyncs_nobody(
        backend: tuple[str, list[redis.Redis]]) -> None:
    # A worker registered before any topology was recorded is "filled under another topology" once
    # the first one is: recording it in prepare() (RegistryServer.start) spares every worker that resync.
    store = make(backend)
    for node in backend[1]:
        assert not any(b":topo" in k for k in node.keys()), "the store starts with no topology recorded"
    store.prepare()
    register(store, "w1")
    events(store, "w1", 1, stored(CHAIN[:8]))
    store.sweep()  # records the topology again: unchanged
    assert store.heartbeat(Heartbeat("w1", 1, 0)).status == "ok"
    events(store, "w1", 2, stored(CHAIN[8:16]))
    assert store.lookup(CHAIN[:16]).matched == 16


def test_a_worker_registered_before_the_first_recorded_topology_is_asked_to_resync(
        backend: tuple[str, list[redis.Redis]]) -> None:
    # The counterpart: without prepare(), the first record makes the earlier registration stale.
    store = make(backend)
    register(store, "w1")
    store.sweep()
    assert store.heartbeat(Heartbeat("w1", 1, 0)).status == "resync_needed"


def test_a_record_stored_before_kinds_were_reads_as_a_source(backend) -> None:
    """A registry upgraded in place finds records with no ``kind`` field: they were all sources' records."""
    store = make(backend)
    register(store, "w1")
    found = 0
    for node in backend[1]:
        for key in node.scan_iter(match="*i:*", count=1000):
            if node.type(key) == b"hash" and node.hget(key, "wid") == b"w1":
                assert node.hget(key, "kind") == b"source"
                found += node.hdel(key, "kind")
    assert found == 1
    assert store.worker_info("w1").kind is None and [w.kind for w in store.list_workers()] == [None]
    store.close()


def test_an_audit_that_scanned_a_set_a_sweeper_then_removed_queues_nothing(backend) -> None:
    """The audit scans ``wb`` sets, then asks the meta slot which are unknown. A set another sweeper emptied and
    unqueued in between is not an orphan: queued again, it would be swept (and counted) twice."""
    store = make(backend, sweep_grace_ms=0)
    register(store, "w1")
    events(store, "w1", 1, stored(CHAIN[:8]))
    store.drain_worker("w1")
    space = store.space
    wb_prefix = space.keys.header[2] + b"{"
    scanned = {name: [k[len(wb_prefix):-1] for k in client.scan_iter(match=wb_prefix + b"*")]
               for name, client in space.nodes.clients().items()}
    assert sum(map(len, scanned.values())) == 1  # the drained incarnation's set, as an audit's scan saw it
    assert store.sweep() == 1  # a sweeper empties it and takes it off the queue
    for name, client in space.nodes.clients().items():
        if scanned[name]:  # the audit goes on with what it scanned: unknown to the meta slot now, yet no orphan
            assert space.meta("orphans", b"0", *scanned[name]) == scanned[name]
            assert store._sweeps._queue_orphans(client, wb_prefix, scanned[name]) == 0
    assert store.sweep() == 0
    store.close()
