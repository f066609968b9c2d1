"""Errors, hashing, config, logging: the small shared pieces."""

from __future__ import annotations

import logging
import os

import pytest

from remote_g2 import errors
from remote_g2.config import (
    ClientSettings, env_fields, env_fingerprint, env_flag, env_flag_or_none, env_float, env_int, env_positive, env_str,
    env_word,
)
from remote_g2.identity.hashing import (
    chain_block_hashes,
    check_block_hash,
    hash_from_hex,
    hash_to_hex,
    hash_to_u64,
    u64_to_hash,
)
from remote_g2.log import configure_logging, cpu_set_text


def test_every_error_is_a_remote_g2_error_and_registered_by_name():
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, errors.RemoteG2Error)
            assert errors.error_class_for(name) is obj
    assert issubclass(errors.RpcTimeout, errors.TransportError)
    assert issubclass(errors.LinkClosed, errors.TransportError)
    # Not a TransportError: the sibling was not called, so it must not count as one that did not answer.
    assert issubclass(errors.SiblingUnavailable, errors.SourceError)
    assert not issubclass(errors.SiblingUnavailable, errors.TransportError)
    assert issubclass(errors.BlockPinnedError, ValueError)


def test_duplicate_error_names_are_refused():
    with pytest.raises(TypeError, match="duplicate"):
        type("SourceError", (errors.RemoteG2Error,), {})


def test_remote_errors_say_where_they_came_from():
    e = errors.SourceError("lease gone", remote="tcp://h:1")
    assert str(e) == "lease gone (from tcp://h:1)"
    r = errors.RemoteError("boom", name="InternalError", remote="tcp://h:1")
    assert str(r).startswith("InternalError: boom")


def test_hash_helpers():
    assert u64_to_hash(1) == b"\x00" * 7 + b"\x01"
    assert hash_to_u64(u64_to_hash(2**64 - 1)) == 2**64 - 1
    assert hash_to_hex(b"\xab\x01") == "ab01"
    assert hash_from_hex("0xAB01") == b"\xab\x01"
    for bad in ("", "zz", "00" * 33):
        with pytest.raises(ValueError):
            hash_from_hex(bad)
    with pytest.raises(ValueError):
        u64_to_hash(-1)
    with pytest.raises(ValueError):
        check_block_hash("ab")
    with pytest.raises(ValueError):
        hash_to_u64(b"\x00")


def test_chain_hash_equal_prefixes_equal_hashes():
    a = chain_block_hashes(list(range(40)), 16)
    b = chain_block_hashes(list(range(32)) + [99] * 8, 16)
    c = chain_block_hashes([7] + list(range(1, 40)), 16)
    assert len(a) == 2 and all(len(h) == 8 for h in a)  # the partial third block is not hashed
    assert a == b  # same two full blocks
    assert c[0] != a[0] and c[1] != a[1]  # a changed first block changes every later hash
    assert chain_block_hashes(list(range(32)), 16, extra_keys=b"lora-1") != a
    assert chain_block_hashes(list(range(16, 32)), 16, parent=a[0]) == a[1:]
    assert len(chain_block_hashes(list(range(16)), 16, digest_size=32)[0]) == 32


def test_env_parsing_is_strict():
    assert env_flag("X", {"X": "yes"}) and not env_flag("X", {})
    with pytest.raises(errors.ConfigError):
        env_flag("X", {"X": "maybe"})
    assert env_float("T", 5.0, {}) == 5.0
    with pytest.raises(errors.ConfigError):
        env_float("T", 5.0, {"T": "-1"})
    s = ClientSettings.from_env({"REMOTE_G2_REGISTRY": "tcp://127.0.0.1:9", "REMOTE_G2_RPC_TIMEOUT_MS": "250"})
    assert s.registry_endpoint == "tcp://127.0.0.1:9" and s.rpc_timeout_ms == 250.0


def test_env_helpers_tell_unset_from_set_and_name_the_variable():
    assert env_int("N", {}) is None and env_int("N", {"N": " "}) is None and env_int("N", {"N": " 42 "}) == 42
    with pytest.raises(errors.ConfigError, match="N='4x' is not an integer"):
        env_int("N", {"N": "4x"})
    assert env_str("S", {}) is None and env_str("S", {"S": ""}) is None and env_str("S", {"S": "a"}) == "a"
    assert env_flag("F", {}, default=None) is None and env_flag("F", {"F": "off"}, default=None) is False
    assert env_fingerprint("FP", {}) is None
    with pytest.raises(errors.ConfigError, match="FP is not JSON"):
        env_fingerprint("FP", {"FP": "{"})
    with pytest.raises(errors.ConfigError, match="FP must be an object with fields"):
        env_fingerprint("FP", {"FP": '{"colour": 1}'})


def test_an_env_table_reads_the_set_variables_into_fields_and_the_first_malformed_one_is_the_error():
    table = (("A", "a", env_int), ("B", "b", env_flag_or_none), ("C", "c", env_positive), ("D", "d", env_word))
    assert env_fields(table, {}) == {}
    assert env_fields(table, {"A": " 3 ", "B": "off", "C": "0.5", "D": " Poll ", "E": "x"}) == {
        "a": 3, "b": False, "c": 0.5, "d": "poll"}
    assert env_fields(table, {"A": "", "D": "  "}) == {}
    with pytest.raises(errors.ConfigError, match="A='x' is not an integer"):
        env_fields(table, {"A": "x", "B": "maybe"})
    with pytest.raises(errors.ConfigError, match="C must be positive"):
        env_fields(table, {"C": "-1"})


