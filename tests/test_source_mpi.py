"""The source service in real processes: ``mpiexec -n 2`` ranks, real NIXL READs, real ZMQ.

Each worker runs ``tests/source_procs/source_rank.py`` on every rank: a
HostPool of 64 one-KiB blocks holding ``hash_of(0..31)`` with bytes that
depend on (rank, hash). Readers are separate processes
(``tests/source_procs/nixl_reader.py``) with their own NIXL agent; they
check every byte they read. Pin counts come from the ranks' pools
themselves (each rank rewrites ``state-{rank}.json`` every 50 ms).

The shared worker's pools: rank 1 lacks hash 20, rank 0 lacks hash 26, so

* hashes 0..19 are on both ranks,
* a resolve of 0..31 matches 20 (rank 0 pinned 26 and trims 6),
* a resolve of 21..31 matches 5 (rank 1 pinned 11 and is trimmed by sibling_trim).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from source_procs.harness import SourceWorker, have_mpiexec, run_readers
from source_procs.pattern import hash_of

from remote_g2.errors import SourceError
from remote_g2.protocol.messages import GetMetadata, Release, Renew, Resolve, SiblingPin
from remote_g2.rpc.client import RpcClient
from remote_g2.protocol.wire import PROTOCOL_VERSION

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.nixl,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not in the venv (pip install mpich)"),
]

BUDGET = 48
_ids = itertools.count()


def _hashes(start: int, n: int) -> list[bytes]:
    return [hash_of(start + i) for i in range(n)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SourceWorker]:
    worker = SourceWorker(tmp_path_factory.mktemp("src-shared"), f"shared-{os.getpid()}",
                          args=["--missing", "1:20;0:26", "--budget", str(BUDGET)])
    try:
        yield worker
        report = worker.stop()
        assert all(d["total_pins"] == 0 for d in report["done"].values()), report
    finally:
        worker.kill()


@pytest.fixture
def client(shared: SourceWorker) -> Iterator[RpcClient]:
    c = RpcClient(shared.endpoint, timeout_ms=5000)
    yield c
    c.close()


@pytest.fixture
def make_worker(tmp_path: Path) -> Iterator[Callable[..., SourceWorker]]:
    workers: list[SourceWorker] = []

    def make(name: str, **kw) -> SourceWorker:
        workers.append(SourceWorker(tmp_path / name, f"{name}-{os.getpid()}-{next(_ids)}", **kw))
        return workers[-1]

    yield make
    for w in workers:
        w.kill()


def assert_no_pins(worker: SourceWorker, *, ranks=(0, 1), tag: str = "") -> None:
    for r in ranks:
        worker.wait_state(r, lambda s: s["total_pins"] == 0 and s["service"]["leases_open"] == 0, tag=tag,
                          what="no pins and no open leases")


# -- the data path ------------------------------------------------------------------------


def test_resolve_read_release_reads_exact_bytes_from_both_ranks(shared: SourceWorker, client: RpcClient,
                                                                 tmp_path: Path) -> None:
    [result] = run_readers(shared.endpoint, tmp_path, [{"hashes": 16, "loops": 3}])
    assert result["ok"], result
    assert result["mismatches"] == []
    first, second, _ = result["replies"]
    assert first["reason"] == "ok" and first["matched"] == 16 and first["lease_id"] > 0
    assert sorted(first["ranks"]) == ["0", "1"] and all(len(v) == 16 for v in first["ranks"].values())
    assert first["metadata_sent"] == [0, 1]  # agents not known yet: metadata for both ranks
    assert second["metadata_sent"] == []  # known agents: no RankInfo at all
    assert first["epoch"] == shared.endpoints[""]["epoch"]
    assert 25_000 < first["expires_in_ms"] <= 30_000
    assert all(r["released"] for r in result["replies"])
    assert_no_pins(shared)


def test_held_lease_pins_every_rank_until_its_owner_releases_it(shared: SourceWorker, client: RpcClient) -> None:
    lease = client.call(Resolve([hash_of(2 + i) for i in range(8)], 30_000)).lease_id
    shared.wait_pins(0, 8)
    shared.wait_pins(1, 8)
    with RpcClient(shared.endpoint, timeout_ms=5000) as other:  # another reader knowing the id cannot end it
        assert other.call(Release(lease)).released is False
        assert other.call(Renew(lease, 30_000)).renewed is False
    shared.wait_pins(0, 8)
    shared.wait_pins(1, 8)
    assert client.call(Release(lease)).released is True
    assert client.call(Release(lease)).released is False  # idempotent
    assert_no_pins(shared)


def test_get_metadata_names_rank_qualified_agents(shared: SourceWorker, client: RpcClient) -> None:
    md = client.call(GetMetadata())
    assert md.tp_size == 2 and md.worker_id == shared.worker_id
    assert md.epoch == shared.endpoints[""]["epoch"]
    assert [r.rank for r in md.ranks] == [0, 1]
    assert [r.agent_name for r in md.ranks] == [f"remote-g2-source-{shared.worker_id}-tp{r}" for r in (0, 1)]
    for info in md.ranks:
        assert info.agent_metadata and info.pool_bytes == info.layout.num_blocks * info.layout.block_bytes
        assert info.layout.block_bytes == 1024 and info.pool_base > 0


# -- partial prefixes and misses ----------------------------------------------------------------


def test_partial_prefix_on_rank1_shrinks_matched_and_trims_rank0(shared: SourceWorker, client: RpcClient) -> None:
    reply = client.call(Resolve(_hashes(0, 32), 30_000))
    try:
        assert reply.reason == "ok" and reply.matched == 20  # rank 1 lacks hash 20
        assert [len(rb.block_ids) for rb in reply.ranks] == [20, 20]
        shared.wait_pins(0, 20)  # rank 0 pinned 26 and gave 6 back before replying
        shared.wait_pins(1, 20)
    finally:
        assert client.call(Release(reply.lease_id)).released
    assert_no_pins(shared)


def test_partial_prefix_on_rank0_trims_the_sibling(shared: SourceWorker, client: RpcClient) -> None:
    reply = client.call(Resolve(_hashes(21, 11), 30_000))
    try:
        assert reply.reason == "ok" and reply.matched == 5  # rank 0 lacks hash 26; rank 1 pinned 11
        shared.wait_pins(1, 5)  # sibling_trim dropped its 6 extra pins
        shared.wait_pins(0, 5)
    finally:
        client.call(Release(reply.lease_id))
    assert_no_pins(shared)


def test_miss_pins_nothing(shared: SourceWorker, client: RpcClient) -> None:
    absent = client.call(Resolve([hash_of(1000)], 30_000))
    assert (absent.reason, absent.lease_id, absent.matched, absent.ranks) == ("miss", 0, 0, [])
    # Hash 20 is on rank 0 only: rank 0 pins it, rank 1 does not, so rank 0's pin is undone.
    only_rank0 = client.call(Resolve([hash_of(20)], 30_000))
    assert (only_rank0.reason, only_rank0.lease_id) == ("miss", 0)
    assert_no_pins(shared)


# -- leases ------------------------------------------------------------------------------------


def test_lease_expires_on_every_rank_without_release(shared: SourceWorker, client: RpcClient) -> None:
    before = [shared.state(r)["service"]["leases_expired"] for r in (0, 1)]
    reply = client.call(Resolve(_hashes(0, 10), 300))
    assert reply.reason == "ok" and reply.expires_in_ms <= 300
    t0 = time.monotonic()
    shared.wait_pins(0, 0, timeout_s=5)
    shared.wait_pins(1, 0, timeout_s=5)
    assert time.monotonic() - t0 < 3
    for r in (0, 1):
        shared.wait_state(r, lambda s, r=r: s["service"]["leases_expired"] == before[r] + 1, what="expired count")
    assert client.call(Release(reply.lease_id)).released is False
    assert client.call(Renew(reply.lease_id, 1000)).renewed is False


def test_renew_extends_the_lease_on_every_rank(shared: SourceWorker, client: RpcClient) -> None:
    reply = client.call(Resolve(_hashes(0, 6), 600))
    time.sleep(0.3)
    renewed = client.call(Renew(reply.lease_id, 5_000))
    assert renewed.renewed and 4_000 < renewed.expires_in_ms <= 5_000
    time.sleep(0.6)  # past the original TTL on both ranks
    shared.wait_pins(0, 6)
    shared.wait_pins(1, 6)
    assert client.call(Release(reply.lease_id)).released is True
    assert client.call(Renew(reply.lease_id, 1000)).renewed is False
    assert client.call(Renew(987654321, 1000)) .renewed is False
    assert_no_pins(shared)


def test_ttl_is_clamped_to_the_configured_maximum(make_worker) -> None:
    worker = make_worker("clamp", args=["--max-ttl-ms", "400"])
    with RpcClient(worker.endpoint, timeout_ms=5000) as c:
        reply = c.call(Resolve(_hashes(0, 4), 3_600_000))
        assert reply.reason == "ok" and reply.expires_in_ms <= 400
        worker.wait_pins(0, 0, timeout_s=5)
        worker.wait_pins(1, 0, timeout_s=5)
    worker.stop()


def test_pin_budget_answers_over_budget_and_is_given_back(shared: SourceWorker, client: RpcClient) -> None:
    a = client.call(Resolve(_hashes(0, 20), 30_000))
    b = client.call(Resolve(_hashes(0, 20), 30_000))
    c = client.call(Resolve(_hashes(0, 20), 30_000))
    try:
        assert (a.reason, a.matched) == ("ok", 20)
        assert (b.reason, b.matched) == ("ok", 20)
        assert (c.reason, c.matched) == ("ok", BUDGET - 40)  # cut to what the budget allows
        d = client.call(Resolve(_hashes(0, 4), 30_000))
        assert (d.reason, d.lease_id, d.matched) == ("over_budget", 0, 0)
        shared.wait_pins(0, BUDGET)
        shared.wait_pins(1, BUDGET)
    finally:
        for reply in (a, b, c):
            client.call(Release(reply.lease_id))
    again = client.call(Resolve(_hashes(0, 20), 30_000))
    assert (again.reason, again.matched) == ("ok", 20)
    client.call(Release(again.lease_id))
    assert_no_pins(shared)
    assert shared.state(0)["service"]["budget_available"] == BUDGET


# -- many clients -------------------------------------------------------------------------------


def test_concurrent_readers_from_four_processes(shared: SourceWorker, tmp_path: Path) -> None:
    specs = [{"hashes": 8, "start": 2 * i, "loops": 15} for i in range(4)]  # overlapping prefixes
    results = run_readers(shared.endpoint, tmp_path, specs)
    for result in results:
        assert result["ok"], result
        assert len(result["replies"]) == 15 and all(r["matched"] == 8 and r["released"] for r in result["replies"])
    leases = [r["lease_id"] for result in results for r in result["replies"]]
    assert len(set(leases)) == len(leases)
    assert_no_pins(shared)


def test_concurrent_resolves_from_four_clients_do_not_serialise(shared: SourceWorker) -> None:
    errors: list[BaseException] = []
    counts = [0] * 4
    stop_at = time.monotonic() + 2.0

    def loop(i: int) -> None:
        try:
            with RpcClient(shared.endpoint, timeout_ms=5000) as c:
                while time.monotonic() < stop_at:
                    reply = c.call(Resolve(_hashes(i, 10), 30_000))
                    # released before the check, so a failure here does not leave pins to the next tests
                    released = c.call(Release(reply.lease_id)).released if reply.lease_id else False
                    assert (reply.reason, reply.matched, released) == ("ok", 10, True)
                    counts[i] += 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert min(counts) > 20, counts  # each client made progress alongside the others
    assert_no_pins(shared)


# -- bad input ------------------------------------------------------------------------------------


def test_malformed_frames_answer_err_and_the_source_keeps_serving(shared: SourceWorker, client: RpcClient) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(shared.endpoint)
    try:
        bad = [
            b"\xc1garbage",
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 7}, "resolve", {"hashes": "nope", "ttl_ms": 5}]),
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 8}, "resolve", {"hashes": [b""], "ttl_ms": 5}]),
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 9}, "resolve", {"hashes": [b"x" * 33], "ttl_ms": 5}]),
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 10}, "resolve", {"hashes": [b"x"], "ttl_ms": 0}]),
            # well-formed bodies the envelope checks refuse (rank 0 forwards them before it decodes them)
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 14, "re": 3}, "resolve",
                           {"hashes": [_hashes(0, 1)[0]], "ttl_ms": 5000}]),
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 15, "x": 1}, "resolve",
                           {"hashes": [_hashes(0, 1)[0]], "ttl_ms": 5000}]),
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 11}, "no_such_message", {}]),
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 12}, "release", {"lease_id": True}]),
            msgpack.packb([{"v": PROTOCOL_VERSION + 1, "id": 13}, "ping", {}]),
        ]
        for frame in bad:
            sock.send(frame)
            assert sock.poll(5000), f"no answer to {frame[:40]!r}"
            header, kind, body = msgpack.unpackb(sock.recv(), raw=False)
            assert kind == "ERR", (frame, body)
        sock.send_multipart([b"a", b"b"])
        assert sock.poll(5000)
        assert msgpack.unpackb(sock.recv(), raw=False)[1] == "ERR"
    finally:
        sock.close(0)
    reply = client.call(Resolve(_hashes(0, 4), 30_000))
    assert reply.reason == "ok"
    client.call(Release(reply.lease_id))
    assert_no_pins(shared)


def test_sibling_socket_is_private_and_survives_garbage(shared: SourceWorker, client: RpcClient) -> None:
    ipc_dir = shared.ipc_dir
    assert (ipc_dir.stat().st_mode & 0o777) == 0o700
    sibling = f"ipc://{ipc_dir}/{shared.worker_id}_tp1.sock"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(sibling)
    try:
        sock.send(b"\x93\x00garbage")
        assert sock.poll(5000) and msgpack.unpackb(sock.recv(), raw=False)[1] == "ERR"
    finally:
        sock.close(0)
    with RpcClient(sibling, timeout_ms=5000) as direct:
        with pytest.raises(Exception) as info:  # rank 0's RPCs are not served on a sibling's socket
            direct.call(Resolve(_hashes(0, 1), 1000))
        assert "does not serve" in str(info.value)
    reply = client.call(Resolve(_hashes(0, 4), 30_000))
    assert reply.reason == "ok"
    client.call(Release(reply.lease_id))
    assert_no_pins(shared)


# -- failures ---------------------------------------------------------------------------------------


def test_frozen_sibling_fails_the_resolve_cleanly_and_the_source_recovers(make_worker) -> None:
    worker = make_worker("frozen", args=["--sibling-timeout-ms", "400", "--sibling-retry-after-ms", "300"])
    rank1 = worker.pid(1)
    with RpcClient(worker.endpoint, timeout_ms=5000) as c:
        os.kill(rank1, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(SourceError, match="TP rank 1"):
                c.call(Resolve(_hashes(0, 8), 30_000))
            assert time.monotonic() - t0 < 2.0
            worker.wait_pins(0, 0)  # rank 0's own pins were undone before the ERR
            t0 = time.monotonic()
            with pytest.raises(SourceError, match="failed recently"):  # no second wait for a rank that is down
                c.call(Resolve(_hashes(0, 8), 30_000))
            assert time.monotonic() - t0 < 0.2
            assert c.call(GetMetadata()).tp_size == 2  # everything else keeps answering
        finally:
            os.kill(rank1, signal.SIGCONT)
        worker.wait_pins(1, 0, timeout_s=5)  # the pin it finally ran was refused or released
        time.sleep(0.4)  # past --sibling-retry-after-ms
        reply = c.call(Resolve(_hashes(0, 8), 30_000))
        assert reply.reason == "ok" and reply.matched == 8
        assert c.call(Release(reply.lease_id)).released
    assert_no_pins(worker)
    worker.stop()


def test_a_stopped_source_says_afterwards_how_long_it_did_not_run(make_worker) -> None:
    """A process that gets no CPU cannot log while it lasts; the reaper's late wake-up says it after."""
    worker = make_worker("stopped", np=1)
    rank0 = worker.pid(0)
    assert worker.state(0)["service"]["max_wakeup_lag_s"] < 1.0
    os.kill(rank0, signal.SIGSTOP)
    try:
        time.sleep(1.5)
    finally:
        os.kill(rank0, signal.SIGCONT)
    st = worker.wait_state(0, lambda s: s["service"]["max_wakeup_lag_s"] >= 1.0, what="the lag recorded")
    assert st["service"]["max_wakeup_lag_s"] < 10.0
    deadline = time.monotonic() + 5
    while "this process did not run for" not in worker.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    said = re.findall(r"this process did not run for (\d+\.\d) s", worker.log())
    assert said and 1.0 <= float(said[0]) < 10.0, worker.log()
    with RpcClient(worker.endpoint, timeout_ms=5000) as c:
        assert c.call(GetMetadata()).tp_size == 1  # and it serves on
    worker.stop()


