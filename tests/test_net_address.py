"""The advertised-address rule (remote_g2/rpc/net_address.py) and where it is applied: source start-up,
registry registrations, a mirror's feed address. Across real hosts: tests/test_multihost.py."""

from __future__ import annotations

import pytest

from remote_g2.errors import ConfigError, RegistryError
from remote_g2.protocol.messages import LayoutFingerprint
from remote_g2.rpc.net_address import (
    advertised_endpoint,
    default_bind_host,
    is_loopback,
    is_wildcard,
    local_address_toward,
    reachable_elsewhere,
    split_tcp,
    with_host,
)
from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer
from remote_g2.registry.client.mirror import feed_endpoint_from

FP = LayoutFingerprint(model_id="tiny", dtype="bf16", tokens_per_block=16, kv_layout="HND",
                       num_layers=2, num_kv_heads=4, head_dim=32, tp_size=1)
NAMES = {"what": "source w", "bind_setting": "BIND", "advertise_setting": "ADVERTISE"}
REMOTE_REGISTRY = "tcp://10.200.0.1:7450"  # never dialled (at most a route is looked up: no packet is sent)


def test_hosts_are_classified_by_their_text() -> None:
    assert split_tcp("tcp://[::1]:80") == ("tcp", "::1", 80)
    assert split_tcp("tcp+stream://10.0.0.2:0") == ("tcp+stream", "10.0.0.2", 0)
    for bad in ("ipc:///tmp/x", "tcp://host", "tcp://h:port", "tcp://h:70000"):
        with pytest.raises(ConfigError):
            split_tcp(bad)
    assert with_host("tcp+stream://0.0.0.0:81", "10.0.0.2") == "tcp+stream://10.0.0.2:81"
    assert with_host("tcp://0.0.0.0:81", "fd00::2") == "tcp://[fd00::2]:81"
    assert all(is_wildcard(h) for h in ("0.0.0.0", "*", "::", "[::]", ""))
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"))
    assert not is_loopback("10.0.0.1") and not is_loopback("registry.internal")
    assert reachable_elsewhere("tcp://10.0.0.2:5") and reachable_elsewhere("tcp+stream://10.0.0.2:5")
    assert not any(reachable_elsewhere(e) for e in ("tcp://127.0.0.1:5", "tcp://0.0.0.0:5", "ipc:///x", "tcp://*:5"))


def test_the_route_toward_loopback_is_loopback_and_defaults_stay_private_on_one_box() -> None:
    assert local_address_toward("tcp://127.0.0.1:7450") == "127.0.0.1"
    assert default_bind_host(None) == default_bind_host("tcp://127.0.0.1:7450") == "127.0.0.1"
    assert default_bind_host("ipc:///run/registry.sock") == "127.0.0.1"
    # A name this host routes to itself (Debian maps its own name to 127.0.1.1) is this host: not refused.
    assert default_bind_host("tcp://localhost:7450") == "127.0.0.1"
    assert advertised_endpoint("tcp://127.0.0.1:5", advertise=None, toward="tcp://127.0.1.1:7450",
                               **NAMES) == "tcp://127.0.0.1:5"
    with pytest.raises(ConfigError, match="wildcard"):
        local_address_toward("tcp://0.0.0.0:7450")


def test_an_explicit_advertise_wins_but_never_a_wildcard_or_a_loopback_to_a_remote_registry() -> None:
    assert advertised_endpoint("tcp://0.0.0.0:7460", advertise="tcp://10.0.0.2:0", toward=REMOTE_REGISTRY,
                               **NAMES) == "tcp://10.0.0.2:7460"  # port 0: the bound one
    assert advertised_endpoint("tcp://0.0.0.0:7460", advertise="tcp://10.0.0.2:9000", toward=REMOTE_REGISTRY,
                               **NAMES) == "tcp://10.0.0.2:9000"  # a NAT's port is kept
    with pytest.raises(ConfigError, match="ADVERTISE=tcp://0.0.0.0:1 is a wildcard"):
        advertised_endpoint("tcp://10.0.0.2:1", advertise="tcp://0.0.0.0:1", toward=None, **NAMES)
    with pytest.raises(ConfigError, match="ADVERTISE=tcp://127.0.0.1:1 is a loopback.*10.200.0.1"):
        advertised_endpoint("tcp://0.0.0.0:1", advertise="tcp://127.0.0.1:1", toward=REMOTE_REGISTRY, **NAMES)
    # One box: a loopback advertise to a loopback registry is fine.
    assert advertised_endpoint("tcp://0.0.0.0:1", advertise="tcp://127.0.0.1:0", toward="tcp://127.0.0.1:7450",
                               **NAMES) == "tcp://127.0.0.1:1"


def test_a_loopback_bind_with_a_registry_elsewhere_is_refused_naming_the_settings() -> None:
    with pytest.raises(ConfigError, match="BIND=tcp://127.0.0.1:0 is a loopback.*Leave BIND unset.*ADVERTISE"):
        advertised_endpoint("tcp://127.0.0.1:0", advertise=None, toward=REMOTE_REGISTRY, **NAMES)
    assert advertised_endpoint("tcp://127.0.0.1:5", advertise=None, toward="tcp://127.0.0.1:7450",
                               **NAMES) == "tcp://127.0.0.1:5"
    assert advertised_endpoint("tcp://10.0.0.2:5", advertise=None, toward=REMOTE_REGISTRY,
                               **NAMES) == "tcp://10.0.0.2:5"


