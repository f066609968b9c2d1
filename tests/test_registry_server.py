"""The registry server, client, publisher and admin CLI over real ZMQ sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq

from remote_g2.cli import main
from remote_g2.errors import ConfigError, RpcTimeout, StaleEpoch
from remote_g2.protocol.messages import BlockEvent, LayoutFingerprint
from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer, SourcePublisher
from remote_g2.protocol.wire import PROTOCOL_VERSION

FP = LayoutFingerprint(model_id="tiny", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=2, num_kv_heads=4, head_dim=32, tp_size=2)
CHAIN = [i.to_bytes(8, "big") for i in range(1, 65)]


@pytest.fixture
def registry():
    server = RegistryServer(MemoryStore(lease_ttl_ms=2000), bind="tcp://127.0.0.1:0", sweep_interval_s=0.1)
    endpoint = server.start()
    client = RegistryClient(endpoint, timeout_s=5)
    yield server, client
    client.close()
    server.close()


def scrape(server: RegistryServer) -> str:
    from prometheus_client import generate_latest

    return generate_latest(server.metrics.registry).decode()


def test_round_trip_of_every_message(registry):
    server, c = registry
    assert c.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=1).next_seq == 1
    assert c.heartbeat("w1", 1, load=3).status == "ok"
    assert c.events("w1", 1, 1, [BlockEvent("stored", CHAIN[:10])]).expected_seq == 2
    r = c.lookup(CHAIN[:12], want_all_holders=True)
    assert (r.reason, r.matched, r.best.worker_id, r.best.endpoint) == ("ok", 10, "w1", "tcp://127.0.0.1:9001")
    assert [h.worker_id for h in r.holders] == ["w1"]
    assert c.lookup(CHAIN[:3], requester="w1").reason == "source_is_target"
    assert c.resync("w1", 1, 5, CHAIN[:4], first=True, last=True).stored == 4
    assert c.who_has([CHAIN[0], CHAIN[9]]) == {CHAIN[0]: ["w1"], CHAIN[9]: []}
    assert c.worker_info("w1").load == 3 and c.worker_info("nobody") is None
    assert [w.worker_id for w in c.list_workers()] == ["w1"]
    s = c.stats()
    assert (s.store, s.workers_live, s.block_entries, s.lookups, s.lookup_hits, s.events_ingested) == \
        ("memory", 1, 4, 2, 1, 10)
    assert c.drain_worker("w1").removed_blocks == 4
    assert c.ping().server == "registry"
    with pytest.raises(StaleEpoch):
        c.register_worker("w2", "tcp://127.0.0.1:9002", FP, epoch=5)
        c.register_worker("w2", "tcp://127.0.0.1:9002", FP, epoch=4)


def test_a_client_registers_a_source_and_nothing_else(registry):
    """Only the server's own KV-event ingest lists an events-only worker: over the wire it is refused."""
    from remote_g2.errors import RegistryError
    from remote_g2.protocol.messages import RegisterWorker

    server, c = registry
    with pytest.raises(RegistryError, match="registers a source"):
        c._call(RegisterWorker("w9", "tcp://127.0.0.1:9009", FP, 1, kind="events-only"))
    assert c.worker_info("w9") is None
    c.register_worker("w9", "tcp://127.0.0.1:9009", FP, epoch=1)
    assert c.worker_info("w9").kind is None


def test_a_source_s_messages_carry_no_kind_so_a_registry_that_predates_kinds_decodes_them():
    from remote_g2.protocol.messages import RegisterWorker, WorkerRecord
    from remote_g2.protocol.schema import encoder_for

    assert "kind" not in encoder_for(RegisterWorker)(RegisterWorker("w1", "tcp://127.0.0.1:9001", FP, 1))
    rec = WorkerRecord("w1", "tcp://127.0.0.1:9001", 1, 2, FP, True, 100, 0, 0, 0, 0)
    assert "kind" not in encoder_for(WorkerRecord)(rec)
    assert encoder_for(RegisterWorker)(RegisterWorker("w1", "e", FP, 1, kind="events-only"))["kind"] == "events-only"