def test_sibling_killed_mid_resolve(make_worker) -> None:
    # Plain processes with a file-based start-up exchange: under mpiexec, hydra tears the whole job
    # down when a rank dies (even with -disable-auto-cleanup it SIGKILLs the survivors at times).
    worker = make_worker("killed", launcher="plain",
                         args=["--sibling-timeout-ms", "400", "--sibling-retry-after-ms", "300"])
    rank1 = worker.pid(1)
    with RpcClient(worker.endpoint, timeout_ms=5000) as c:
        warm = c.call(Resolve(_hashes(0, 8), 30_000))
        assert warm.reason == "ok"
        c.call(Release(warm.lease_id))
        worker.set_pin_delay(1, 3.0)  # rank 1 will sit inside find_and_pin when we kill it
        outcome: list[object] = []
        th = threading.Thread(target=lambda: outcome.append(_call(c, Resolve(_hashes(0, 8), 30_000))))
        th.start()
        time.sleep(0.15)
        os.kill(rank1, signal.SIGKILL)
        th.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], SourceError), outcome
        assert "TP rank 1" in str(outcome[0])
        worker.wait_pins(0, 0)
        assert worker.state(0)["service"]["leases_open"] == 0
        # The source keeps answering: metadata, releases, and resolves that fail cleanly.
        assert c.call(GetMetadata()).tp_size == 2
        assert c.call(Release(12345)).released is False
        assert c.ping().server.startswith("source-")
        for _ in range(2):
            time.sleep(0.35)  # past retry-after: rank 0 tries rank 1 again, and times out again
            with pytest.raises(SourceError, match="TP rank 1"):
                c.call(Resolve(_hashes(0, 8), 30_000))
            worker.wait_pins(0, 0)
    report = worker.stop(expect_done=[0])
    assert report["done"]["0"]["total_pins"] == 0