def test_target_config_reads_integers_and_fingerprint_from_env():
    from remote_g2.target import TargetConfig

    fp = ('{"model_id": "m", "dtype": "bf16", "tokens_per_block": 16, "kv_layout": "HND", "num_layers": 2, '
          '"num_kv_heads": 8, "head_dim": 64, "tp_size": 2}')
    cfg = TargetConfig.from_env(env={"REMOTE_G2_TARGET_LEASE_TTL_MS": "5000", "REMOTE_G2_TARGET_PEER_RESOLVE": "0",
                                     "REMOTE_G2_TARGET_FINGERPRINT": fp})
    assert cfg.lease_ttl_ms == 5000 and cfg.peer_resolve is False and cfg.fingerprint.model_id == "m"
    assert TargetConfig.from_env(env={}).peer_resolve is True
    with pytest.raises(errors.ConfigError, match="REMOTE_G2_TARGET_TIMEOUT_MS"):
        TargetConfig.from_env(env={"REMOTE_G2_TARGET_TIMEOUT_MS": "soon"})


def test_log_level_override(monkeypatch):
    monkeypatch.setenv("REMOTE_G2_LOG_LEVEL", "debug")
    assert configure_logging() == logging.DEBUG
    with pytest.raises(errors.ConfigError):
        configure_logging("chatty")
    configure_logging("WARNING")


def test_cpu_sets_are_logged_as_ranges():
    assert cpu_set_text([0]) == "0"
    assert cpu_set_text([8, 0, 1, 2, 3]) == "0-3,8"
    assert cpu_set_text([5, 3, 4, 1, 1]) == "1,3-5"
    assert cpu_set_text([]) == "none"
    assert cpu_set_text() == cpu_set_text(os.sched_getaffinity(0))  # default: this thread's own


def test_target_registry_mirror_setting_from_the_environment():
    from remote_g2.target import TargetConfig

    assert TargetConfig.from_env({}).registry_mirror is False
    assert TargetConfig.from_env({"REMOTE_G2_TARGET_REGISTRY_MIRROR": "1"}).registry_mirror is True
    with pytest.raises(errors.ConfigError, match="REMOTE_G2_TARGET_REGISTRY_MIRROR"):
        TargetConfig.from_env({"REMOTE_G2_TARGET_REGISTRY_MIRROR": "maybe"})


def test_an_endpoint_setting_names_one_server_or_a_failover_list_and_moves_past_the_failed_one() -> None:
    from remote_g2.rpc.endpoint_list import EndpointRotation, endpoint_list

    assert endpoint_list("tcp://a:1") == ["tcp://a:1"]
    assert endpoint_list(" tcp://a:1, tcp://b:2,,tcp://a:1 ") == ["tcp://a:1", "tcp://b:2"]  # blanks, repeats
    with pytest.raises(errors.ConfigError, match="no endpoint"):
        endpoint_list(" , ")
    assert endpoint_list("ipc:///run/r.sock,tcp://[::1]:7450") == ["ipc:///run/r.sock", "tcp://[::1]:7450"]
    # A bad entry anywhere in the list is refused up front, not when a failover first dials it.
    for bad, why in (("tcp://a:1,bogus", "neither tcp://HOST:PORT"), ("tcp://a:1,tcp://b", "not tcp://HOST:PORT"),
                     ("tcp://a:99999", "not tcp://HOST:PORT"), ("tcp://*:7450", "cannot connect"),
                     ("ipc://", "path is empty")):
        with pytest.raises(errors.ConfigError, match=why):
            endpoint_list(bad)
        with pytest.raises(errors.ConfigError, match=why):
            EndpointRotation(bad)
    servers = EndpointRotation("tcp://a:1,tcp://b:2")
    assert servers.current == "tcp://a:1"
    assert servers.failed("tcp://a:1") == "tcp://b:2"
    assert servers.failed("tcp://a:1") == "tcp://b:2"  # a late report of the one already left changes nothing
    assert servers.failed("tcp://b:2") == "tcp://a:1"  # round the list


def test_start_on_every_rank_checks_the_worker_id_and_shuts_down_a_part_whose_start_failed():
    from remote_g2.tp.start import start_on_every_rank

    class Part:
        def __init__(self, group, fail: bool) -> None:
            self.group, self.fail, self.stopped = group, fail, False

        def start(self) -> None:
            if self.fail:
                raise RuntimeError("bind failed")

        def shutdown(self) -> None:
            self.stopped = True

    built: list[Part] = []

    def build(fail: bool):
        return lambda group: built.append(Part(group, fail)) or built[-1]

    part = start_on_every_rank(build(False), Part.start, worker_id="w", tp_rank=0, tp_size=1, comm=None)
    assert (part.group.rank, part.group.size, part.stopped) == (0, 1, False)
    with pytest.raises(RuntimeError, match="bind failed"):
        start_on_every_rank(build(True), Part.start, worker_id="w", tp_rank=None, tp_size=1, comm=None)
    assert built[-1].stopped
    for bad in ("", "w" * 129):
        with pytest.raises(errors.ConfigError, match="worker_id must be 1..128 characters"):
            start_on_every_rank(build(False), Part.start, worker_id=bad, tp_rank=0, tp_size=1, comm=None)
    assert len(built) == 2  # a bad id is refused before anything is built
