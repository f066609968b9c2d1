"""Registry consistency soak: 4 publishers stream events while 4 clients look up; every answer is checked.

The run and the check live in ``bench/registry/bench_registry_soak.py`` (its module
docstring states the invariant); here it runs for a bounded time on the memory
store and on a real redis-server, each behind a real ``remote-g2 serve``
process, with publishers and clients in their own processes. A unit test
first shows the check is not vacuous: it flags answers that break the
invariant in each way it can be broken.

``REMOTE_G2_SOAK_S`` sets the soak's seconds per store (default 8).
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SOAK_S = float(os.environ.get("REMOTE_G2_SOAK_S", "8"))


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """``bench.registry.bench_registry_soak`` (spawned processes import it by name, from the repository root)."""
    from bench.registry import bench_registry_soak

    return bench_registry_soak


def _publisher_log(events: list[tuple[float, int, int]], acks: list[tuple[float, int]]) -> dict[str, Any]:
    return {"ev_t": array("d", [e[0] for e in events]), "ev_chain": array("i", [e[1] for e in events]),
            "ev_len": array("i", [e[2] for e in events]), "ack_t": array("d", [a[0] for a in acks]),
            "ack_idx": array("q", [a[1] for a in acks])}


def _client_log(rows: list[tuple[int, int, int, float, float, int, int, int]]) -> dict[str, Any]:
    keys = ["pub", "chain", "k", "t_send", "t_recv", "reason", "owner", "matched"]
    codes = {"pub": "i", "chain": "i", "k": "i", "t_send": "d", "t_recv": "d", "reason": "b", "owner": "i",
             "matched": "i"}
    log = {key: array(codes[key], [row[i] for row in rows]) for i, key in enumerate(keys)}
    log["holders_ok"] = array("b", [1] * len(rows))
    return {"log": log, "errors": {}}


def test_check_flags_every_kind_of_wrong_answer(soak: ModuleType) -> None:
    ok, none = soak.REASONS.index("ok"), soak.REASONS.index("no_candidate")
    # Publisher 0, chain 0: grows to 10 (t=1, acked at t=2), shrinks to 4 (t=3, acked at t=4),
    # then grows to 7 (t=5, never acked).
    pubs = {0: _publisher_log([(1.0, 0, 10), (3.0, 0, 4), (5.0, 0, 7)], [(2.0, 1), (4.0, 2)]),
            1: _publisher_log([], [])}
    right = [
        (0, 0, 32, 2.5, 2.6, ok, 0, 10),    # acked 10, nothing newer queued
        (0, 0, 32, 2.5, 3.5, ok, 0, 4),     # the shrink was queued before the reply: either is right
        (0, 0, 32, 2.5, 3.5, ok, 0, 10),
        (0, 0, 6, 4.5, 5.5, ok, 0, 4),      # acked 4; 7 queued; asked 6 -> min(7, 6) = 6 or 4
        (0, 0, 6, 4.5, 5.5, ok, 0, 6),
        (0, 0, 32, 0.5, 0.9, none, -1, 0),  # before anything was queued
        (1, 3, 32, 9.0, 9.1, none, -1, 0),  # a publisher that never stored
        (soak.GHOST, 0, 32, 9.0, 9.1, none, -1, 0),
    ]
    wrong = [
        (0, 0, 32, 4.5, 4.6, ok, 0, 10),    # stale: 4 was acknowledged before the lookup was sent
        (0, 0, 32, 2.5, 2.6, ok, 0, 7),     # from the future: 7 was queued after the reply
        (0, 0, 32, 2.5, 2.6, none, -1, 0),  # acked 10, answered nobody
        (0, 0, 32, 2.5, 2.6, ok, 1, 10),    # the wrong worker
        (0, 0, 32, 2.5, 2.6, ok, soak.STRANGER, 10),
        (0, 0, 32, 4.5, 5.5, ok, 0, 5),     # never a state
        (0, 0, 32, 0.5, 0.9, ok, 0, 3),     # before anything was queued
        (soak.GHOST, 0, 32, 9.0, 9.1, ok, 0, 1),
        (0, 0, 32, 2.5, 2.6, soak.REASONS.index("incompatible_layout"), -1, 0),
    ]
    assert soak.check(pubs, [_client_log(right)], chains=4).violations == 0
    res = soak.check(pubs, [_client_log(right), _client_log(wrong)], chains=4)
    assert (res.lookups, res.violations, len(res.examples)) == (len(right) + len(wrong), len(wrong), len(wrong))
    # A store that applies a batch in steps may show any length the window spans: 5 passes, the rest still fail.
    assert soak.check(pubs, [_client_log(wrong)], chains=4, atomic=False).violations == len(wrong) - 1
    # ``cleared`` (chain -1) empties every chain of the publisher.
    pubs[1] = _publisher_log([(1.0, 2, 5), (2.0, -1, 0)], [(1.5, 1), (2.5, 2)])
    assert soak.check(pubs, [_client_log([(1, 2, 32, 1.6, 1.7, ok, 1, 5), (1, 2, 32, 3.0, 3.1, none, -1, 0)])],
                      chains=4).violations == 0
    assert soak.check(pubs, [_client_log([(1, 2, 32, 3.0, 3.1, ok, 1, 5)])], chains=4).violations == 1
    log = _client_log([(0, 0, 32, 2.5, 2.6, ok, 0, 10)])
    log["log"]["holders_ok"][0] = 0  # want_all_holders listed someone else, or another count
    assert soak.check(pubs, [log], chains=4).violations == 1


@pytest.mark.slow
@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_every_lookup_is_consistent_with_acknowledged_events(soak: ModuleType, store: str, tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    redis_url = request.getfixturevalue("redis_url") if store == "redis" else None
    spec = soak.SoakSpec(seconds=SOAK_S, publishers=4, clients=4)
    r = soak.run_soak(store, spec, redis_url=redis_url, workdir=str(tmp_path))
    summary = {k: r[k] for k in ("lookups", "violations", "lookups_per_s", "events_per_s", "block_events_per_s",
                                 "hits", "open_windows", "acks", "resyncs", "lookup_errors")}
    print(f"\nsoak {store}: {summary}")
    assert r["violations"] == 0, r["examples"]
    assert r["registry_alive"] and r["lookup_errors"] == {} and r["flush_timeouts"] == 0
    # Not vacuous: many lookups, most of them hits, many while the owner had unacknowledged events,
    # and every publisher acknowledged often and resynced mid-stream at least once overall.
    assert r["lookups"] >= 200 * SOAK_S and r["hits"] >= r["lookups"] // 2
    assert r["open_windows"] >= r["lookups"] // 10
    assert r["acks"] >= 4 * 20 * SOAK_S and r["events"] >= 1000 * SOAK_S
    assert r["resyncs"] > spec.publishers  # one per registration, plus the ones asked for mid-stream