def _call(c: RpcClient, request: object) -> object:
    try:
        return c.call(request)
    except Exception as e:
        return e


def test_duplicate_worker_id_is_refused(make_worker, tmp_path: Path) -> None:
    first = make_worker("dup")
    # A second worker with the same id and IPC directory must not steal rank 1's socket.
    with pytest.raises(RuntimeError, match="served by another process"):
        SourceWorker(tmp_path / "dup2", first.worker_id, start_timeout_s=30,
                     args=["--ipc-dir", str(first.ipc_dir)])
    # The first one is unharmed.
    with RpcClient(first.endpoint, timeout_ms=5000) as c:
        reply = c.call(Resolve(_hashes(0, 4), 30_000))
        assert reply.reason == "ok"
        c.call(Release(reply.lease_id))
    first.stop()


# -- topologies ----------------------------------------------------------------------------------------


def test_tp1_worker_serves_without_siblings(make_worker, tmp_path: Path) -> None:
    worker = make_worker("tp1", np=1)
    [result] = run_readers(worker.endpoint, tmp_path, [{"hashes": 12, "loops": 2}])
    assert result["ok"], result
    assert list(result["replies"][0]["ranks"]) == ["0"]
    worker.wait_pins(0, 0)
    worker.stop()


def test_attention_dp_world_splits_into_tp_groups(make_worker, tmp_path: Path) -> None:
    # 4 world ranks, TP groups of 2: two independent workers, each allgathering only within its group.
    worker = make_worker("dp", np=4, groups=2, args=["--tp-size", "2"])
    md = {}
    for tag in ("-g0", "-g1"):
        with RpcClient(worker.endpoints[tag]["endpoint"], timeout_ms=5000) as c:
            md[tag] = c.call(GetMetadata())
    assert md["-g0"].worker_id.endswith("-g0") and md["-g1"].worker_id.endswith("-g1")
    for tag, m in md.items():
        assert m.tp_size == 2
        assert [r.agent_name for r in m.ranks] == [f"remote-g2-source-{m.worker_id}-tp{r}" for r in (0, 1)]
    [result] = run_readers(worker.endpoints["-g1"]["endpoint"], tmp_path, [{"hashes": 8}])
    assert result["ok"], result
    worker.stop()


