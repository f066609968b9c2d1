"""Registry faults with real processes: Redis restarted under load, the registry server restarted, clock jumps.

* Redis SIGKILLed under load and restarted empty on its port: while it is down
  every lookup is answered ``ERR StoreUnavailable`` (the server itself keeps
  answering); once it is back the same server process serves again, the
  publishers find out they are unknown, register anew and resync, and every
  lookup names the right holder with the right count — nobody intervenes.
* The registry server (embedded memory store) SIGKILLed and a new, empty one
  started on the same port: the publishers' blocks come back by themselves.
* Leases kept on one machine (a source rank's :class:`LeaseTable`, the source
  service's resolve/renew, the memory store's worker leases) follow the
  monotonic clock: a wall-clock jump of hours either way neither expires nor
  extends one. (The Redis store's leases use Redis ``TIME``, i.e. the Redis
  host's clock; that is not local and not covered here.)

Every wait is bounded in time; every process is stopped by its PID.
"""

from __future__ import annotations

import os
import random
import selectors
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import _need_redis_binaries, free_port, start_redis, start_redis_cluster, stop_redis
from source_procs.pattern import block_bytes_for, hash_of, make_layout

from remote_g2.adapters.host_pool import HostPool
from remote_g2.errors import RpcTimeout, StoreUnavailable
from remote_g2.protocol.messages import BlockEvent, Events, LayoutFingerprint, RegisterWorker, Renew, Resolve
from remote_g2.registry import MemoryStore, RegistryClient, SourcePublisher
from remote_g2.rpc.client import RpcClient
from remote_g2.source import SourceConfig, start_source_service
from remote_g2.source import service as service_mod
from remote_g2.source.leases import LeaseTable

FP = LayoutFingerprint(model_id="faults", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=2, num_kv_heads=4, head_dim=32, tp_size=1)
CHAINS = 4          # static chains per source, stored before the fault and never changed
CHAIN_LEN = 16
GROW_MAX = 10_000   # most hashes a source's load thread adds to its growing chain (20 s of load)
HOURS = 6 * 3600.0


# -- processes --------------------------------------------------------------------------------------------


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started; each still running at teardown is stopped by its PID."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        stop_redis(proc)  # any server we started, by its PID


def serve(procs: list[subprocess.Popen[bytes]], log: Path, port: int, *args: str) -> subprocess.Popen[bytes]:
    """``remote-g2 serve --bind tcp://127.0.0.1:PORT ARGS``; returns once it serves.

    Retried for up to 10 s while the port is still held (a SIGKILLed server's
    sockets take a moment to go).
    """
    exe = Path(sys.executable).parent / "remote-g2"
    cmd = ([str(exe)] if exe.exists() else [sys.executable, "-m", "remote_g2.cli"]) + \
        ["serve", "--bind", f"tcp://127.0.0.1:{port}", *args]
    deadline = time.monotonic() + 10
    while True:
        with log.open("ab") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                    env={**os.environ, "REMOTE_G2_LOG_LEVEL": "INFO"})
        procs.append(proc)
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            line = proc.stdout.readline().decode() if sel.select(30) else ""
        if "serving on" in line:
            return proc
        proc.kill()
        proc.wait(10)
        if time.monotonic() > deadline:
            raise RuntimeError(f"registry did not start on port {port}: {line!r}; see {log}")
        time.sleep(0.2)


# -- sources: a publisher, its pool, and a thread that keeps adding blocks -------------------------------


