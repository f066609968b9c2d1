"""The vLLM tier's holder side without vLLM: ChunkServer's validated leases over real ZMQ and a real NIXL agent.

A validated lease needs no engine step (adapters/vllm_tier/serving.py), so it runs here without vLLM: the
rows a holder stored, their generations, the release that says whether the bytes stood, who may release, and
the bound on open leases.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("nixl", reason="needs NIXL (make venv installs it)")

from remote_g2.adapters.vllm_tier.serving import ChunkServer  # noqa: E402
from remote_g2.messages import Release, Resolve  # noqa: E402
from remote_g2.rpc_client import RpcClient  # noqa: E402

ROW = 4096
HASHES = [bytes([i + 1]) * 32 for i in range(4)]  # (none all zeros: bytes(32) is held by nobody)


@pytest.fixture
def server():
    region = np.zeros((8, ROW), np.uint8)
    s = ChunkServer("holder", region.ctypes.data, ROW, 8, bind="tcp://127.0.0.1:0", validated=True, max_leases=3)
    s.held(HASHES, [5, 1, 2, 7])
    try:
        yield s
    finally:
        s.close()


def test_an_ask_is_answered_with_the_rows_of_the_longest_held_prefix(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as c:
        reply = c.call(Resolve(HASHES[:2] + [bytes(32)] + HASHES[3:], 5000, "r"))
        assert (reply.reason, reply.matched, list(reply.ranks[0].block_ids)) == ("ok", 2, [5, 1])
        assert c.call(Release(reply.lease_id)).released
        assert not c.call(Release(reply.lease_id)).released  # (ended: unknown now)
        assert c.call(Resolve([bytes(32)], 5000, "r")).reason == "miss"
    assert server.open_leases() == 0


def test_an_eviction_while_a_lease_is_open_makes_its_release_false(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as c:
        before = c.call(Resolve(HASHES, 5000, "r"))
        other = c.call(Resolve(HASHES[2:], 5000, "r"))
        server.let_go([HASHES[1]])  # the primary evicted one chunk of the first lease only
        assert not c.call(Release(before.lease_id)).released
        assert c.call(Release(other.lease_id)).released
        assert c.call(Resolve(HASHES, 5000, "r")).matched == 1  # the prefix now ends before it
        server.held([HASHES[1]], [1])  # stored again (vLLM may reuse the same row): a new lease is good again
        again = c.call(Resolve(HASHES, 5000, "r"))
        assert again.matched == 4 and c.call(Release(again.lease_id)).released
        reset = c.call(Resolve(HASHES, 5000, "r"))
        server.let_go_all()
        assert not c.call(Release(reset.lease_id)).released
        assert c.call(Resolve(HASHES, 5000, "r")).reason == "miss"


def test_only_the_connection_that_took_a_lease_releases_it(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as mine, RpcClient(server.endpoint) as theirs:
        lease = mine.call(Resolve(HASHES, 5000, "r")).lease_id
        assert not theirs.call(Release(lease)).released
        assert mine.call(Release(lease)).released


def test_open_leases_are_bounded_and_lapse(server: ChunkServer) -> None:
    with RpcClient(server.endpoint) as c:
        leases = [c.call(Resolve(HASHES, 300, "r")) for _ in range(3)]
        assert all(r.reason == "ok" for r in leases)
        assert c.call(Resolve(HASHES, 300, "r")).reason == "miss"  # max_leases=3: a reader never releasing
        time.sleep(0.4)  # past their TTL: swept, with no step
        assert server.open_leases() == 0 and server.lapsed == 3
        assert not c.call(Release(leases[0].lease_id)).released
        assert c.call(Resolve(HASHES, 300, "r")).reason == "ok"
