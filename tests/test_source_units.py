"""The source service's parts, in one process: lease tables, the pin budget, config, IPC paths,
and a TP=2 service whose two ranks run on threads (NIXL stubbed, ZMQ real).

The real-process, real-NIXL tests are in ``test_source_mpi.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from remote_g2.adapters.host_pool import HostPool
from remote_g2.source import PinBudget, SourceConfig, maybe_start_source_service
from remote_g2.source import service as service_mod
from remote_g2.rpc.connection_identity import new_identity
from remote_g2.source.leases import LeaseTable
from remote_g2.tp.group import RankRecord, TpGroup, exchange
from source_procs.pattern import block_bytes_for, hash_of, make_layout

from remote_g2.errors import ConfigError, SourceError
from remote_g2.rpc.ipc_paths import claim_ipc_path, ipc_endpoint, prepare_ipc_dir
from remote_g2.protocol.messages import GetMetadata, LayoutFingerprint, PeerResolve, Release, Renew, Resolve
from remote_g2.rpc.client import RpcClient


def _pool(n_hashes: int = 16, num_blocks: int = 32, rank: int = 0, skip: set[int] = frozenset()) -> HostPool:
    layout = make_layout(num_blocks)
    pool = HostPool(layout)
    hashes = [hash_of(i) for i in range(n_hashes) if i not in skip]
    pool.store(hashes, [block_bytes_for(rank, h, layout.block_bytes) for h in hashes])
    return pool


def _hashes(start: int, n: int) -> list[bytes]:
    return [hash_of(start + i) for i in range(n)]


# -- PinBudget ----------------------------------------------------------------------------------


def test_budget_grants_what_is_left_and_never_overshoots_under_threads() -> None:
    budget = PinBudget(100)
    assert budget.reserve(30) == 30 and budget.reserve(80) == 70 and budget.reserve(1) == 0
    budget.give_back(100)
    assert budget.available == 100
    granted: list[int] = []
    lock = threading.Lock()

    def grab() -> None:
        for _ in range(200):
            g = budget.reserve(3)
            with lock:
                granted.append(g)
            assert budget.available >= 0

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 100 and budget.available == 0


def test_budget_refuses_to_grow_past_its_limit() -> None:
    budget = PinBudget(10)
    budget.reserve(4)
    budget.give_back(9)  # a bookkeeping bug is logged, not turned into extra budget
    assert budget.available == 10


def test_a_charge_is_never_refused_and_leaves_reserve_nothing_until_given_back() -> None:
    seen: list[int] = []
    budget = PinBudget(10, on_change=seen.append)
    assert budget.reserve(8) == 8
    budget.charge(5)  # another rank's budget allowed these pins: over the limit for a moment
    assert budget.available == 0 and budget.reserve(1) == 0 and min(seen) == 0
    budget.give_back(5)
    assert budget.available == 2 and budget.reserve(3) == 2


# -- LeaseTable ---------------------------------------------------------------------------------


def test_pin_trim_release_leaves_no_pins() -> None:
    pool = _pool()
    budget = PinBudget(32)
    table = LeaseTable(pool, budget=budget)
    assert budget.reserve(10) == 10
    ids = table.pin(1, _hashes(0, 10), time.monotonic() + 10, b"a")
    assert len(ids) == 10 and pool.stats()["total_pins"] == 10
    assert table.trim(1, 4) is True
    assert pool.stats()["total_pins"] == 4 and budget.available == 32 - 4
    assert [pool.pin_count(b) for b in ids] == [1] * 4 + [0] * 6
    assert table.release(1, b"a") is True and table.release(1, b"a") is False
    assert pool.stats()["total_pins"] == 0 and budget.available == 32
    assert table.trim(1, 2) is False and table.open_leases == 0 and table.pinned_blocks == 0


def test_the_table_says_where_its_readers_are() -> None:
    """The source's progress pace reads this: a new reader wires UCX up, one elsewhere may need every READ answered."""
    table = LeaseTable(_pool())
    here, elsewhere = new_identity(local=True), new_identity()
    assert table.readers() == "none"
    table.pin(1, _hashes(0, 2), time.monotonic() + 10, here)
    assert table.readers() == "new"  # its first lease: the reader's first READ connects to us
    table.release(1, here)
    table.pin(2, _hashes(0, 2), time.monotonic() + 10, here)
    assert table.readers() == "local"
    table.pin(3, _hashes(2, 2), time.monotonic() + 10, elsewhere)
    assert table.readers() == "new"
    table.release(3, elsewhere)
    table.pin(4, _hashes(2, 2), time.monotonic() + 10, elsewhere)
    assert table.readers() == "remote"
    table.release(4, elsewhere)
    assert table.readers() == "local"
    table.release(2, here)
    assert table.readers() == "none"