def test_metrics_count_lookups_events_and_bad_frames(registry):
    server, c = registry
    c.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=1)
    c.events("w1", 1, 1, [BlockEvent("stored", CHAIN[:5])])
    c.lookup(CHAIN[:5])
    c.lookup([b"\x99"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    for bad in (b"junk", msgpack.packb([{"v": PROTOCOL_VERSION, "id": 1}, "lookup", {"hashes": [b"x" * 33]}])):
        sock.send(bad)
        assert sock.poll(5000)
        assert msgpack.unpackb(sock.recv())[1] == "ERR"
    sock.close()
    assert c.ping().server == "registry"  # still serving
    text = scrape(server)
    assert "remote_g2_registry_lookups_total 2.0" in text
    assert "remote_g2_registry_lookup_hits_total 1.0" in text
    assert 'remote_g2_registry_block_events_total{source="rpc"} 5.0' in text
    assert 'remote_g2_registry_errors_total{kind="bad_request"} 2.0' in text
    assert 'remote_g2_registry_lookup_reasons_total{reason="no_candidate"} 1.0' in text
    assert "remote_g2_registry_lookup_seconds_bucket" in text
    deadline = time.monotonic() + 5
    while "remote_g2_registry_workers_live 1.0" not in scrape(server):  # set by the sweeper thread
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_dead_worker_is_hidden_then_swept(registry):
    server, c = registry
    c.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=1)
    c.events("w1", 1, 1, [BlockEvent("stored", CHAIN[:3])])
    time.sleep(2.2)  # lease is 2 s and nobody heartbeats
    assert c.lookup(CHAIN[:3]).reason == "no_candidate"
    deadline = time.monotonic() + 5
    while c.worker_info("w1") is not None:
        assert time.monotonic() < deadline, "sweeper did not remove the dead worker"
        time.sleep(0.05)
    assert c.stats().block_entries == 0


def snapshot_of(pool: set[bytes]):
    return lambda: sorted(pool)


def test_publisher_batches_heartbeats_and_resyncs(registry):
    server, c = registry
    pool: set[bytes] = set()
    pub = SourcePublisher(RegistryClient(server.endpoint), worker_id="src", endpoint="tcp://127.0.0.1:9100",
                          fingerprint=FP, snapshot=snapshot_of(pool), load=lambda: 7, flush_interval_s=0.01,
                          heartbeat_interval_s=0.2).start()
    try:
        for h in CHAIN[:40]:
            pool.add(h)
            pub.stored([h])
        assert pub.flush(5)
        assert c.lookup(CHAIN[:40]).matched == 40
        pool.difference_update(CHAIN[20:])
        pub.removed(CHAIN[20:])
        assert pub.flush(5)
        assert c.lookup(CHAIN[:40]).matched == 20
        time.sleep(2.5)  # > lease: only heartbeats keep it alive
        rec = c.worker_info("src")
        assert rec.live and rec.load == 7
        # The registry forgets the worker: the publisher registers anew and resyncs its pool.
        c.drain_worker("src")
        pool.add(CHAIN[20])
        pub.stored([CHAIN[20]])
        deadline = time.monotonic() + 5
        while c.lookup(CHAIN[:40]).matched != 21:
            assert time.monotonic() < deadline, "publisher did not recover after drain"
            time.sleep(0.05)
        assert pub.registrations == 2 and pub.resyncs >= 2
    finally:
        pub.close()
        pub.client.close()


def test_publisher_spaces_batches_under_a_stream_but_not_after_a_quiet_spell(registry):
    """With ``min_batch_interval_s``, a steady stream of events goes in batches at most that often; a lone event after
    a quiet spell goes ``flush_interval_s`` after it; ``flush()`` sends at once."""
    server, c = registry
    pool: set[bytes] = set()
    pub = SourcePublisher(RegistryClient(server.endpoint), worker_id="spaced", endpoint="tcp://127.0.0.1:9101",
                          fingerprint=FP, snapshot=snapshot_of(pool), flush_interval_s=0.01,
                          min_batch_interval_s=1.0).start()
    try:
        assert pub.flush(5)  # registered (its empty pool resynced)
        t0 = time.monotonic()
        pool.add(CHAIN[0])
        pub.stored([CHAIN[0]])
        while c.lookup(CHAIN[:1]).matched != 1:
            assert time.monotonic() - t0 < 0.5, "a lone event waited for the batch interval"
            time.sleep(0.005)
        sent, t_stream = pub.batches_sent, time.monotonic()
        for h in CHAIN[1:61]:  # 60 events over >= 1.2 s
            pool.add(h)
            pub.stored([h])
            time.sleep(0.02)
        in_stream = pub.batches_sent - sent
        # (one batch a second at most: a slow machine only makes fewer; without the interval, one every ~10 ms)
        assert in_stream <= 1 + int(time.monotonic() - t_stream), (in_stream, time.monotonic() - t_stream)
        assert pub.flush(5) and c.lookup(CHAIN[:61]).matched == 61
    finally:
        pub.close()
        pub.client.close()


def test_publisher_waits_out_a_registry_that_is_down():
    store = MemoryStore(lease_ttl_ms=5000)
    probe = RegistryServer(store, bind="tcp://127.0.0.1:0")
    endpoint = probe.start()
    probe.close()  # the port is free again: the registry is "down"
    pool = set(CHAIN[:8])
    pub = SourcePublisher(RegistryClient(endpoint, timeout_s=0.2), worker_id="src", endpoint="tcp://127.0.0.1:1",
                          fingerprint=FP, snapshot=snapshot_of(pool), flush_interval_s=0.01).start()
    try:
        pub.stored(CHAIN[:8])
        assert not pub.flush(0.5)
        server = RegistryServer(store, bind=endpoint)
        server.start()
        try:
            assert pub.flush(10)
            with RegistryClient(endpoint) as c:
                assert c.lookup(CHAIN[:8]).matched == 8
        finally:
            server.close()
    finally:
        pub.close()
        pub.client.close()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_admin_cli(registry, capsys):
    server, c = registry
    ep = server.endpoint
    c.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=1)
    c.register_worker("w2", "tcp://127.0.0.1:9002", FP, epoch=1)
    c.events("w1", 1, 1, [BlockEvent("stored", CHAIN[:4])])
    c.events("w2", 1, 1, [BlockEvent("stored", CHAIN[:2])])
    hexes = [h.hex() for h in CHAIN[:4]]

    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "workers", "--json")
    doc = json.loads(out)
    assert code == 0 and [w["worker_id"] for w in doc] == ["w1", "w2"]
    assert {"worker_id", "endpoint", "tp_size", "epoch", "live"} <= set(doc[0]) and doc[0]["live"] is True
    assert doc[0]["kind"] == "source"
    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "workers")
    assert "worker_id" in out and "tcp://127.0.0.1:9002" in out

    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "who-has", *hexes[1:3], "--json")
    assert json.loads(out) == {hexes[1]: ["w1", "w2"], hexes[2]: ["w1"]}
    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "who-has", "0x" + hexes[0].upper())
    assert "w1, w2" in out

    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "prefix", *hexes, "--json")
    assert json.loads(out)["worker_id"] == "w1" and json.loads(out)["matched"] == 4
    assert json.loads(out)["reason"] == "ok"
    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "prefix", *hexes, "--holders")
    assert "best: w1" in out and "4/4" in out
    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "prefix", "ff" * 8, "--json")
    assert json.loads(out) == {"worker_id": None, "endpoint": None, "tp_size": None, "matched": 0, "asked": 1,
                               "reason": "no_candidate"}

    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "worker", "w2", "--json")
    assert json.loads(out)["blocks"] == 2
    assert run_cli(capsys, "admin", "--registry", ep, "worker", "nope")[0] == 1
    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "stats", "--json")
    assert json.loads(out)["workers_live"] == 2
    code, out, _ = run_cli(capsys, "admin", "--registry", ep, "drain", "w2", "--json")
    assert json.loads(out) == {"worker_id": "w2", "existed": True, "removed_blocks": 2}

    code, _, err = run_cli(capsys, "admin", "--registry", ep, "who-has", "xyz")
    assert code == 2 and "not a hex block hash" in err


