"""The vLLM connector's block identity and fetch sharing, without vLLM (its config is read by attribute)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from remote_g2.adapters.vllm import block_identity as bi
from remote_g2.adapters.vllm.fetches import FetchTable

from remote_g2.errors import ConfigError
from remote_g2.identity.load_snapshot import MARGIN_NS, StartMark
from remote_g2.identity.model_identity import identity_of


def _after_writes() -> StartMark:
    """An engine that started after the test wrote its files (the after-start check is tested on its own)."""
    return StartMark(time.time_ns() + 2 * MARGIN_NS, "the test's engine started")


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


def _weights(d: Path, fill: bytes = b"\x01", *, shards: int = 2) -> Path:
    d.mkdir(parents=True)
    for i in range(shards):
        (d / f"model-0000{i + 1}-of-0000{shards}.safetensors").write_bytes(fill * 4096)
    (d / "config.json").write_text("{}")
    return d


def _configs(model: Path | str, *, load_format: str = "auto", config: dict | None = None, **mc: object):
    text = SimpleNamespace(to_dict=lambda: dict(config or {"num_hidden_layers": 2}))
    model_config = SimpleNamespace(**{"model": str(model), "revision": None, "hf_text_config": text,
                                      "dtype": torch.float32, "quantization": None, "model_impl": "auto",
                                      "trust_remote_code": False, **mc})
    return (model_config, SimpleNamespace(load_format=load_format, download_dir=None, model_loader_extra_config={}),
            SimpleNamespace(calculate_kv_scales=False))


def _identity(*args: object, override: str | None = None, **kw: object) -> bi.ModelIdentity:
    return bi.model_identity(*_configs(*args, **kw), override, digest_cache=None, mark=_after_writes())


def test_the_model_identity_is_the_loaded_weights_not_their_path(tmp_path: Path) -> None:
    a = _identity(_weights(tmp_path / "models" / "x"))
    copy = _identity(_weights(tmp_path / "mnt" / "cache" / "x"))  # the same bytes under another path
    assert a.model_id is not None and a.model_id.startswith(str(tmp_path / "models" / "x") + "#w-")
    assert identity_of(copy.model_id) == identity_of(a.model_id) and copy.model_id != a.model_id
    new = _identity(_weights(tmp_path / "v2", b"\x02"))  # new weights under a name: another identity
    assert identity_of(new.model_id) != identity_of(a.model_id)
    assert a.weights is not None and len(a.weights.files) == 2  # the shards, not config.json or the tokenizer


def test_options_that_change_k_or_v_change_the_identity_and_volatile_keys_do_not(tmp_path: Path) -> None:
    d = _weights(tmp_path / "m")
    cfg = {"num_hidden_layers": 2, "rope_parameters": {"rope_theta": 10000.0}, "transformers_version": "5.1",
           "_name_or_path": "/a/m"}
    base = identity_of(_identity(d, config=cfg).model_id)
    other_rope = {**cfg, "rope_parameters": {"rope_theta": 500000.0}}  # e.g. an hf_overrides on one instance
    assert identity_of(_identity(d, config=other_rope).model_id) != base
    for kw in ({"quantization": "fp8"}, {"load_format": "bitsandbytes"}, {"model_impl": "transformers"}):
        mc, lc, cc = _configs(d, config=cfg)
        for k, v in kw.items():
            setattr(lc if k == "load_format" else mc, k, v)
        assert identity_of(bi.model_identity(mc, lc, cc, digest_cache=None, mark=_after_writes()).model_id) != base, kw
    mc, lc, cc = _configs(d, config=cfg)
    mc.dtype = torch.bfloat16  # the model's dtype: K and V are computed in it (an fp8 cache stores the same type)
    assert identity_of(bi.model_identity(mc, lc, cc, digest_cache=None, mark=_after_writes()).model_id) != base
    same = {**cfg, "transformers_version": "5.2", "_name_or_path": "/b/m"}  # another install of the same model
    assert identity_of(_identity(d, config=same).model_id) == base


def test_generated_or_undigestable_weights_have_no_identity_and_say_why(tmp_path: Path) -> None:
    d = _weights(tmp_path / "m")
    dummy = _identity(d, load_format="dummy")
    assert dummy.model_id is None and "generated, not loaded (load_format='dummy')" in dummy.why_not
    streamed = _identity(d, load_format="tensorizer")
    assert streamed.model_id is None and "model_id setting" in streamed.why_not
    missing = _identity("org/not-on-this-host")
    assert missing.model_id is None and "not on this host's disk" in missing.why_not
    (tmp_path / "empty").mkdir()
    assert "no checkpoint files" in _identity(tmp_path / "empty").why_not


def test_the_model_id_setting_names_the_weights_instead_of_their_digest(tmp_path: Path) -> None:
    d = _weights(tmp_path / "m")
    o = _identity(d, override="llama-8b@r2")
    assert o.model_id is not None and o.model_id.startswith("llama-8b@r2#o-") and o.weights is None
    assert identity_of(_identity(d, override="llama-8b@r3").model_id) != identity_of(o.model_id)
    assert identity_of(o.model_id) != identity_of(_identity(d).model_id)
    # the override names the weights, not the options: another dtype still tells instances apart
    mc, lc, cc = _configs(d)
    mc.dtype = torch.float16
    assert identity_of(bi.model_identity(mc, lc, cc, "llama-8b@r2").model_id) != identity_of(o.model_id)
    # generated weights share nothing, even under an operator's name (each TP size generates others)
    assert _identity(d, load_format="dummy", override="test-model").model_id is None


def test_remote_code_is_part_of_a_trust_remote_code_model(tmp_path: Path) -> None:
    d = _weights(tmp_path / "m")
    (d / "modeling_x.py").write_text("ROPE = 1\n")
    trusted = _identity(d, trust_remote_code=True)
    plain = _identity(d)
    (d / "modeling_x.py").write_text("ROPE = 2\n")
    assert identity_of(_identity(d, trust_remote_code=True).model_id) != identity_of(trusted.model_id)
    assert identity_of(_identity(d).model_id) == identity_of(plain.model_id)


def test_gguf_and_bin_checkpoints_are_digested_whole(tmp_path: Path) -> None:
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 100)
    g = _identity(gguf, load_format="gguf")
    gguf.write_bytes(b"GGUF" + b"\x00" * 99 + b"\x01")
    assert identity_of(_identity(gguf, load_format="gguf").model_id) != identity_of(g.model_id)
    d = tmp_path / "bin"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"a" * 100)
    assert _identity(d).weights.files[0].path.endswith("pytorch_model.bin")
    assert _identity(d, load_format="safetensors").model_id is None  # that loader would find no file either


@pytest.mark.vllm
def test_a_hub_id_is_digested_from_its_local_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM downloaded the model into the hub cache: the snapshot's files are what it loaded."""
    pytest.importorskip("huggingface_hub")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    _weights(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mc, lc, cc = _configs("org/tiny")
    lc.download_dir = str(tmp_path / "hub")
    hub = bi.model_identity(mc, lc, cc, digest_cache=None, mark=_after_writes())
    assert hub.where == str(repo / "snapshots" / commit), hub.why_not
    local = _identity(_weights(tmp_path / "copy"))
    assert identity_of(hub.model_id) == identity_of(local.model_id)  # the hub's bytes, copied: the same model


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