def test_a_wildcard_bind_advertises_the_route_toward_whoever_is_told() -> None:
    assert advertised_endpoint("tcp://0.0.0.0:5", advertise=None, toward="tcp://127.0.0.1:7450",
                               **NAMES) == "tcp://127.0.0.1:5"
    with pytest.raises(ConfigError, match="nobody to find a route toward; set ADVERTISE"):
        advertised_endpoint("tcp://0.0.0.0:5", advertise=None, toward=None, **NAMES)


def test_a_source_that_others_could_not_dial_refuses_to_start_before_binding_anything(tmp_path) -> None:
    from remote_g2.adapters.host_pool import HostPool
    from remote_g2.source import SourceConfig, start_source_service
    from source_procs.pattern import make_layout

    pool = HostPool(make_layout(8))
    cfg = SourceConfig(enabled=True, registry_endpoint=REMOTE_REGISTRY, fingerprint=FP, bind="tcp://127.0.0.1:0",
                       ipc_dir=str(tmp_path))
    with pytest.raises(Exception, match="REMOTE_G2_SOURCE_BIND=tcp://127.0.0.1:0 is a loopback address"):
        start_source_service(pool, worker_id="w", tp_size=1, config=cfg)
    with pytest.raises(Exception, match="REMOTE_G2_SOURCE_ADVERTISE=tcp://0.0.0.0:0 is a wildcard"):
        start_source_service(pool, worker_id="w", tp_size=1,
                             config=SourceConfig(enabled=True, advertise="tcp://0.0.0.0:0", ipc_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="advertise must be a tcp://"):
        SourceConfig(advertise="ipc:///x")


def test_the_registry_refuses_a_wildcard_endpoint_and_keeps_serving() -> None:
    server = RegistryServer(MemoryStore(lease_ttl_ms=5000), bind="tcp://127.0.0.1:0")
    endpoint = server.start()
    try:
        with RegistryClient(endpoint, timeout_s=5) as c:
            with pytest.raises(RegistryError, match="wildcard address no target can dial"):
                c.register_worker("w", "tcp://0.0.0.0:9001", FP, epoch=1)
            assert c.worker_info("w") is None
            # A registry on loopback: every party is on this host, a loopback endpoint is right.
            assert c.register_worker("w", "tcp://127.0.0.1:9001", FP, epoch=1).next_seq == 1
        from prometheus_client import generate_latest

        text = generate_latest(server.metrics.registry).decode()
        assert 'remote_g2_registry_endpoint_checks_total{verdict="refused"} 1.0' in text
    finally:
        server.close()


def test_the_registry_judges_loopback_endpoints_by_where_it_is_reached_from() -> None:
    from remote_g2.registry.server.service import endpoint_verdict

    assert endpoint_verdict("tcp://127.0.0.1:9001", "tcp://10.200.0.1:7450") == "loopback"  # refused
    assert endpoint_verdict("tcp://[::1]:9001", "tcp://0.0.0.0:7450") == "flagged"  # maybe a same-host source
    assert endpoint_verdict("tcp://127.0.0.1:9001", "tcp://127.0.0.1:7450") is None
    assert endpoint_verdict("tcp://127.0.0.1:9001", "ipc:///run/registry.sock") is None
    assert endpoint_verdict("tcp://*:9001", "tcp://127.0.0.1:7450") == "wildcard"
    assert endpoint_verdict("tcp://10.200.0.2:9001", "tcp://10.200.0.1:7450") is None
    assert endpoint_verdict("ipc:///run/src.sock", "tcp://10.200.0.1:7450") is None


def test_a_mirror_dials_a_wildcard_feed_at_the_host_it_reaches_the_registry_at() -> None:
    assert feed_endpoint_from("tcp://10.200.0.1:7450", "tcp://0.0.0.0:7451") == "tcp://10.200.0.1:7451"
    assert feed_endpoint_from("tcp://10.200.0.1:7450", "tcp://10.200.0.1:7451") == "tcp://10.200.0.1:7451"
    assert feed_endpoint_from("tcp://127.0.0.1:7450", "tcp://127.0.0.1:7451") == "tcp://127.0.0.1:7451"
    with pytest.raises(RegistryError, match="loopback address this host cannot reach.*--feed-bind"):
        feed_endpoint_from("tcp://10.200.0.1:7450", "tcp://127.0.0.1:7451")
    with pytest.raises(RegistryError, match="publishes no change feed"):
        feed_endpoint_from("tcp://10.200.0.1:7450", "")


def test_feed_advertise_is_what_mirrors_are_told() -> None:
    server = RegistryServer(MemoryStore(lease_ttl_ms=5000), bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0",
                            feed_advertise="tcp://10.200.0.1:0")
    endpoint = server.start()
    try:
        port = split_tcp(server.feed.endpoint)[2]  # type: ignore[union-attr]
        with RegistryClient(endpoint, timeout_s=5) as c:
            assert c.feed_info().endpoint == f"tcp://10.200.0.1:{port}"
    finally:
        server.close()