def test_pin_of_a_missing_prefix_records_nothing() -> None:
    pool = _pool()
    table = LeaseTable(pool)
    assert table.pin(5, [hash_of(999), hash_of(0)], time.monotonic() + 10, b"a") == []
    assert table.open_leases == 0 and pool.stats()["total_pins"] == 0


def test_released_or_open_lease_id_cannot_pin_again() -> None:
    pool = _pool()
    table = LeaseTable(pool)
    table.pin(1, _hashes(0, 3), time.monotonic() + 10, b"a")
    with pytest.raises(SourceError):
        table.pin(1, _hashes(0, 3), time.monotonic() + 10, b"a")
    assert pool.stats()["total_pins"] == 3
    table.release(1, b"a")
    assert table.release(2, b"a") is False  # unknown, but remembered: a late pin for it is refused
    with pytest.raises(SourceError, match="released"):
        table.pin(2, _hashes(0, 3), time.monotonic() + 10, b"a")
    assert pool.stats()["total_pins"] == 0


def test_reap_drops_only_expired_leases_and_renew_moves_deadlines() -> None:
    pool = _pool()
    table = LeaseTable(pool)
    now = time.monotonic()
    table.pin(1, _hashes(0, 2), now + 0.05, b"a")
    table.pin(2, _hashes(2, 3), now + 100, b"a")
    table.pin(3, _hashes(5, 4), now + 0.05, b"a")
    assert table.renew(3, now + 200, b"a") is True
    assert table.reap(now + 1) and table.open_leases == 2
    assert pool.stats()["total_pins"] == 7
    expired = table.reap(now + 150)
    assert [lease.lease_id for lease in expired] == [2]
    assert table.renew(1, now + 500, b"a") is False  # gone
    assert table.release_all() == 1 and pool.stats()["total_pins"] == 0


def test_renew_of_an_expired_but_not_yet_reaped_lease_is_refused() -> None:
    pool = _pool()
    table = LeaseTable(pool)
    table.pin(1, _hashes(0, 2), time.monotonic() - 0.001, b"a")
    assert table.renew(1, time.monotonic() + 10, b"a") is False
    assert len(table.reap()) == 1 and pool.stats()["total_pins"] == 0


def test_concurrent_pins_and_releases_balance() -> None:
    pool = _pool(n_hashes=16)
    budget = PinBudget(1000)
    table = LeaseTable(pool, budget=budget)
    ids = iter(range(1, 1_000_000))
    lock = threading.Lock()

    def work(seed: int) -> None:
        for k in range(300):
            with lock:
                lease = next(ids)
            n = budget.reserve(8)
            got = table.pin(lease, _hashes(seed % 8, 8), time.monotonic() + (0.001 if k % 7 == 0 else 10), b"a")
            budget.give_back(n - len(got))
            if k % 3 == 0:
                table.trim(lease, 3)
            if k % 7 != 0:
                table.release(lease, b"a")
            if k % 50 == 0:
                table.reap()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.01)
    table.reap()
    assert table.open_leases == 0 and pool.stats()["total_pins"] == 0 and budget.available == 1000


# -- config ---------------------------------------------------------------------------------------


