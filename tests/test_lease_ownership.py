"""A lease is its owner's on every rank and every transport: hostile clients, real processes.

A real TP=2 source worker (``mpiexec -n 2 tests/source_procs/source_rank.py``,
real NIXL agents, real ZMQ and stream-lane sockets) in three set-ups: the
stream lane (the default), ZMQ peer endpoints, and ZMQ with CURVE and an
allow-list of two client keys. The owner takes a lease; other clients that
know its id — a fresh connection to each endpoint, a second keyed client,
a ZMQ client presenting a lane connection's id or libzmq's own predictable
routing ids — try to end or extend every share. Pins are read from the
ranks' pools: they stay until the owner releases or the lease expires.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

import pytest
import zmq

from source_procs.harness import SourceWorker, have_mpiexec
from source_procs.pattern import hash_of
from zmq_clients import call_with_routing_id

from remote_g2.rpc.curve import CurveClientConfig, generate_keypair
from remote_g2.protocol.messages import (
    GetMetadata,
    PeerResolve,
    Release,
    ReleaseReply,
    Renew,
    RenewReply,
    Resolve,
    ResolveReply,
)
from remote_g2.rpc.client import RpcClient

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.nixl,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not in the venv (pip install mpich)"),
]

_ids = itertools.count(1)
_HOLD_S = 0.4  # how long pins must stay put after a hostile call (siblings act on a release within ms)


def _hashes(n: int, start: int = 0) -> list[bytes]:
    return [hash_of(start + i) for i in range(n)]


class Setup:
    """A running worker and how to reach it: ``client(endpoint)`` connects as a new, distinct client."""

    def __init__(self, worker: SourceWorker, keys: dict[str, CurveClientConfig] | None) -> None:
        self.worker = worker
        self.keys = keys
        self._clients: list[RpcClient] = []
        owner = self.client(worker.endpoint)
        meta = owner.call(GetMetadata())
        self.rank0_peer = meta.ranks[0].peer_endpoint or worker.endpoint
        self.rank1_peer = meta.ranks[1].peer_endpoint
        assert self.rank1_peer, meta.ranks

    def client(self, endpoint: str, key: str = "owner") -> RpcClient:
        curve = None if self.keys is None else self.keys[key]
        c = RpcClient(endpoint, timeout_ms=5000, curve=curve)
        self._clients.append(c)
        return c

    def hostile_endpoints(self) -> list[str]:
        return sorted({self.worker.endpoint, self.rank0_peer, self.rank1_peer})

    def close(self) -> None:
        for c in self._clients:
            c.close()

    def pins(self) -> list[int]:
        return [self.worker.wait_state(r, lambda s: True)["total_pins"] for r in (0, 1)]

    def assert_pins_hold(self, expect: list[int]) -> None:
        """The pools still hold ``expect`` pins after every sibling had time to act on what it was sent."""
        time.sleep(_HOLD_S)
        assert self.pins() == expect


@pytest.fixture(scope="module", params=["stream", "zmq", "curve"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    variant = request.param
    d = tmp_path_factory.mktemp(f"own-{variant}")
    args = ["--budget", "48", "--max-ttl-ms", "30000"]
    keys = None
    if variant == "curve":
        if not zmq.has("curve"):
            pytest.skip("libzmq without CURVE")
        _, server_secret = generate_keypair(d / "server", "server")
        allowed = d / "allowed"
        keys = {}
        for name in ("owner", "other"):
            public, secret = generate_keypair(d / name, name)
            allowed.mkdir(exist_ok=True)
            (allowed / public.name).write_bytes(public.read_bytes())
            keys[name] = CurveClientConfig.for_server(str(d / "server" / "server.key"), str(secret))
        args += ["--curve-secret", str(server_secret), "--curve-allowed", str(allowed), "--peer-transport", "zmq"]
    else:
        args += ["--peer-transport", variant]
    worker = SourceWorker(d / "worker", f"own-{variant}-{os.getpid()}", args=args)
    s = Setup(worker, keys)
    try:
        yield s
        s.close()
        report = worker.stop()
        assert all(v["total_pins"] == 0 for v in report["done"].values()), report
    finally:
        s.close()
        worker.kill()


def _attack(setup: Setup, lease_id: int) -> None:
    """Every other client there is tries to end and extend ``lease_id``, on every endpoint: all refused."""
    for endpoint in setup.hostile_endpoints():
        who = ["owner", "other"] if setup.keys is not None else ["owner"]
        for key in who:  # a new connection with the owner's own key, and (CURVE) another admitted key
            c = setup.client(endpoint, key)
            assert c.call(Release(lease_id)) == ReleaseReply(False), (endpoint, key)
            assert c.call(Renew(lease_id, 30_000)) == RenewReply(False, 0), (endpoint, key)


def test_a_resolve_lease_is_ended_or_extended_by_its_owner_alone_on_every_rank(setup: Setup) -> None:
    owner = setup.client(setup.worker.endpoint)
    reply = owner.call(Resolve(_hashes(8), 30_000))
    assert (reply.reason, reply.matched) == ("ok", 8)
    setup.worker.wait_pins(0, 8)
    setup.worker.wait_pins(1, 8)
    _attack(setup, reply.lease_id)
    setup.assert_pins_hold([8, 8])
    # The owner still can, and ends every rank's share.
    assert owner.call(Renew(reply.lease_id, 30_000)).renewed
    assert owner.call(Release(reply.lease_id)).released
    setup.worker.wait_pins(0, 0)
    setup.worker.wait_pins(1, 0)


def test_peer_shares_belong_to_the_connection_that_pinned_each(setup: Setup) -> None:
    lease_id = 10_000 + next(_ids)
    owner0 = setup.client(setup.rank0_peer)
    owner1 = setup.client(setup.rank1_peer)
    assert owner0.call(PeerResolve(lease_id, _hashes(6), 30_000)).matched == 6
    assert owner1.call(PeerResolve(lease_id, _hashes(5), 30_000)).matched == 5
    setup.worker.wait_pins(1, 5)
    _attack(setup, lease_id)
    setup.assert_pins_hold([6, 5])
    # Rank 0's owner ends rank 0's share only: rank 1's is its own pinner's.
    assert owner0.call(Release(lease_id)).released
    setup.assert_pins_hold([0, 5])
    assert owner1.call(Renew(lease_id, 30_000)).renewed
    assert owner1.call(Release(lease_id)).released
    setup.worker.wait_pins(1, 0)


def test_a_share_on_rank_0_taken_under_a_victims_id_cannot_end_the_victims_sibling_share(setup: Setup) -> None:
    """The victim's rank 0 share missed (nothing pinned there); an attacker takes rank 0's id and releases it."""
    lease_id = 20_000 + next(_ids)
    victim1 = setup.client(setup.rank1_peer)
    assert victim1.call(PeerResolve(lease_id, _hashes(4), 30_000)).matched == 4
    setup.worker.wait_pins(1, 4)
    attacker = setup.client(setup.worker.endpoint, "other" if setup.keys is not None else "owner")
    assert attacker.call(PeerResolve(lease_id, _hashes(3), 30_000)).matched == 3
    setup.worker.wait_pins(0, 3)
    assert attacker.call(Renew(lease_id, 30_000)).renewed
    assert attacker.call(Release(lease_id)).released  # its own share on rank 0...
    setup.assert_pins_hold([0, 4])  # ...and nothing of the victim's on rank 1
    assert victim1.call(Release(lease_id)).released
    setup.worker.wait_pins(1, 0)


def test_a_crafted_routing_id_cannot_touch_a_lane_connections_lease(setup: Setup) -> None:
    if setup.worker.endpoint == setup.rank0_peer:
        pytest.skip("no stream lane in this set-up")
    lease_id = 30_000 + next(_ids)
    lane = setup.client(setup.rank0_peer)  # tcp+stream://: the server numbers its connections
    assert lane.call(PeerResolve(lease_id, _hashes(5), 30_000)).matched == 5
    setup.worker.wait_pins(0, 5)
    # Whatever the lane calls its connections (formerly b"s" + an 8-byte counter), no routing id reaches them.
    for n in range(1, 40):
        for routing_id in (b"s" + n.to_bytes(8, "big"), b"s" + n.to_bytes(4, "big"), f"s{n}".encode()):
            assert call_with_routing_id(setup.worker.endpoint, routing_id, Release(lease_id), None) == ReleaseReply(False)
    setup.assert_pins_hold([5, 0])
    assert lane.call(Release(lease_id)).released
    setup.worker.wait_pins(0, 0)


def test_a_gone_owners_routing_id_does_not_carry_its_lease_and_pins_last_until_expiry(setup: Setup) -> None:
    """An owner that named its own routing id leaves; a client presenting the same id (on the descriptor the
    owner's connection freed) must not inherit the lease. It ends at its expiry."""
    curve = None if setup.keys is None else setup.keys["owner"]
    routing_id = b"victim-%d" % next(_ids)
    reply = call_with_routing_id(setup.worker.endpoint, routing_id, Resolve(_hashes(6, start=2), 2_000), curve)
    assert isinstance(reply, ResolveReply) and reply.reason == "ok"
    setup.worker.wait_pins(0, 6)
    for _ in range(3):
        assert call_with_routing_id(setup.worker.endpoint, routing_id, Release(reply.lease_id), curve) == ReleaseReply(False)
        assert call_with_routing_id(setup.worker.endpoint, routing_id, Renew(reply.lease_id, 30_000), curve) == RenewReply(False, 0)
    assert setup.pins() == [6, 6]
    setup.worker.wait_pins(0, 0, timeout_s=10)
    setup.worker.wait_pins(1, 0, timeout_s=10)