def test_admin_feed(capsys):
    with RegistryServer(MemoryStore(), bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0") as server:
        with RegistryClient(server.endpoint) as c:
            c.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=1)
        code, out, _ = run_cli(capsys, "admin", "--registry", server.endpoint, "feed", "--json")
        doc = json.loads(out)
        assert code == 0 and doc["endpoint"] == server.feed.endpoint and doc["seq"] == 1 and doc["mirror"] == "off"
        code, out, _ = run_cli(capsys, "admin", "--registry", server.endpoint, "feed")
        assert server.feed.endpoint in out and server.feed.instance in out
    with RegistryServer(MemoryStore(), bind="tcp://127.0.0.1:0") as server:
        code, out, _ = run_cli(capsys, "admin", "--registry", server.endpoint, "feed")
        assert code == 0 and "publishes no change feed" in out


def test_admin_cli_unreachable_registry_is_one_line(capsys):
    code, out, err = run_cli(capsys, "admin", "--registry", "tcp://127.0.0.1:1", "--timeout-s", "0.2", "workers")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "RpcTimeout" in err and "list_workers" in err


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_runs_until_sigterm(tmp_path):
    port, mport = free_port(), free_port()
    script = Path(sys.executable).parent / "remote-g2"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "remote_g2.cli"]
    proc = subprocess.Popen(cmd + ["serve", "--bind", f"tcp://127.0.0.1:{port}", "--metrics-port", str(mport),
                                   "--lease-ttl-s", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "REMOTE_G2_LOG_LEVEL": "WARNING"})
    try:
        line = proc.stdout.readline()
        assert f"serving on tcp://127.0.0.1:{port}" in line and "store: memory" in line
        assert "change feed on tcp://127.0.0.1:" in line  # on by default, on a free port of the bind's host
        with RegistryClient(f"tcp://127.0.0.1:{port}") as c:
            assert c.register_worker("w", "tcp://127.0.0.1:5", FP, 1).lease_ttl_ms == 3000
            assert c.feed_info().endpoint in line and c.feed_info().seq == 1
        body = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        assert 'remote_g2_registry_requests_total{outcome="ok",type="register_worker"} 1.0' in body
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_feed_bind_settings():
    from remote_g2.registry.server.serve_command import feed_endpoint

    assert feed_endpoint("tcp://10.0.0.5:7450", "auto") == "tcp://10.0.0.5:0"
    assert feed_endpoint("tcp://127.0.0.1:7450", "none") is None
    assert feed_endpoint("tcp://127.0.0.1:7450", "tcp://127.0.0.1:7451") == "tcp://127.0.0.1:7451"
    with pytest.raises(ConfigError, match="--feed-bind"):
        feed_endpoint("ipc:///tmp/reg.sock", "auto")