def test_config_from_env_reads_every_setting() -> None:
    fp = '{"model_id": "m", "dtype": "bf16", "tokens_per_block": 16, "kv_layout": "HND", "num_layers": 2, ' \
         '"num_kv_heads": 8, "head_dim": 64, "tp_size": 2}'
    cfg = SourceConfig.from_env({
        "REMOTE_G2_SOURCE": "1", "REMOTE_G2_REGISTRY": "tcp://10.0.0.1:7450",
        "REMOTE_G2_SOURCE_BIND": "tcp://0.0.0.0:7460", "REMOTE_G2_SOURCE_ADVERTISE": "tcp://10.0.0.2:7460",
        "REMOTE_G2_SOURCE_IPC_DIR": "/run/rg2", "REMOTE_G2_SOURCE_DEFAULT_TTL_MS": "5000",
        "REMOTE_G2_SOURCE_MAX_TTL_MS": "20000", "REMOTE_G2_SOURCE_PIN_BUDGET": "4096",
        "REMOTE_G2_SOURCE_SIBLING_TIMEOUT_MS": "250", "REMOTE_G2_SOURCE_RPC_WORKERS": "8",
        "REMOTE_G2_SOURCE_METRICS_PORT": "9400", "REMOTE_G2_SOURCE_FINGERPRINT": fp,
    })
    assert cfg.enabled and cfg.registry_endpoint == "tcp://10.0.0.1:7450"
    assert (cfg.bind, cfg.advertise, cfg.ipc_dir) == ("tcp://0.0.0.0:7460", "tcp://10.0.0.2:7460", "/run/rg2")
    assert (cfg.default_lease_ttl_ms, cfg.max_lease_ttl_ms, cfg.pin_budget_blocks) == (5000, 20000, 4096)
    assert (cfg.sibling_timeout_ms, cfg.rpc_workers, cfg.metrics_port) == (250, 8, 9400)
    assert cfg.fingerprint == LayoutFingerprint("m", "bf16", 16, "HND", 2, 8, 64, 2)
    assert SourceConfig.from_env({}).enabled is False


def test_the_stream_lane_is_the_default_unless_turned_off() -> None:
    assert SourceConfig().stream_lane and SourceConfig().peer_transport == "stream"
    assert not SourceConfig.from_env({"REMOTE_G2_SOURCE_PEER_TRANSPORT": "ZMQ"}).stream_lane
    assert not SourceConfig(peer_resolve=False).stream_lane


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_the_stream_lane_is_never_offered_with_curve(tmp_path: Path) -> None:
    from remote_g2.rpc.curve import CurveServerConfig, generate_keypair

    _, secret = generate_keypair(tmp_path, "source")
    assert not SourceConfig(curve=CurveServerConfig.from_files(secret)).stream_lane  # plaintext: never with keys


@pytest.mark.parametrize("env, needle", [
    ({"REMOTE_G2_SOURCE": "maybe"}, "REMOTE_G2_SOURCE"),
    ({"REMOTE_G2_SOURCE_PIN_BUDGET": "lots"}, "REMOTE_G2_SOURCE_PIN_BUDGET"),
    ({"REMOTE_G2_SOURCE_FINGERPRINT": "{"}, "not JSON"),
    ({"REMOTE_G2_SOURCE_FINGERPRINT": '{"colour": 1}'}, "fields"),
    ({"REMOTE_G2_REGISTRY": "tcp://r:1"}, "fingerprint"),
    ({"REMOTE_G2_SOURCE_BIND": "ipc:///tmp/x"}, "tcp://"),
    ({"REMOTE_G2_SOURCE_MAX_TTL_MS": "4000000"}, "3600000"),
    ({"REMOTE_G2_SOURCE_SIBLING_TIMEOUT_MS": "0"}, "sibling_timeout_ms"),
    ({"REMOTE_G2_SOURCE_CURVE_ALLOWED": "/x"}, "CURVE_SECRET_KEY"),
    ({"REMOTE_G2_SOURCE_PEER_TRANSPORT": "udp"}, "peer_transport"),
])
def test_config_errors_name_the_setting(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        SourceConfig.from_env(env)


def test_disabled_service_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REMOTE_G2_SOURCE", raising=False)
    assert maybe_start_source_service(object(), worker_id="w", config=SourceConfig()) is None  # type: ignore[arg-type]
    assert maybe_start_source_service(object(), worker_id="w") is None  # type: ignore[arg-type]
    monkeypatch.setenv("REMOTE_G2_SOURCE", "0")
    assert maybe_start_source_service(object(), worker_id="w") is None  # type: ignore[arg-type]


# -- IPC directory and paths ----------------------------------------------------------------------


def test_ipc_dir_is_created_private_and_others_are_refused(tmp_path: Path) -> None:
    d = prepare_ipc_dir(tmp_path / "a" / "ipc")
    assert (d.stat().st_mode & 0o777) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(ConfigError, match="open to other users"):
        prepare_ipc_dir(open_dir)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError):
        prepare_ipc_dir(tmp_path / "file")


