"""How one target rank's peer share is asked and taken together (target/peer_share.py), without processes.

The processes' side — every TP pairing resolving its shares with the source
ranks it reads, byte for byte — is in ``test_target_mpi.py``; failures in
``test_target_failures.py``.
"""

from __future__ import annotations

from remote_g2.errors import RpcTimeout
from remote_g2.protocol.messages import GatherSlot, GatherWish, PeerResolve, PeerResolveReply, RankBlocks
from remote_g2.target.peer_share import combine, share_request

H = [bytes([i]) * 32 for i in range(4)]


def _ok(matched: int, epoch: int = 7, expires: int = 900, staged: list[GatherSlot] | None = None) -> PeerResolveReply:
    return PeerResolveReply("ok", matched, epoch, expires, list(range(10, 10 + matched)), staged or [])


def test_a_rank_asks_under_the_leaders_id_plus_its_rank_and_stages_its_own_part_alone():
    ask = PeerResolve(1000, H, 5000, "me", GatherWish(4, 2))
    mine = share_request(ask, 3)
    assert (mine.lease_id, mine.hashes, mine.ttl_ms) == (1003, H, 5000)
    assert mine.gather == GatherWish(4, 2, target_rank=3)
    assert share_request(PeerResolve(1000, H, 5000), 2).gather is None


def test_shares_of_several_source_ranks_load_the_shortest_prefix_they_all_pinned():
    slot = GatherSlot(0, 4096, 512, 4, 8192, 2)
    got = combine({1: _ok(4, expires=800), 0: _ok(3, staged=[slot])}, 7, "w")
    assert got.error == "" and got.matched == 3 and got.expires_in_ms == 800
    assert got.ranks == [RankBlocks(0, [10, 11, 12], [slot]), RankBlocks(1, [10, 11, 12], [])]
    assert got.pinned == [0, 1]


def test_one_source_rank_that_fails_fails_the_share_and_names_what_the_others_pinned():
    miss = PeerResolveReply("miss", 0, 7, 0)
    got = combine({0: _ok(4), 1: miss}, 7, "w")
    assert got.error == "peer_resolve on w rank 1: miss" and not got.peer_failed and got.pinned == [0]
    got = combine({0: RpcTimeout("no reply"), 1: _ok(2)}, 7, "w")
    assert got.peer_failed and "RpcTimeout" in got.error and got.pinned == [1]
    got = combine({0: _ok(4), 1: _ok(4, epoch=8)}, 7, "w")
    assert got.restarted and "restarted" in got.error and got.pinned == [0, 1]