def test_serve_command_rejects_bad_settings(capsys):
    assert main(["serve", "--lease-ttl-s", "0"]) == 2
    assert "--lease-ttl-s" in capsys.readouterr().err
    assert main(["serve", "--curve-allowed-clients", "/tmp"]) == 2
    assert main(["serve", "--mirror-lookups"]) == 2  # the embedded store answers from memory already
    assert "--mirror-lookups is for Redis stores" in capsys.readouterr().err
    assert main(["serve", "--mirror-peers", "tcp://127.0.0.1:7451"]) == 2
    assert "--mirror-peers needs --mirror-lookups" in capsys.readouterr().err


def test_client_timeout_names_the_call():
    with RegistryClient("tcp://127.0.0.1:1", timeout_s=0.1) as c, pytest.raises(RpcTimeout, match="lookup"):
        c.lookup(CHAIN[:1])


@pytest.mark.redis
def test_two_servers_on_one_redis_give_the_same_answers(redis_url):
    from remote_g2.registry import open_store

    servers = [RegistryServer(open_store(redis_url=redis_url, lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0")
               for _ in range(2)]
    a, b = (RegistryClient(s.start()) for s in servers)
    try:
        a.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=1)
        b.register_worker("w2", "tcp://127.0.0.1:9002", FP, epoch=1)
        a.events("w1", 1, 1, [BlockEvent("stored", CHAIN[:8])])
        b.events("w2", 1, 1, [BlockEvent("stored", CHAIN[:5])])
        # w1's next batch goes through the *other* server: the sequence lives in Redis.
        assert b.events("w1", 1, 2, [BlockEvent("stored", CHAIN[8:10])]).status == "ok"
        ra, rb = (c.lookup(CHAIN[:12], want_all_holders=True) for c in (a, b))
        assert ra.holders == rb.holders and [(h.worker_id, h.matched) for h in ra.holders] == [("w1", 10), ("w2", 5)]
        assert [w.worker_id for w in a.list_workers()] == [w.worker_id for w in b.list_workers()] == ["w1", "w2"]
        assert a.stats().store == "redis"
    finally:
        for c in (a, b):
            c.close()
        for s in servers:
            s.close()
            s.store.close()


@pytest.mark.redis
def test_redis_outage_answers_store_unavailable_and_recovers(spawn_redis, capsys):
    from remote_g2.errors import StoreUnavailable
    from remote_g2.registry import open_store

    proc, url = spawn_redis()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    server = RegistryServer(open_store(redis_url=url, lease_ttl_ms=30_000), bind="tcp://127.0.0.1:0")
    client = RegistryClient(server.start(), timeout_s=10)
    try:
        client.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=1)
        proc.terminate()
        proc.wait(5)
        with pytest.raises(StoreUnavailable) as info:
            client.lookup(CHAIN[:4])
        assert info.value.remote == server.endpoint and "unreachable" in str(info.value)
        assert client.ping().server == "registry"  # the server itself keeps answering
        assert main(["admin", "--registry", server.endpoint, "workers"]) == 1  # one line, no traceback
        err = capsys.readouterr().err
        cli_lines = [line for line in err.splitlines() if line.startswith("remote-g2 admin")]
        assert len(cli_lines) == 1 and "StoreUnavailable" in cli_lines[0] and "Traceback" not in err
        assert 'remote_g2_registry_errors_total{kind="store_unavailable"} 2.0' in scrape(server)
        spawn_redis(port)  # Redis is back (empty: nothing persisted)
        assert client.lookup(CHAIN[:4]).reason == "no_candidate"
        assert client.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=2).new_incarnation
    finally:
        client.close()
        server.close()
        server.store.close()