class Source:
    """One worker's pool (static chains plus one growing chain) published by a :class:`SourcePublisher`."""

    def __init__(self, index: int, endpoint: str, *, timeout_s: float) -> None:
        self.index = index
        self.worker_id = f"src{index}"
        self.chains = [[(index + 1 << 40 | c << 20 | i + 1).to_bytes(8, "big") for i in range(CHAIN_LEN)]
                       for c in range(CHAINS)]
        self.grow = [(index + 1 << 40 | 0xFFFFF << 20 | i + 1).to_bytes(8, "big") for i in range(GROW_MAX)]
        self.grown = 0
        self._lock = threading.Lock()  # (pool change, enqueue) atomic against snapshot()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.client = RegistryClient(endpoint, timeout_s=timeout_s)
        self.pub = SourcePublisher(self.client, worker_id=self.worker_id, endpoint=f"tcp://127.0.0.1:{31000 + index}",
                                   fingerprint=FP, snapshot=self.snapshot, flush_interval_s=0.01)

    def snapshot(self) -> list[bytes]:
        with self._lock:
            return [h for chain in self.chains for h in chain] + self.grow[:self.grown]

    def start(self) -> Source:
        self.pub.start()
        with self._lock:
            for chain in self.chains:
                self.pub.stored(chain)
        return self

    def start_load(self) -> None:
        """Add one block to the growing chain every ~2 ms (bounded by GROW_MAX) until stop_load()."""
        def run() -> None:
            while not self._stop.wait(0.002) and self.grown < GROW_MAX:
                with self._lock:
                    parent = self.grow[self.grown - 1] if self.grown else None
                    self.pub.stored([self.grow[self.grown]], parent=parent)
                    self.grown += 1

        self._thread = threading.Thread(target=run, name=f"load-{self.worker_id}", daemon=True)
        self._thread.start()

    def stop_load(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def close(self) -> None:
        self.stop_load()
        self.pub.close(flush_timeout_s=1)
        self.client.close()


@pytest.fixture
def sources() -> Iterator[Callable[[str, float], list[Source]]]:
    made: list[Source] = []

    def make(endpoint: str, timeout_s: float) -> list[Source]:
        made.extend(Source(i, endpoint, timeout_s=timeout_s) for i in range(2))
        return made[-2:]

    yield make
    for src in made:
        src.close()


def wrong_answers(client: RegistryClient, srcs: list[Source], *, grown: bool = False) -> list[str]:
    """Every static chain (and with ``grown`` the growing one) looked up: what is not its source's, in full."""
    wrong = []
    for src in srcs:
        asks = [(chain, CHAIN_LEN) for chain in src.chains]
        if grown:
            asks.append((src.grow[:max(1, src.grown)], src.grown))
        for hashes, want in asks:
            r = client.lookup(hashes)
            got = (r.best.worker_id if r.best else None, r.matched)
            if got != (src.worker_id, want):
                wrong.append(f"{src.worker_id} chain {hashes[0].hex()}: {got}, want {(src.worker_id, want)}")
    return wrong


def wait_until_right(client: RegistryClient, srcs: list[Source], timeout_s: float, **kw: bool) -> float:
    """Seconds until every lookup is right; fails with the wrong answers after ``timeout_s``."""
    t0 = time.monotonic()
    wrong: list[str] = ["not asked yet"]
    while time.monotonic() - t0 < timeout_s:
        try:
            wrong = wrong_answers(client, srcs, **kw)
        except (StoreUnavailable, RpcTimeout) as e:
            wrong = [f"{type(e).__name__}: {e}"]
        if not wrong:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"lookups still wrong after {timeout_s} s: {wrong[:4]}")


def metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


# -- A1: Redis restarted under load ------------------------------------------------------------------------


@pytest.mark.redis
def test_redis_restart_under_load_fails_lookups_then_recovers_and_sources_resync(
        spawn_redis, processes, sources, tmp_path: Path) -> None:
    redis_proc, url = spawn_redis()
    redis_port = int(url.rsplit(":", 1)[1].split("/")[0])
    port, mport = free_port(), free_port()
    registry = serve(processes, tmp_path / "registry.log", port, "--redis-url", url, "--lease-ttl-s", "5",
                     "--metrics-port", str(mport))
    endpoint = f"tcp://127.0.0.1:{port}"
    srcs = [s.start() for s in sources(endpoint, 2.0)]
    client = RegistryClient(endpoint, timeout_s=5)
    try:
        assert all(s.pub.flush(10) for s in srcs)
        assert wrong_answers(client, srcs) == []
        for s in srcs:
            s.start_load()
        # Under load: every lookup of a static chain is right.
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            assert wrong_answers(client, srcs) == []
        assert all(s.grown > 50 for s in srcs)
        registrations = [s.pub.registrations for s in srcs]

        grown_at_kill = [s.grown for s in srcs]
        redis_proc.kill()  # SIGKILL: nothing is flushed, nothing said goodbye
        redis_proc.wait(5)
        down_answers = 0
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:  # the sources keep streaming meanwhile
            chain = random.choice(srcs).chains[down_answers % CHAINS]
            with pytest.raises(StoreUnavailable) as info:
                client.lookup(chain)
            assert info.value.remote == endpoint
            down_answers += 1
        assert down_answers >= 10
        assert client.ping().server == "registry"  # the server answers; only its store does not
        assert metric(mport, 'remote_g2_registry_errors_total{kind="store_unavailable"}') >= down_answers

        assert all(s.grown > g for s, g in zip(srcs, grown_at_kill))  # the load went on through the outage
        spawn_redis(redis_port)  # back, empty: nothing was persisted
        recovery_s = wait_until_right(client, srcs, 20)
        assert registry.poll() is None  # the same server process: it recovered by itself
        # Every source found out it was forgotten, registered anew and sent its snapshot.
        assert all(s.pub.registrations > r for s, r in zip(srcs, registrations))
        assert all(s.pub.resyncs >= 2 for s in srcs)
        for s in srcs:
            s.stop_load()
        assert all(s.pub.flush(10) for s in srcs)
        assert wrong_answers(client, srcs, grown=True) == []  # the growing chains are whole too
        print(f"\nredis restart: {down_answers} lookups answered StoreUnavailable while down; "
              f"right again {recovery_s:.2f} s after redis was back; grown {[s.grown for s in srcs]}")
    finally:
        client.close()


