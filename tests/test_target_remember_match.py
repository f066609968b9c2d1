"""``TargetClient.remember_match``: a lookup answered elsewhere (vLLM's scheduler process) skips the leader's own.

A real TP-1 target client in this process (memcpy transfer, a real registry
server that holds nothing): an answer handed over is used by ``start_load``
without a registry round trip — its load goes straight to the resolve (here
against a port nobody serves, so it fails there, not at lookup) — while a
load without one looks up and finds nothing; answers that could not serve
the load are refused and change nothing.
"""

from __future__ import annotations

import logging
import re

import pytest

from remote_g2.adapters.host_pool import HostPool
from remote_g2.errors import ConfigError
from remote_g2.protocol.messages import BlockLayout, LayoutFingerprint
from remote_g2.target import TargetConfig, TargetMatch, start_target_client

DEAD = "tcp://127.0.0.1:9"  # discard port: nothing answers a resolve there


def _client(registry: str):  # noqa: ANN202 - a TargetClient
    layout = BlockLayout(num_blocks=8, block_bytes=2 * 2 * 4 * 16 * 8 * 4, num_layers=2, kv=2, num_kv_heads=4,
                         tokens_per_block=16, head_dim=8, dtype_bytes=4, order="HND")
    fp = LayoutFingerprint(model_id="m", dtype="float32", tokens_per_block=16, kv_layout="HND", num_layers=2,
                           num_kv_heads=4, head_dim=8, tp_size=1)
    config = TargetConfig(enabled=True, registry_endpoint=registry, transfer="memcpy", fingerprint=fp,
                          rpc_timeout_ms=300, transfer_timeout_ms=1000)
    return start_target_client(HostPool(layout, pin_memory=False), tp_rank=0, tp_size=1, worker_id="t-remember",
                               config=config)


def _failures(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    out = {}
    for rec in caplog.records:
        m = re.match(r"load of (\S+) failed after [\d.]+ ms: (.*)", rec.getMessage())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_a_remembered_match_goes_straight_to_the_resolve_and_bad_ones_are_refused(
        registry: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="remote_g2.target")
    hashes = [bytes([i]) * 32 for i in range(2)]
    client = _client(registry)
    try:
        # Answers that could not serve a load of these two blocks are refused.
        assert not client.remember_match(hashes, TargetMatch(0, "no_candidate"))
        assert not client.remember_match(hashes, TargetMatch(1, "ok", "src", DEAD, 1))  # shorter than the load
        assert not client.remember_match(hashes, TargetMatch(2, "ok", "src", DEAD, 3))  # 4 kv heads over TP 3
        assert not client.remember_match(hashes, TargetMatch(2, "ok", "src", None, 1))  # nowhere to resolve
        assert not client.remember_match([], TargetMatch(2, "ok", "src", DEAD, 1))
        # A usable one (a TP-2 source of the same model: heterogeneous TP is fine).
        assert client.remember_match(hashes, TargetMatch(5, "ok", "src", DEAD, 2))
        client.start_load("remembered", hashes, [0, 1])
        client.start_load("looked-up", [bytes([9]) * 32], [2])
        failed: set[str] = set()
        for _ in range(50):
            if client.wait_finished(0.2):
                failed |= client.get_finished()[1]
            if failed == {"remembered", "looked-up"}:
                break
        assert failed == {"remembered", "looked-up"}
        assert client.invalid_block_ids() == {0, 1, 2}
        why = _failures(caplog)
        assert why["looked-up"].startswith("lookup: no_candidate"), why
        assert why["remembered"].startswith("resolve on src"), why  # it never asked the registry
        with pytest.raises(ConfigError, match="shut down"):
            client.shutdown()
            client.remember_match(hashes, TargetMatch(2, "ok", "src", DEAD, 1))
    finally:
        client.shutdown()


def test_lookups_move_past_a_registry_of_the_failover_list_that_does_not_answer(
        registry: str, caplog: pytest.LogCaptureFixture) -> None:
    """``REMOTE_G2_REGISTRY`` as a failover list whose first server never answers: the engine's ``lookup``
    and the coordinator's own lookup (a ``start_load`` with no answer remembered) each wait out one
    ``rpc_timeout_ms`` there, then ask the next server, which stays in use."""
    caplog.set_level(logging.WARNING, logger="remote_g2.target")
    client = _client(f"{DEAD},{registry}")
    try:
        assert client.lookup([bytes([7]) * 32]).reason == "no_candidate"  # answered: not a registry_error
        client.start_load("looked-up", [bytes([8]) * 32], [0])
        failed: set[str] = set()
        for _ in range(50):
            if client.wait_finished(0.2):
                failed |= client.get_finished()[1]
            if failed:
                break
        assert failed == {"looked-up"}
        assert _failures(caplog)["looked-up"].startswith("lookup: no_candidate"), _failures(caplog)
        assert sum("looking up at" in r.getMessage() for r in caplog.records) == 1  # the coordinator moved once
    finally:
        client.shutdown()