@pytest.mark.cluster
def test_server_on_redis_cluster(redis_cluster_url):
    from remote_g2.registry import open_store

    server = RegistryServer(open_store(redis_cluster_url=redis_cluster_url, lease_ttl_ms=10_000),
                            bind="tcp://127.0.0.1:0")
    try:
        with RegistryClient(server.start()) as c:
            c.register_worker("w1", "tcp://127.0.0.1:9001", FP, epoch=1)
            c.events("w1", 1, 1, [BlockEvent("stored", CHAIN)])
            r = c.lookup(CHAIN)
            assert (r.best.worker_id, r.matched) == ("w1", len(CHAIN))
            assert c.stats().store == "redis-cluster"
    finally:
        server.close()
        server.store.close()


def test_resync_chunks_cover_the_snapshot_once():
    from remote_g2.registry.stores.contract import resync_chunks

    hashes = [i.to_bytes(8, "big") for i in range(10)]
    parts = resync_chunks(hashes, size=4)
    assert [(list(c), f, last) for c, f, last in parts] == [
        (hashes[0:4], True, False), (hashes[4:8], False, False), (hashes[8:10], False, True)]
    assert [(list(c), f, last) for c, f, last in resync_chunks([], size=4)] == [([], True, True)]


def test_wait_for_blocks_returns_what_the_registry_lists(registry):
    server, c = registry
    t0 = time.monotonic()
    assert c.wait_for_blocks("nobody", 1, timeout_s=0.2) == 0  # unknown worker: waits its timeout, lists none
    assert time.monotonic() - t0 >= 0.2
    c.register_worker("w-wait", "tcp://127.0.0.1:1", FP, epoch=1)
    c.events("w-wait", 1, 1, [BlockEvent("stored", CHAIN[:5])])
    assert c.wait_for_blocks("w-wait", 5, timeout_s=5) == 5
    assert c.wait_for_blocks("w-wait", 6, timeout_s=0.1) == 5  # never reached: the count it lists