def test_ipc_endpoint_names_and_limits(tmp_path: Path) -> None:
    assert ipc_endpoint(Path("/r"), "w-1", 3) == "ipc:///r/w-1_tp3.sock"
    a, b = ipc_endpoint(Path("/r"), "a/b", 1), ipc_endpoint(Path("/r"), "a:b", 1)
    assert a != b and "/" not in a[len("ipc:///r/"):]  # unsafe characters replaced, ids kept apart
    with pytest.raises(ConfigError, match="longer than"):
        ipc_endpoint(Path("/" + "d" * 100), "w", 1)


def test_claim_ipc_path_removes_a_stale_file_but_not_a_live_socket(tmp_path: Path) -> None:
    import socket

    stale = tmp_path / "stale.sock"
    stale.write_text("")
    claim_ipc_path(f"ipc://{stale}")
    assert not stale.exists()
    live = tmp_path / "live.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(live))
    srv.listen(1)
    try:
        with pytest.raises(ConfigError, match="served by another process"):
            claim_ipc_path(f"ipc://{live}")
    finally:
        srv.close()


# -- the start-up exchange -------------------------------------------------------------------------


class ThreadComm:
    """An in-process stand-in for a TP communicator: ranks are threads, allgather is a barrier."""

    def __init__(self, shared: dict, rank: int, size: int) -> None:
        self.shared, self.rank, self.size = shared, rank, size

    @classmethod
    def group(cls, size: int) -> list[ThreadComm]:
        shared = {"barrier": threading.Barrier(size, timeout=30), "slots": [None] * size}
        return [cls(shared, r, size) for r in range(size)]

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def allgather(self, obj: object) -> list[object]:
        self.shared["slots"][self.rank] = obj
        self.shared["barrier"].wait()
        out = list(self.shared["slots"])
        self.shared["barrier"].wait()
        return out


def test_exchange_fails_every_rank_when_one_rank_failed() -> None:
    comms = ThreadComm.group(2)
    layout = make_layout(4)
    rec = RankRecord(0, "a", b"md", 4096, 4096, layout, None)
    results: list[object] = [None, None]

    def run(r: int) -> None:
        try:
            exchange(TpGroup(r, 2, comms[r]), rec if r == 0 else None, None if r == 0 else "no NIXL here")
        except SourceError as e:
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(isinstance(e, SourceError) and "rank 1: no NIXL here" in str(e) for e in results), results


def test_exchange_round_trips_records_in_rank_order() -> None:
    comms = ThreadComm.group(2)
    layout = make_layout(4)
    out: list[object] = [None, None]

    def run(r: int) -> None:
        rec = RankRecord(r, f"agent{r}", bytes([r]) * 3, 4096 * (r + 1), 4096, layout,
                         None if r == 0 else "ipc:///x")
        out[r] = exchange(TpGroup(r, 2, comms[r]), rec)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out[0] == out[1]
    assert [r.agent_name for r in out[0]] == ["agent0", "agent1"] and out[0][1].layout == layout


# -- a TP=2 service on threads (NIXL stubbed) --------------------------------------------------------