def test_registry_sees_the_worker_and_its_blocks(make_worker) -> None:
    from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer

    server = RegistryServer(MemoryStore(lease_ttl_ms=3000), bind="tcp://127.0.0.1:0")
    endpoint = server.start()
    try:
        worker = make_worker("reg", args=["--registry", endpoint])
        with RegistryClient(endpoint) as reg:
            deadline = time.monotonic() + 10
            rec = None
            while time.monotonic() < deadline:
                rec = reg.worker_info(worker.worker_id)
                if rec is not None and rec.blocks == 32:
                    break
                time.sleep(0.05)
            assert rec is not None and rec.blocks == 32, rec
            assert rec.endpoint == worker.endpoint and rec.tp_size == 2 and rec.live
            found = reg.lookup(_hashes(0, 8))
            assert found.reason == "ok" and found.best.worker_id == worker.worker_id and found.matched == 8
            # The pool's stores and evictions stream to the registry.
            worker.command(0, [{"op": "store", "hashes": [40, 41]}, {"op": "remove", "hashes": [0]}])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                holders = reg.who_has([hash_of(40), hash_of(0)])
                if holders[hash_of(40)] == [worker.worker_id] and holders[hash_of(0)] == []:
                    break
                time.sleep(0.05)
            assert holders[hash_of(40)] == [worker.worker_id] and holders[hash_of(0)] == [], holders
            worker.stop()
            rec = reg.worker_info(worker.worker_id)
            assert rec is None or rec.blocks == 0  # shutdown told the registry the blocks are gone
    finally:
        server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_are_served_per_rank(make_worker) -> None:
    import urllib.request

    port = _free_port()
    worker = make_worker("metrics", args=["--metrics-port", str(port)])
    with RpcClient(worker.endpoint, timeout_ms=5000) as c:
        reply = c.call(Resolve(_hashes(0, 4), 30_000))
        c.call(Release(reply.lease_id))
        c.call(Resolve([hash_of(999)], 30_000))
    text0 = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'remote_g2_source_resolves_total{outcome="ok"} 1.0' in text0
    assert 'remote_g2_source_resolves_total{outcome="miss"} 1.0' in text0
    assert "remote_g2_source_leases_released_total 1.0" in text0
    assert "remote_g2_source_resolve_seconds_bucket" in text0
    assert 'remote_g2_source_progress_mode{mode="poll"} 1.0' in text0  # the default
    text1 = urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=5).read().decode()
    assert "remote_g2_source_blocks_pinned 0.0" in text1
    assert 'remote_g2_source_requests_total{outcome="ok",type="sibling_resolve"}' in text1  # forwarded as it arrived
    assert 'remote_g2_source_progress_mode{mode="poll"} 1.0' in text1
    worker.stop()


