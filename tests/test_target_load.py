"""A load's states (target/load.py): the moves the coordinator may make, and the destination-block bookkeeping."""

from __future__ import annotations

import pytest

from remote_g2.target.load import Load, LoadState


def _load() -> Load:
    return Load(1, "req", [bytes([i]) * 8 for i in range(6)], [10, 11, 12, 13, 14, 15])


def test_a_classic_load_and_a_restarted_peer_load_move_through_their_states() -> None:
    load = _load()
    for state in (LoadState.RESOLVING, LoadState.READING, LoadState.RESOLVING, LoadState.READING,
                  LoadState.RELEASING, LoadState.DONE):
        load.enter(state)
    assert load.state is LoadState.DONE and load.state.finished
    peer = _load()
    peer.enter(LoadState.READING)  # the peer strategy hands out shares straight away
    peer.enter(LoadState.FAILED)
    assert peer.state.finished


@pytest.mark.parametrize(("path", "bad"), [
    ([], LoadState.RELEASING),                                        # nothing was read yet
    ([LoadState.RESOLVING], LoadState.DONE),                          # done before any rank read
    ([LoadState.READING, LoadState.DONE], LoadState.FAILED),          # reported twice
    ([LoadState.FAILED], LoadState.READING),                          # revived
    ([LoadState.RESOLVING], LoadState.RESOLVING),                     # resolved twice at once
])
def test_a_move_the_table_lacks_is_refused(path: list[LoadState], bad: LoadState) -> None:
    load = _load()
    for state in path:
        load.enter(state)
    with pytest.raises(RuntimeError, match=f"-> {bad.name}"):
        load.enter(bad)
    assert load.state is (path[-1] if path else LoadState.LOOKING_UP)


def test_the_prefix_kept_and_handed_back() -> None:
    load = _load()
    load.keep_prefix(4)
    assert (load.dst, load.invalid_tail) == ([10, 11, 12, 13], [14, 15])
    load.keep_prefix(2)  # a peer load's shortest share
    assert (load.dst, load.invalid_tail) == ([10, 11], [12, 13, 14, 15])
    load.lease.lease_id, load.errors, load.resolve_again = 7, ["rank 1: restarted"], True
    load.hand_back_tail()  # resolved again: every block is wanted again, nothing read, no lease
    assert (load.dst, load.invalid_tail, load.lease.lease_id, load.errors, load.resolve_again) == (
        [10, 11, 12, 13, 14, 15], [], 0, [], False)
    load.lease.granted(100.0, 4000)
    assert (load.lease.expires, load.lease.renew_at) == (104.0, 102.0)


def test_outcomes_keep_why_a_load_failed_until_taken_and_bound_what_nobody_takes() -> None:
    from remote_g2.target.outcomes import _MAX_ERRORS, Outcomes

    o = Outcomes()
    try:
        o.add("a", True, error="ignored: it did not fail")
        o.add("b", False, [3], error="rank 1: NIXL READ from x failed: NIXL_ERR_BACKEND")
        o.add("c", False, [4])
        assert o.take() == ({"a"}, {"b", "c"})
        assert o.take_errors() == {"b": "rank 1: NIXL READ from x failed: NIXL_ERR_BACKEND"}
        assert o.take_errors() == {}
        for i in range(_MAX_ERRORS + 10):
            o.add(f"r{i}", False, error="x")
        kept = o.take_errors()
        assert len(kept) == _MAX_ERRORS and f"r{_MAX_ERRORS + 9}" in kept and "r0" not in kept
    finally:
        o.close()