class FakeAgent:
    """Stands in for RankAgent so these tests need no NIXL in the pytest process."""

    def __init__(self, name: str, regions, **kw) -> None:
        self.name = name
        self.progress_mode = "poll"
        self.metadata = b"fake-metadata:" + name.encode()
        self.closed = False
        self.wakes = 0

    def start_progress(self) -> None:
        pass

    def wake(self) -> None:
        self.wakes += 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def tp2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict]:
    """Two ranks of one worker in this process: rank 1 lacks hash 12, rank 0 lacks hash 14.

    Indirect parameter: the peer transport (default ``stream``).
    """
    transport = getattr(request, "param", "stream")
    monkeypatch.setattr(service_mod, "RankAgent", FakeAgent)
    import tempfile

    ipc_dir = tempfile.mkdtemp(prefix="rg2u-")
    pools = [_pool(16, 32, 0, {14}), _pool(16, 32, 1, {12})]
    comms = ThreadComm.group(2)
    cfg = SourceConfig(enabled=True, ipc_dir=ipc_dir, pin_budget_blocks=24, sibling_timeout_ms=500,
                       max_lease_ttl_ms=5_000, reap_interval_ms=10, peer_transport=transport)
    services: list[object] = [None, None]

    def start(r: int) -> None:
        services[r] = maybe_start_source_service(pools[r], worker_id="unit", config=cfg, comm=comms[r])

    threads = [threading.Thread(target=start, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    client = RpcClient(services[0].endpoint, timeout_ms=5000)
    try:
        yield {"services": services, "pools": pools, "client": client, "transport": transport}
    finally:
        client.close()
        for s in services:
            if s is not None:
                s.shutdown()
        os.rmdir(ipc_dir)


def _pins(pools: list[HostPool]) -> list[int]:
    return [p.stats()["total_pins"] for p in pools]


def _settled_pins(pools: list[HostPool], expect: list[int], timeout_s: float = 5.0) -> list[int]:
    """Pins once they equal ``expect`` (siblings drop released pins a moment after the reply)."""
    deadline = time.monotonic() + timeout_s
    while _pins(pools) != expect and time.monotonic() < deadline:
        time.sleep(0.005)
    return _pins(pools)


def test_threaded_tp2_resolve_trims_both_ways_and_releases(tp2: dict) -> None:
    c, pools = tp2["client"], tp2["pools"]
    r = c.call(Resolve(_hashes(0, 16), 5_000))
    assert (r.reason, r.matched) == ("ok", 12) and _pins(pools) == [12, 12]
    assert [m.agent_name for m in r.metadata] == ["remote-g2-source-unit-tp0", "remote-g2-source-unit-tp1"]
    r2 = c.call(Resolve(_hashes(13, 3), 5_000, known_agents=["remote-g2-source-unit-tp1"]))
    assert (r2.reason, r2.matched) == ("ok", 1)  # rank 0 lacks 14: rank 1's 3 pins trimmed to 1
    # rank 1's agent is known to the caller: only rank 0's RankInfo (with its metadata) comes back
    assert [(m.agent_name, m.agent_metadata is None) for m in r2.metadata] == [("remote-g2-source-unit-tp0", False)]
    assert _pins(pools) == [13, 13]
    assert c.call(Release(r.lease_id)).released and c.call(Release(r2.lease_id)).released
    assert _settled_pins(pools, [0, 0]) == [0, 0]
    assert c.call(Resolve([hash_of(12)], 5_000)).reason == "miss" and _pins(pools) == [0, 0]


def test_threaded_tp2_budget_is_per_worker_and_atomic_under_concurrency(tp2: dict) -> None:
    services, pools = tp2["services"], tp2["pools"]
    endpoint = services[0].endpoint
    leases: list[tuple[RpcClient, int]] = []
    reasons: list[str] = []
    lock = threading.Lock()
    clients = [RpcClient(endpoint, timeout_ms=5000) for _ in range(4)]

    def grab(c: RpcClient) -> None:
        for _ in range(5):
            r = c.call(Resolve(_hashes(0, 4), 5_000))
            with lock:
                reasons.append(r.reason)
                if r.lease_id:
                    leases.append((c, r.lease_id))

    threads = [threading.Thread(target=grab, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert reasons.count("ok") == 6 and reasons.count("over_budget") == 14  # budget 24 = 6 x 4 blocks
    assert _pins(pools) == [24, 24] and services[0].stats()["budget_available"] == 0
    for c, lease in leases:  # a lease is released over the connection that resolved it
        assert c.call(Release(lease)).released
    for c in clients:
        c.close()
    assert _settled_pins(pools, [0, 0]) == [0, 0] and services[0].stats()["budget_available"] == 24


def test_threaded_tp2_expiry_and_renew(tp2: dict) -> None:
    c, pools, services = tp2["client"], tp2["pools"], tp2["services"]
    short = c.call(Resolve(_hashes(0, 3), 150))
    kept = c.call(Resolve(_hashes(3, 2), 150))
    assert c.call(Renew(kept.lease_id, 3_000)).renewed
    time.sleep(0.4)
    assert _pins(pools) == [2, 2]  # short expired on both ranks; kept lives on both
    assert services[0].stats()["leases_expired"] == 1 and services[1].stats()["leases_expired"] == 1
    assert c.call(Release(short.lease_id)).released is False
    assert c.call(Release(kept.lease_id)).released is True and _settled_pins(pools, [0, 0]) == [0, 0]


def test_threaded_tp2_ttl_is_clamped_and_metadata_lists_ranks(tp2: dict) -> None:
    c = tp2["client"]
    r = c.call(Resolve(_hashes(0, 2), 3_600_000))
    assert r.expires_in_ms <= 5_000
    c.call(Release(r.lease_id))
    md = c.call(GetMetadata())
    assert md.tp_size == 2 and [i.rank for i in md.ranks] == [0, 1]
    assert all(i.agent_metadata for i in md.ranks)


def test_threaded_tp2_shutdown_drops_leases_and_is_idempotent(tp2: dict) -> None:
    c, pools, services = tp2["client"], tp2["pools"], tp2["services"]
    c.call(Resolve(_hashes(0, 5), 5_000))
    assert _pins(pools) == [5, 5]
    for s in services:
        s.shutdown()
        s.shutdown()
    assert _pins(pools) == [0, 0]


def test_tp1_service_without_mpi_serves_curve_only_clients(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import zmq
    from remote_g2.source import start_source_service

    from remote_g2.rpc.curve import CurveClientConfig, CurveServerConfig, generate_keypair
    from remote_g2.errors import RpcTimeout

    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    monkeypatch.setattr(service_mod, "RankAgent", FakeAgent)
    public, secret = generate_keypair(tmp_path / "keys", "source")
    pool = _pool()
    service = start_source_service(pool, worker_id="tp1", tp_size=1, config=SourceConfig(
        enabled=True, curve=CurveServerConfig.from_files(secret)))
    try:
        assert (service.rank, service.tp_size) == (0, 1)
        with RpcClient(service.endpoint, timeout_ms=5000, curve=CurveClientConfig.for_server(str(public))) as c:
            r = c.call(Resolve(_hashes(0, 4), 5_000))
            assert (r.reason, r.matched, [rb.rank for rb in r.ranks]) == ("ok", 4, [0])
            assert pool.stats()["total_pins"] == 4
            assert service._agent.wakes >= 1  # type: ignore[union-attr]  # the lease opened: progress now
            assert c.call(Release(r.lease_id)).released and pool.stats()["total_pins"] == 0
        with RpcClient(service.endpoint, timeout_ms=300) as plain, pytest.raises(RpcTimeout):
            plain.call(GetMetadata())
    finally:
        service.shutdown()
    assert service._agent.closed  # type: ignore[union-attr]


def test_tp_rank_that_disagrees_with_the_communicator_is_refused() -> None:
    from remote_g2.tp.group import resolve_tp_group

    comm = ThreadComm.group(2)[1]
    assert resolve_tp_group(None, None, comm).rank == 1
    with pytest.raises(ConfigError, match="do not match"):
        resolve_tp_group(0, 2, comm)
    assert resolve_tp_group(0, 1) == TpGroup(0, 1, None)


def test_sibling_err_reply_arrives_as_its_error_class_naming_the_sibling(tmp_path: Path) -> None:
    from remote_g2.protocol.messages import SiblingPin
    from remote_g2.rpc.server import RpcServer
    from remote_g2.source.siblings import SiblingLinks

    def refuse(req: SiblingPin, ctx: object) -> object:
        raise SourceError(f"lease {req.lease_id} refused here")

    endpoint = f"ipc://{prepare_ipc_dir(tmp_path / 'ipc')}/sib_tp1.sock"
    server = RpcServer(endpoint, {"sibling_pin": refuse}, name="sibling-1", workers=1)
    server.start()
    links = SiblingLinks({1: endpoint}, timeout_ms=2000, retry_after_s=1.0)
    try:
        answers = links.call_all(lambda r: SiblingPin(7, [b"\x01" * 8], 1000, b"owner"))
        err = answers[1]
        assert isinstance(err, SourceError) and "lease 7 refused here" in str(err), err
        assert err.remote == endpoint
        assert links.down() == []  # an answer, even ERR, means the sibling is alive
    finally:
        links.close()
        server.close()


@pytest.mark.parametrize("tp2", ["stream", "zmq"], indirect=True)
def test_threaded_tp2_peer_resolve_pins_one_rank_under_the_callers_id_within_its_budget(tp2: dict) -> None:
    services, pools, c0 = tp2["services"], tp2["pools"], tp2["client"]
    stream = tp2["transport"] == "stream"
    scheme = "tcp+stream://127.0.0.1:" if stream else "tcp://127.0.0.1:"
    assert services[1].peer_endpoint.startswith(scheme)
    # Rank 0: a stream lane beside its worker endpoint, or (zmq) the worker endpoint itself.
    assert services[0].peer_endpoint.startswith(scheme) if stream else services[0].peer_endpoint is None
    meta = c0.call(GetMetadata())
    assert [m.peer_endpoint for m in meta.ranks] == [services[0].peer_endpoint, services[1].peer_endpoint]
    lane0 = RpcClient(services[0].peer_endpoint, timeout_ms=5000) if stream else c0
    c1 = RpcClient(services[1].peer_endpoint, timeout_ms=5000)
    other = RpcClient(services[1].peer_endpoint, timeout_ms=5000)
    try:
        r0 = lane0.call(PeerResolve(77, _hashes(0, 16), 5_000, "tgt"))
        assert (r0.reason, r0.matched, r0.epoch) == ("ok", 14, services[0].epoch) and _pins(pools) == [14, 0]
        r1 = c1.call(PeerResolve(77, _hashes(0, 16), 5_000, "tgt"))
        assert (r1.reason, r1.matched, r1.epoch) == ("ok", 12, services[0].epoch) and _pins(pools) == [14, 12]
        assert r1.block_ids == [pools[1].lookup(h) for h in _hashes(0, 12)]
        with pytest.raises(SourceError, match="already open"):
            c1.call(PeerResolve(77, _hashes(0, 4), 5_000))
        # Each share belongs to the connection that pinned it: rank 0's renew and release end or extend
        # rank 0's share alone, rank 1's are answered on rank 1's own connection (and nowhere else).
        assert lane0.call(Renew(77, 5_000)).renewed and _pins(pools) == [14, 12]
        if stream:  # a lease is ended from the connection that took it, whatever the transport
            assert c0.call(Release(77)).released is False and _pins(pools) == [14, 12]
        assert other.call(Renew(77, 5_000)).renewed is False and other.call(Release(77)).released is False
        assert lane0.call(Release(77)).released
        assert _settled_pins(pools, [0, 12]) == [0, 12]
        assert c1.call(Renew(77, 5_000)).renewed and c1.call(Release(77)).released and _pins(pools) == [0, 0]
        # each rank's own budget (24 blocks) bounds its pins
        assert c1.call(PeerResolve(78, _hashes(0, 16), 5_000)).matched == 12
        assert c1.call(PeerResolve(79, _hashes(0, 16), 5_000)).matched == 12
        assert c1.call(PeerResolve(80, _hashes(0, 16), 5_000)).reason == "over_budget"
        # A resolve through rank 0 is bounded by rank 0's budget alone: rank 1 pins its part even
        # with its own budget spent (its count may lag rank 0's by releases still on their way)...
        r = c0.call(Resolve(_hashes(0, 4), 5_000))
        assert (r.reason, r.matched) == ("ok", 4) and _pins(pools) == [4, 28]
        # ...and charges it, so its own shares see the budget run over until the pins go back.
        assert services[1].stats()["budget_available"] == 0
        assert c0.call(Release(r.lease_id)).released and _settled_pins(pools, [0, 24]) == [0, 24]
        # only the connection that pinned a share may release it at the rank's endpoint
        assert other.call(Release(78)).released is False
        assert c1.call(Release(78)).released and c1.call(Release(79)).released
        assert _pins(pools) == [0, 0]
    finally:
        c1.close()
        other.close()
        if lane0 is not c0:
            lane0.close()