def test_sibling_refuses_a_pin_for_a_released_lease(shared: SourceWorker) -> None:
    """A sibling_pin that arrives after rank 0 gave up on the lease (and released it) pins nothing."""
    from remote_g2.protocol.messages import SiblingRelease

    sibling = f"ipc://{shared.ipc_dir}/{shared.worker_id}_tp1.sock"
    with RpcClient(sibling, timeout_ms=5000) as direct:
        assert direct.call(SiblingRelease(424242, b"o")).known is False
        with pytest.raises(SourceError, match="released"):
            direct.call(SiblingPin(424242, _hashes(0, 4), 30_000, b"o"))
    assert_no_pins(shared)


def test_sibling_checks_a_forwarded_resolve_frame_as_rank_0_does(shared: SourceWorker) -> None:
    """sibling_resolve pins only what a valid resolve frame asks for; any other frame pins nothing."""
    from remote_g2.errors import ProtocolError
    from remote_g2.protocol.messages import SiblingRelease, SiblingResolve
    from remote_g2.protocol.wire import encode_request

    sibling = f"ipc://{shared.ipc_dir}/{shared.worker_id}_tp1.sock"
    with RpcClient(sibling, timeout_ms=5000) as direct:
        refused = [
            encode_request(1, Release(5)),  # a valid frame of another type
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 2, "re": 1}, "resolve",
                           {"hashes": _hashes(0, 2), "ttl_ms": 5000}]),
            msgpack.packb([{"v": PROTOCOL_VERSION, "id": 3}, "resolve", {"hashes": [b"x" * 33], "ttl_ms": 5}]),
            b"\xc1garbage",
        ]
        for i, frame in enumerate(refused):
            with pytest.raises(ProtocolError):
                direct.call(SiblingResolve(777_000 + i, frame, b"o"))
        assert_no_pins(shared, ranks=(1,))
        reply = direct.call(SiblingResolve(777_100, encode_request(4, Resolve(_hashes(0, 3), 30_000)), b"o"))
        assert len(reply.block_ids) == 3
        shared.wait_pins(1, 3)
        assert direct.call(SiblingRelease(777_100, b"o")).known is True
    assert_no_pins(shared)
