"""Access rules of a source, with a real TP=1 source service (real NIXL agent, real sockets).

* a lease can be released or renewed only over the connection that resolved it;
* the only memory registered with NIXL is the G2 pool;
* every descriptor a resolve hands out lies inside the pool and covers a block pinned for that lease.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from remote_g2.adapters.host_pool import HostPool
from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer
from remote_g2.source import SourceConfig, start_source_service

from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.protocol.messages import BlockLayout, Release, Renew, Resolve
from remote_g2.rpc.client import RpcClient

pytestmark = [pytest.mark.nixl]

# A process that ran a NIXL agent without ever initialising MPI segfaults in NIXL/UCX's static
# destructors after Python has finished (exit code 139, every test passed). Sources run under MPI
# in production (the engines' launchers); initialising it here gives this in-process source the
# same teardown. Seen with nixl 1.5.1 / UCX as packaged on PyPI.
from mpi4py import MPI  # noqa: E402,F401

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
    staging = service.staging
    assert staging is not None
    # Nothing but the G2 pool and the rank's staging region (its own buffer, which only gathers write into).
    assert service._agent.registered == [(region.base, region.nbytes, "DRAM"), (staging.base, staging.nbytes, "DRAM")]
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


@pytest.mark.mpi
@pytest.mark.slow
def test_with_curve_keys_only_clients_holding_them_get_anything(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Registry and source TCP endpoints behind CURVE: a keyed target reuses remotely; others get nothing."""
    import random

    import zmq
    from remote_g2.adapters.reference.launch import EngineProcess

    from remote_g2.rpc.curve import CurveServerConfig, generate_keypair

    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    reg_pub, reg_secret = generate_keypair(tmp_path / "keys", "registry")
    src_pub, src_secret = generate_keypair(tmp_path / "keys", "sources")
    server = RegistryServer(MemoryStore(lease_ttl_ms=10_000), bind="tcp://127.0.0.1:0",
                            curve=CurveServerConfig.from_files(reg_secret))
    registry = server.start()
    prompt = [random.Random(9).randrange(1024) for _ in range(200)]
    reusable = (len(prompt) - 1) // 16
    engines = []
    try:
        source = EngineProcess("src", tp=1, args=["--source", "--registry", registry],
                               env={"REMOTE_G2_SOURCE_CURVE_SECRET_KEY": str(src_secret),
                                    "REMOTE_G2_CURVE_SERVER_KEY": str(reg_pub)})
        engines.append(source)
        src = source.client.generate("p", prompt, 3, cache="local")
        with RegistryClient(registry, curve=CurveClientConfig.for_server(str(reg_pub))) as reg:
            assert reg.wait_for_blocks("src", len(prompt) // 16, timeout_s=15) >= len(prompt) // 16, source.log_tail()
        keyed = EngineProcess("keyed", tp=1, args=["--target", "--registry", registry],
                              env={"REMOTE_G2_CURVE_SERVER_KEY": str(reg_pub),
                                   "REMOTE_G2_SOURCE_CURVE_SERVER_KEY": str(src_pub)})
        engines.append(keyed)
        r = keyed.client.generate("r", prompt, 3, cache="all")
        assert r.blocks_remote == reusable and (r.tokens, r.logits) == (src.tokens, src.logits)
        # No keys: the registry never answers it (lookups fail, it recomputes).
        keyless = EngineProcess("keyless", tp=1, args=["--target", "--registry", registry,
                                                       "--target-timeout-ms", "3000"],
                                env={"REMOTE_G2_TARGET_RPC_TIMEOUT_MS": "500"})
        engines.append(keyless)
        r = keyless.client.generate("r", prompt, 3, cache="all")
        assert r.blocks_remote == 0 and r.remote_reason == "registry_error"
        assert (r.tokens, r.logits) == (src.tokens, src.logits)
        # The registry's key but not the sources': the lookup works, the source never answers the resolve.
        half = EngineProcess("half", tp=1, args=["--target", "--registry", registry, "--target-timeout-ms", "3000"],
                             env={"REMOTE_G2_CURVE_SERVER_KEY": str(reg_pub), "REMOTE_G2_TARGET_RPC_TIMEOUT_MS": "500"})
        engines.append(half)
        r = half.client.generate("r", prompt, 3, cache="all")
        assert r.remote_reason == "ok" and r.blocks_remote == 0 and r.blocks_remote_failed == reusable
        assert (r.tokens, r.logits) == (src.tokens, src.logits)
    finally:
        for e in reversed(engines):
            e.stop()
        server.close()