# -- A2: the registry server restarted ----------------------------------------------------------------------


def test_registry_restart_sources_register_and_resync_by_themselves(processes, sources, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "registry.log"
    first = serve(processes, log, port, "--lease-ttl-s", "3")
    endpoint = f"tcp://127.0.0.1:{port}"
    srcs = [s.start() for s in sources(endpoint, 0.5)]
    client = RegistryClient(endpoint, timeout_s=0.5)
    try:
        assert all(s.pub.flush(10) for s in srcs)
        assert wrong_answers(client, srcs) == []
        for s in srcs:
            s.start_load()
        time.sleep(0.5)
        registrations = [s.pub.registrations for s in srcs]

        first.kill()  # SIGKILL: the memory store dies with it
        first.wait(5)
        with pytest.raises(RpcTimeout, match="lookup"):
            client.lookup(srcs[0].chains[0])
        grown_at_kill = [s.grown for s in srcs]
        time.sleep(1.0)  # down for a while; the sources keep streaming into their backlog
        assert all(s.grown > g for s, g in zip(srcs, grown_at_kill))
        second = serve(processes, log, port, "--lease-ttl-s", "3")  # a new, empty registry on the same port
        assert second.pid != first.pid
        recovery_s = wait_until_right(client, srcs, 20)
        assert all(s.pub.registrations > r for s, r in zip(srcs, registrations))
        assert all(s.pub.resyncs >= 2 for s in srcs)
        for s in srcs:
            s.stop_load()
        assert all(s.pub.flush(10) for s in srcs)
        assert wrong_answers(client, srcs, grown=True) == []
        print(f"\nregistry restart: right again {recovery_s:.2f} s after the new server started; "
              f"grown {[s.grown for s in srcs]}")
    finally:
        client.close()


@pytest.mark.redis
def test_a_server_of_the_failover_list_killed_under_load_loses_no_event_and_gives_no_wrong_answer(
        redis_url: str, processes, sources, tmp_path: Path) -> None:
    """Two servers in front of one Redis; publishers and a lookup client (what a target's ``lookup`` uses)
    are given both, and the one they use is SIGKILLed while the publishers stream: every client moves to the
    other by itself, every later lookup is right, and the growing chains are whole at the end."""
    ports = [free_port(), free_port()]
    first, _ = (serve(processes, tmp_path / f"registry-{p}.log", p, "--redis-url", redis_url, "--lease-ttl-s", "5")
                for p in ports)
    endpoints = ",".join(f"tcp://127.0.0.1:{p}" for p in ports)
    srcs = [s.start() for s in sources(endpoints, 1.0)]
    client = RegistryClient(endpoints, timeout_s=1.0)
    try:
        assert all(s.pub.flush(10) for s in srcs)
        assert wrong_answers(client, srcs) == []
        assert {s.client.endpoint for s in srcs} == {client.endpoint} == {f"tcp://127.0.0.1:{ports[0]}"}
        for s in srcs:
            s.start_load()
        time.sleep(0.3)
        grown_at_kill = [s.grown for s in srcs]
        first.kill()  # SIGKILL: the server in use is gone; Redis and the other server are not
        first.wait(5)
        t_end, asked = time.monotonic() + 3.0, 0
        while time.monotonic() < t_end:  # the first lookup waits out one timeout, then moves on
            assert wrong_answers(client, srcs) == []
            asked += 1
        assert client.endpoint == f"tcp://127.0.0.1:{ports[1]}" and client.failovers == 1
        assert all(s.grown > g for s, g in zip(srcs, grown_at_kill))
        for s in srcs:
            s.stop_load()
        assert all(s.pub.flush(10) for s in srcs)
        assert all(s.client.endpoint == f"tcp://127.0.0.1:{ports[1]}" for s in srcs)
        assert wrong_answers(client, srcs, grown=True) == []  # every block streamed meanwhile arrived
        print(f"\nfailover: {asked} rounds of lookups right after the kill; grown {[s.grown for s in srcs]}; "
              f"publisher failovers {[s.client.failovers for s in srcs]}, resyncs {[s.pub.resyncs for s in srcs]}")
    finally:
        client.close()


def _nodes(port: int) -> list[tuple[str, int, str, str]]:
    """(id, port, 'master'/'slave', master id) of every node, as node ``port`` sees them."""
    import redis
    with redis.Redis(port=port, decode_responses=True) as c:
        text = c.execute_command("CLUSTER NODES")
    out = []
    for address, node in text.items():
        role = "master" if "master" in node["flags"] else "slave"
        out.append((node["node_id"], int(address.split("@")[0].rsplit(":", 1)[1]), role, node["master_id"]))
    return out


def never_wrong(client: RegistryClient, srcs: list[Source]) -> int:
    """Look every static chain up once; an answer may be missing or short, never another worker's or longer.
    Returns how many lookups got no answer (the store or server down)."""
    down = 0
    for src in srcs:
        for chain in src.chains:
            try:
                r = client.lookup(chain)
            except (StoreUnavailable, RpcTimeout):
                down += 1
                continue
            assert r.best is None or (r.best.worker_id == src.worker_id and r.matched <= CHAIN_LEN), \
                (src.worker_id, r)
    return down


@pytest.mark.cluster
def test_a_master_failing_over_under_load_gives_no_wrong_answer_and_every_worker_converges(
        processes, sources, tmp_path: Path) -> None:
    """The master holding the meta slot is SIGKILLed under load, its replica cut off (SIGSTOPped) first so
    that it misses the last writes: lookups fail until the replica is promoted, are never wrong, and once
    the registry records the new topology every worker resyncs and every answer is whole again."""
    _need_redis_binaries("redis-server", "redis-cli")
    cluster, url = start_redis_cluster(tmp_path / "cluster", replicas=1, node_timeout_ms=1000)
    processes += cluster
    by_port = {int(str(p.args[2])): p for p in cluster}  # redis-server --port PORT ...
    srcs, client = _serve_with_sources(processes, sources, tmp_path, "--redis-cluster-url", url)
    try:
        from remote_g2.registry.stores.redis_store import RedisClusterStore
        probe = RedisClusterStore(url)
        meta_port = int(probe.space.nodes.node(b"rg2:{m}:lease")[0].rsplit(":", 1)[1])
        probe.close()
        nodes = _nodes(meta_port)
        meta_id = next(n[0] for n in nodes if n[1] == meta_port)
        replica_port = next(n[1] for n in nodes if n[3] == meta_id)
        print(f"\ncluster failover: "
              f"{_cut_off_and_kill_then_check(client, srcs, by_port[meta_port], by_port[replica_port])}")
    finally:
        client.close()


def _serve_with_sources(processes, sources, tmp_path: Path, *store: str) -> tuple[list[Source], RegistryClient]:
    """A registry server on ``store`` (its serve flags), two publishers streaming into it and a lookup client,
    every chain already right."""
    port = free_port()
    serve(processes, tmp_path / "registry.log", port, *store, "--lease-ttl-s", "6")
    endpoint = f"tcp://127.0.0.1:{port}"
    srcs = [s.start() for s in sources(endpoint, 2.0)]
    client = RegistryClient(endpoint, timeout_s=3.0)
    assert all(s.pub.flush(10) for s in srcs)
    wait_until_right(client, srcs, 10)
    return srcs, client


def _cut_off_and_kill_then_check(client: RegistryClient, srcs: list[Source], master: subprocess.Popen[bytes],
                                 replica: subprocess.Popen[bytes]) -> str:
    """Under load: SIGSTOP the replica (it misses what follows), SIGKILL its master, SIGCONT the replica; then
    lookups are never wrong, answer again, every worker resyncs and every answer ends whole. The figures."""
    resyncs = [s.pub.resyncs for s in srcs]
    for s in srcs:
        s.start_load()
    time.sleep(0.3)
    replica.send_signal(19)  # SIGSTOP: the replica stops taking its master's writes
    time.sleep(0.3)          # ... which go on meanwhile
    master.kill()            # the master dies with writes its replica never saw
    master.wait(5)
    replica.send_signal(18)  # SIGCONT
    t_kill = time.monotonic()
    down = 0
    while time.monotonic() - t_kill < 30:
        missed = never_wrong(client, srcs)
        down += missed
        if not missed:
            break
    back_s = time.monotonic() - t_kill
    assert back_s < 30, "the registry did not answer again within 30 s of the master's death"
    for s in srcs:
        s.stop_load()
    assert all(s.pub.flush(20) for s in srcs)
    # The sweeper records the new topology within a second; each worker hears resync_needed at its next
    # heartbeat or batch, and resyncs: what the promoted replica never got comes back.
    deadline = time.monotonic() + 15
    while not all(s.pub.resyncs > r for s, r in zip(srcs, resyncs)):
        assert time.monotonic() < deadline, f"no resync after the failover: {[s.pub.resyncs for s in srcs]}"
        time.sleep(0.1)
    resynced_s = time.monotonic() - t_kill
    assert all(s.pub.flush(20) for s in srcs)
    converge_s = wait_until_right(client, srcs, 30, grown=True)  # asserts: every chain whole, nothing lost
    return (f"{down} lookups unanswered; answering again {back_s:.1f} s after the kill, every worker resynced "
            f"{resynced_s:.1f} s after it, every answer whole {converge_s:.1f} s later")


@pytest.mark.redis
def test_a_sentinel_failover_under_load_gives_no_wrong_answer_and_every_worker_converges(
        processes, sources, tmp_path: Path) -> None:
    """A master, its replica and a real Redis Sentinel (quorum 1, down after 1 s); the registry follows the
    master the sentinel names (``serve --redis-sentinel``). The master dies under load with its replica cut
    off first: the sentinel promotes the replica and the registry carries on, as with a Cluster."""
    _need_redis_binaries()
    work = tmp_path / "sentinel"
    master_port, replica_port, sentinel_port = free_port(), free_port(), free_port()
    master = start_redis(master_port, work)
    replica = start_redis(replica_port, work, "--replicaof", "127.0.0.1", str(master_port))
    processes += [master, replica]
    conf = work / "sentinel.conf"
    conf.write_text(f"port {sentinel_port}\nbind 127.0.0.1\ndir {work}\n"
                    f"sentinel monitor registry 127.0.0.1 {master_port} 1\n"
                    "sentinel down-after-milliseconds registry 1000\nsentinel failover-timeout registry 5000\n")
    sentinel = subprocess.Popen(["redis-server", str(conf), "--sentinel", "--logfile", str(work / "sentinel.log")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    processes.append(sentinel)
    import redis
    deadline = time.monotonic() + 20
    while True:  # the sentinel knows the master, and the replica has synced
        try:
            with redis.Redis(port=sentinel_port, socket_timeout=1) as s, redis.Redis(port=replica_port) as r:
                if s.execute_command("SENTINEL", "get-master-addr-by-name", "registry") and \
                        r.info("replication").get("master_link_status") == "up":
                    break
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, "the sentinel or the replica did not come up"
        time.sleep(0.1)
    srcs, client = _serve_with_sources(processes, sources, tmp_path, "--redis-sentinel",
                                       f"127.0.0.1:{sentinel_port}/registry")
    try:
        print(f"\nsentinel failover: {_cut_off_and_kill_then_check(client, srcs, master, replica)}")
        with redis.Redis(port=sentinel_port) as s:
            assert int(s.execute_command("SENTINEL", "get-master-addr-by-name", "registry")[1]) == replica_port
    finally:
        client.close()


# -- A3: leases follow the monotonic clock, not the wall clock ------------------------------------------------


@pytest.fixture
def wall_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """``jump(seconds)``: from now on ``time.time()`` / ``time.time_ns()`` run ``seconds`` off the real clock."""
    real_time, real_ns = time.time, time.time_ns

    def jump(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
        monkeypatch.setattr(time, "time_ns", lambda: real_ns() + int(seconds * 1e9))

    return jump


def _pool(n: int = 16) -> HostPool:
    layout = make_layout(32)
    pool = HostPool(layout)
    hashes = [hash_of(i) for i in range(n)]
    pool.store(hashes, [block_bytes_for(0, h, layout.block_bytes) for h in hashes])
    return pool


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def test_lease_table_neither_expires_nor_extends_on_a_wall_clock_jump(wall_clock, monkeypatch) -> None:
    pool = _pool()
    table = LeaseTable(pool, tombstone_ttl_s=0.3)
    t0 = time.monotonic()
    table.pin(1, [hash_of(i) for i in range(4)], t0 + 1.0, b"a")
    table.pin(2, [hash_of(i) for i in range(4, 8)], t0 + 60, b"a")
    wall_clock(+HOURS)
    assert table.reap() == [] and table.open_leases == 2 and pool.stats()["total_pins"] == 8
    assert table.renew(2, time.monotonic() + 60, b"a")  # still open, so renewable
    wall_clock(-HOURS)
    assert table.reap() == []
    _sleep_until(t0 + 1.05)
    assert [lease.lease_id for lease in table.reap()] == [1]  # a wall clock set back does not extend it
    assert pool.stats()["total_pins"] == 4 and table.get(2) is not None
    # Control: the clock the table does follow. Moving it an hour on ends the other lease.
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + 3600)
    assert [lease.lease_id for lease in table.reap()] == [2] and pool.stats()["total_pins"] == 0


def test_registry_memory_store_worker_lease_ignores_wall_clock_jumps(wall_clock) -> None:
    store = MemoryStore(lease_ttl_ms=1000)
    hashes = [hash_of(i) for i in range(4)]
    t0 = time.monotonic()
    store.register_worker(RegisterWorker("w", "tcp://127.0.0.1:9", FP, 1))
    store.apply_events(Events("w", 1, 1, [BlockEvent("stored", hashes)]))
    wall_clock(+HOURS)
    r = store.lookup(hashes)
    assert (r.reason, r.matched) == ("ok", 4) and store.sweep() == 0
    rec = store.worker_info("w")
    assert rec is not None and rec.live and 0 < rec.lease_expires_in_ms <= 1000
    wall_clock(-HOURS)
    assert store.lookup(hashes).reason == "ok"
    _sleep_until(t0 + 1.05)  # past the lease, nobody heartbeated
    assert store.lookup(hashes).reason == "no_candidate" and not store.worker_info("w").live
    assert store.sweep() == 1
    # Control: the clock the store does follow (injectable) moved on expires a fresh lease at once.
    offset = [0.0]
    moved = MemoryStore(lease_ttl_ms=60_000, clock=lambda: time.monotonic() + offset[0])
    moved.register_worker(RegisterWorker("w", "tcp://127.0.0.1:9", FP, 1))
    moved.apply_events(Events("w", 1, 1, [BlockEvent("stored", hashes)]))
    offset[0] = 61.0
    assert moved.lookup(hashes).reason == "no_candidate"


class FakeAgent:
    """Stands in for the source's NIXL RankAgent: this test needs no NIXL."""

    def __init__(self, name: str, regions: object, **kw: object) -> None:
        self.name = name
        self.progress_mode = "poll"
        self.metadata = b"fake-metadata:" + name.encode()

    def start_progress(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_source_service_leases_ignore_wall_clock_jumps(wall_clock, monkeypatch) -> None:
    monkeypatch.setattr(service_mod, "RankAgent", FakeAgent)
    pool = _pool()
    service = start_source_service(pool, worker_id="clock", tp_size=1,
                                   config=SourceConfig(enabled=True, reap_interval_ms=10, max_lease_ttl_ms=5_000))
    try:
        with RpcClient(service.endpoint, timeout_ms=5000) as c:
            t0 = time.monotonic()
            short = c.call(Resolve([hash_of(i) for i in range(3)], 1_000))
            long = c.call(Resolve([hash_of(i) for i in range(3, 5)], 5_000))
            assert (short.reason, long.reason) == ("ok", "ok") and pool.stats()["total_pins"] == 5
            wall_clock(+HOURS)
            time.sleep(0.1)  # the reaper runs every 10 ms: a forward jump expires nothing
            assert pool.stats()["total_pins"] == 5
            renewed = c.call(Renew(long.lease_id, 5_000))
            assert renewed.renewed and 4_000 < renewed.expires_in_ms <= 5_000
            wall_clock(-HOURS)
            _sleep_until(t0 + 1.1)  # past the short lease: a wall clock set back did not extend it
            deadline = time.monotonic() + 2
            while pool.stats()["total_pins"] != 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool.stats()["total_pins"] == 2 and service.stats()["leases_expired"] == 1
            assert not c.call(Renew(short.lease_id, 5_000)).renewed
    finally:
        service.shutdown()
