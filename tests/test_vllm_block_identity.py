"""The vLLM connector's block identity and fetch sharing, without vLLM (its config is read by attribute)."""

from __future__ import annotations

import pytest
import torch
from remote_g2.adapters.vllm import block_identity as bi
from remote_g2.adapters.vllm.fetches import FetchTable

from remote_g2.errors import ConfigError


def _fp(**kw: object) -> object:
    base = dict(model_id="m", dtype="float32", block_size=32, num_layers=2, num_kv_heads=2, head_dim=64,
                scheme="vllm/sha256/x")
    return bi.fingerprint(**{**base, **kw})


def test_sha256_is_shareable_without_a_seed_and_names_the_seed_it_uses() -> None:
    default = bi.hash_scheme("sha256", {})
    assert default.startswith("vllm/sha256/")
    assert bi.hash_scheme("sha256", {"PYTHONHASHSEED": "0"}) != default  # another seed: another hash space
    assert bi.hash_scheme("sha256_cbor", {}) != default


def test_xxhash_without_pythonhashseed_is_refused_with_what_to_set() -> None:
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        bi.hash_scheme("xxhash", {})
    seeded = bi.hash_scheme("xxhash", {"PYTHONHASHSEED": "1234"})
    assert "1234" not in seeded  # the secret seed never reaches the registry
    with pytest.raises(ConfigError, match="not one remote-g2 knows"):
        bi.hash_scheme("md5", {})


def test_dtype_is_the_tensors_and_auto_never_appears() -> None:
    assert bi.kv_dtype_name(torch.float16, "auto") == "float16"
    assert bi.kv_dtype_name(torch.bfloat16, "auto") == "bfloat16"
    assert bi.kv_dtype_name(torch.uint8, "fp8_e5m2") == "uint8/fp8_e5m2"
    assert bi.resolved_kv_dtype(torch.bfloat16, "auto") is torch.bfloat16
    assert bi.resolved_kv_dtype("float16", "auto") is torch.float16
    fp16, bf16 = _fp(dtype="float16"), _fp(dtype="bfloat16")
    assert fp16.compat_key() != bf16.compat_key()  # same size, different meaning: never matched


def test_every_byte_defining_field_changes_the_compat_key() -> None:
    base = _fp().compat_key()
    for kw in ({"model_id": "m2"}, {"dtype": "bfloat16"}, {"block_size": 16}, {"num_layers": 3},
               {"num_kv_heads": 4}, {"head_dim": 128}, {"scheme": "vllm/sha256/y"}):
        assert _fp(**kw).compat_key() != base, kw


def test_model_identity_includes_the_revision_or_the_override() -> None:
    assert bi.model_identity("org/m", None, None) == "org/m"
    assert bi.model_identity("org/m", "abc123", None) == "org/m@abc123"
    assert bi.model_identity("org/m", "abc123", "my-model-v2") == "my-model-v2"


def test_model_identity_tells_apart_configs_that_change_the_kv_and_ignores_volatile_keys() -> None:
    cfg = {"num_hidden_layers": 2, "rope_parameters": {"rope_theta": 10000.0}, "transformers_version": "5.1",
           "_name_or_path": "/a/m"}
    base = bi.model_identity("org/m", None, None, config=cfg)
    assert base.startswith("org/m#") and len(base) == len("org/m#") + 12
    other_rope = {**cfg, "rope_parameters": {"rope_theta": 500000.0}}  # e.g. an hf_overrides on one instance
    assert bi.model_identity("org/m", None, None, config=other_rope) != base
    assert bi.model_identity("org/m", None, None, config=cfg, quantization="fp8") != base
    same = {**cfg, "transformers_version": "5.2", "_name_or_path": "/b/m"}  # another install of the same model
    assert bi.model_identity("org/m", None, None, config=same) == base
    long = bi.model_identity("x" * 400, None, None, config=cfg)
    assert len(long) == 256 and long.endswith(base[-13:])  # a long name is cut, never the digest


def test_prompt_block_hashes_take_one_hash_per_block_even_when_vllm_hashes_finer() -> None:
    hashes = [bytes([i]) * 32 for i in range(10)]
    # one hash per 32-token block, 10 blocks of tokens; a 300-token prompt has 9 full blocks
    assert bi.prompt_block_hashes(hashes, 320, 300, 32) == hashes[:9]
    # hashed every 16 tokens (20 hashes for 320 tokens): each block's hash is its second one
    fine = [bytes([i]) * 32 for i in range(20)]
    assert bi.prompt_block_hashes(fine, 320, 300, 32) == [fine[2 * i + 1] for i in range(9)]
    assert bi.prompt_block_hashes(hashes[:3], 320, 300, 32) is None  # cannot tell: share nothing
    assert bi.prompt_block_hashes([], 10, 10, 32) == []


def test_requests_sharing_blocks_share_one_fetch_and_slots_return_after_the_last() -> None:
    t = FetchTable()
    h = [bytes([i]) * 32 for i in range(5)]
    no = [False] * 4
    assert t.to_fetch(h[:4], no) == 4
    r1, f1 = t.add("r1", h[:4], [10, 11, 12, 13], local=no, new_slots=[100, 101, 102, 103])
    assert f1 is not None and f1.hashes == h[:4]
    # r2 needs the first three and one more: only the new one is fetched
    assert t.to_fetch(h[:3] + [h[4]], no) == 1
    r2, f2 = t.add("r2", h[:3] + [h[4]], [20, 21, 22, 23], local=no, new_slots=[104])
    assert f2 is not None and f2.hashes == [h[4]]
    assert t.ended("r2", 1, failed=False) == []  # r2 still waits on r1's fetch
    ready = t.ended("r1", 2, failed=False)  # only two of r1's four arrived
    assert {ld.request_id for ld in ready} == {"r1", "r2"}
    assert r1.good_blocks() == 2 and r2.good_blocks() == 2  # r2's third block came from r1's failed part
    assert t.done(r1) == []  # r2 still needs r1's slots
    assert {f.fetch_id for f in t.done(r2)} == {"r1", "r2"}
    assert len(t) == 0 and not t.in_flight(h[0])


def test_local_blocks_are_not_fetched_and_an_all_local_request_is_ready_at_once() -> None:
    t = FetchTable()
    h = [bytes([i]) * 32 for i in range(3)]
    load, fetch = t.add("r", h, [1, 2, 3], local=[True] * 3, new_slots=[])
    assert fetch is None and t.ready_now() == [load] and load.good_blocks() == 3
    with pytest.raises(ValueError):
        t.add("r", h, [1, 2, 3], local=[True] * 3, new_slots=[])
    with pytest.raises(ValueError, match="slots given"):
        t.add("q", h, [1, 2, 3], local=[False] * 3, new_slots=[7])
    assert not t.in_flight(h[0])  # the refused add left nothing behind


def test_an_aborted_request_is_flagged_and_still_holds_its_slots_until_the_fetch_ends() -> None:
    t = FetchTable()
    h = [bytes([i]) * 32 for i in range(2)]
    load, _ = t.add("v", h, [5, 6], local=[False, False], new_slots=[50, 51])
    assert t.abort("v") and load.aborted and not t.abort("unknown")
    assert t.ended("v", 2, failed=False) == [load]
    assert [f.slots for f in t.done(load)] == [[50, 51]]
