"""Access rules of a source, with a real TP=1 source service (real NIXL agent, real sockets).

* a lease can be released or renewed only over the connection that resolved it;
* the only memory registered with NIXL is the G2 pool;
* every descriptor a resolve hands out lies inside the pool and covers a block pinned for that lease.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from remote_g2.adapters.host_pool import HostPool
from remote_g2.messages import BlockLayout, Release, Renew, Resolve
from remote_g2.rpc_client import RpcClient
from remote_g2.source import SourceConfig, start_source_service

pytestmark = [pytest.mark.nixl]

LAYOUT = BlockLayout(num_blocks=32, block_bytes=4096, num_layers=2, kv=2, num_kv_heads=2, tokens_per_block=16,
                     head_dim=8, dtype_bytes=2, order="HND")
HASHES = [i.to_bytes(8, "big") for i in range(1, 17)]


@pytest.fixture
def source() -> Iterator[tuple[object, HostPool]]:
    pool = HostPool(LAYOUT)
    pool.store(HASHES)
    service = start_source_service(pool, worker_id="access-test", tp_rank=0, tp_size=1,
                                   config=SourceConfig(enabled=True))
    try:
        yield service, pool
    finally:
        service.shutdown()


def test_only_the_resolving_connection_can_release_or_renew_its_lease(source) -> None:  # type: ignore[no-untyped-def]
    service, pool = source
    with RpcClient(service.endpoint) as owner, RpcClient(service.endpoint) as rogue:
        lease = owner.call(Resolve(HASHES[:4], 10_000, "owner"))
        assert lease.reason == "ok" and pool.stats()["total_pins"] == 4
        # Another client that learned (or guessed) the id gets the same answer as for an unknown lease.
        assert rogue.call(Release(lease.lease_id)).released is False
        assert rogue.call(Renew(lease.lease_id, 10_000)).renewed is False
        assert pool.stats()["total_pins"] == 4  # still pinned: the owner's READ is safe
        assert owner.call(Renew(lease.lease_id, 10_000)).renewed is True
        assert owner.call(Release(lease.lease_id)).released is True
        assert pool.stats()["total_pins"] == 0
        # The rogue's own lease is its own.
        mine = rogue.call(Resolve(HASHES[:2], 10_000, "rogue"))
        assert owner.call(Release(mine.lease_id)).released is False
        assert rogue.call(Release(mine.lease_id)).released is True


def test_nixl_sees_only_the_pool_and_descriptors_cover_pinned_blocks_inside_it(source) -> None:  # type: ignore[no-untyped-def]
    service, pool = source
    region, = pool.regions()
    assert service._agent.registered == [(region.base, region.nbytes, "DRAM")]  # nothing but the G2 pool
    with RpcClient(service.endpoint) as client:
        reply = client.call(Resolve(HASHES[3:12] + [b"\xff" * 8], 10_000, "t"))
        assert reply.reason == "ok" and reply.matched == 9  # the unknown hash ends the prefix
        info, = reply.metadata
        assert (info.pool_base, info.pool_bytes) == (region.base, region.nbytes)
        blocks, = reply.ranks
        assert len(blocks.block_ids) == 9
        for b in blocks.block_ids:
            assert 0 <= b and (b + 1) * info.layout.block_bytes <= info.pool_bytes  # inside the pool
            assert pool.pin_count(b) == 1  # pinned, for this lease
        assert [pool.lookup(h) for h in HASHES[3:12]] == list(blocks.block_ids)
        client.call(Release(reply.lease_id))
    assert pool.stats()["total_pins"] == 0
