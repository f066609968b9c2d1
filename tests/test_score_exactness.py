"""The scorer's hashes are vLLM's, byte for byte, or the worker is said to be unscored.

* **Pickle memo.** vLLM pickles ``(parent, tokens, extra)`` whole: a key that
  is the same object as one written before it is a back-reference to that
  object's memo index *in the outer tuple* (the parent is 0, the token tuple 1).
  Which keys are one object is as vLLM's engine core holds them: decoded from
  msgpack, so equal keys share an object only where CPython shares it (the
  empty string, one Latin-1 character). The reference here is vLLM's
  ``hash_block_tokens`` written out (pickle / cbor2 of the outer tuple), its
  keys decoded by msgspec as the engine core decodes ``EngineCoreRequest``; the
  vLLM suite (``tests/test_vllm_score_hashing.py``) holds the same cases to
  real vLLM, and the pinned digests below are what vLLM 0.32 gave.
* **Hash unit.** A worker whose vLLM hashes more finely than its block
  (several KV-cache groups, ``prefix_match_unit``) publishes the last fine
  hash of each block, and names the unit in its scheme; the scorer hashes at
  that unit, or lists the worker as unscored with the reason.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import msgspec
import pytest

from remote_g2 import _vllm_hash
from remote_g2.errors import CannotScore
from remote_g2.protocol.messages import BlockEvent, Events, LayoutFingerprint, RegisterWorker
from remote_g2.registry import MemoryStore
from remote_g2.registry.scoring.scorer import Scorer, ScoreRequest
from remote_g2.identity.vllm_hashing import (
    DEFAULT_SEED,
    VllmBlockHasher,
    hasher_for_scheme,
    parse_scheme,
    scheme_name,
    with_hash_unit,
)


class _Lora(msgspec.Struct, array_like=True):
    lora_name: str
    lora_int_id: int
    lora_path: str


class _EngineKeys(msgspec.Struct, array_like=True):  # the parts of EngineCoreRequest the keys come from
    lora_request: _Lora | None
    cache_salt: str | None


def _as_engine_core_decodes(lora: tuple[str, str] | None, salt: str | None) -> _EngineKeys:
    wire = msgspec.msgpack.encode(_EngineKeys(_Lora(lora[0], 1, lora[1]) if lora else None, salt))
    return msgspec.msgpack.decode(wire, type=_EngineKeys)


def _vllm_chain(algo: str, tokens: list[int], bs: int, lora, salt) -> list[bytes]:
    """vLLM 0.32's get_request_block_hasher + hash_block_tokens + sha256/sha256_cbor, written out."""
    keys = _as_engine_core_decodes(lora, salt)
    encode = (lambda o: cbor2.dumps(o, canonical=True)) if algo == "sha256_cbor" else \
        (lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))
    parent = hashlib.sha256(encode(DEFAULT_SEED)).digest()
    out = []
    for i in range(len(tokens) // bs):
        lo = [("lora", keys.lora_request.lora_name, keys.lora_request.lora_path)] if keys.lora_request else []
        extra = lo + ([("cache_salt", keys.cache_salt)] if i == 0 and keys.cache_salt else [])
        parent = hashlib.sha256(encode((parent, tuple(tokens[i * bs:(i + 1) * bs]),
                                        tuple(extra) if extra else None))).digest()
        out.append(parent)
    return out


# Keys that are one object in vLLM's engine core (one-character Latin-1, empty) and keys that are not
# (longer, or above U+00FF), equal to each other or to the tags "lora" / "cache_salt", short and long.
MEMO_CASES = [
    (("a", "a"), None), (("a", "/p"), "a"), (("x", "a"), "a"), (("a", "a"), "a"), (("", "a"), "a"),
    (("ü", "ü"), "ü"), (("\x00", "\x00"), None), (("Ā", "Ā"), "Ā"), (("ab", "ab"), "ab"),
    (("lora", "/l"), "cache_salt"), (("cache_salt", "lora"), "lora"), (None, "a"),
    (("n" * 300, "n" * 300), "n" * 300), (("é" * 2000, "/x"), "é" * 2000),
]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("bs", [1, 3, 4, 16])
@pytest.mark.parametrize("lora, salt", MEMO_CASES)
def test_keys_that_are_one_object_in_vllm_hash_as_vllm_hashes_them(algo, bs, lora, salt):
    tokens = list(range(250, 250 + 3 * bs + 1))
    ours = VllmBlockHasher(algo, DEFAULT_SEED, bs).hashes(tokens, lora=lora, cache_salt=salt)
    assert ours == _vllm_chain(algo, tokens, bs, lora, salt)


@pytest.mark.parametrize("portable", [True, False])
def test_the_c_path_and_pickle_itself_agree_on_back_references(portable):
    """A body past pickle's frame target goes through pickle.dumps itself; below it, through the C++ chain: the
    same keys give the same chain either way (the memo offset is the C++ chain's contract too)."""
    _vllm_hash.set_portable(portable)
    try:
        tokens = list(range(70_000, 70_000 + 4096 * 2))
        hasher = VllmBlockHasher("sha256", DEFAULT_SEED, 4096)  # 5 bytes a token: past the frame target
        for lora, salt in MEMO_CASES:
            assert hasher.hashes(tokens, lora=lora, cache_salt=salt) == _vllm_chain("sha256", tokens, 4096, lora, salt)
        small = VllmBlockHasher("sha256", DEFAULT_SEED, 8)
        chain = small.hashes(tokens[:64], lora=("a", "a"), cache_salt="a")
        assert chain == small._chain_python(tokens[:64], 8, small.none_hash, (("lora", "a", "a"), ("cache_salt", "a")),
                                            (("lora", "a", "a"),))
    finally:
        _vllm_hash.set_portable(False)


def test_the_extra_keys_bytes_carry_the_outer_tuples_memo_indices():
    hasher = VllmBlockHasher("sha256", DEFAULT_SEED, 4)
    a = "a"
    # "lora" -> memo 2, "a" -> memo 3, the second "a" is BINGET 3 (pickled alone it would read BINGET 1)
    assert hasher._encode_extra((("lora", a, a),)) == b"\x8c\x04lora\x94\x8c\x01a\x94h\x03\x87\x94\x85\x94"
    assert hasher._encode_extra(None) == b"N"


@pytest.mark.parametrize("algo, first, second", [
    ("sha256", "3004150a3641b5e9daa16644342fdc57b7a8d2418f90a9633240e258ff25546b",
     "8165b9661a7bd1202db199b960de17552e44dd0d420b2d3b3f488ef5c3b12cb5"),
    ("sha256_cbor", "fff992a84adf25a684edeb4c72885d861e7678656ec80bd47a15a1787860eb20",
     "5a37c83ae15f084f5ca258f1f11710c5a25ec454a775272fef85cd2c9f86ca74"),
])
def test_pinned_against_vllm_0_32(algo, first, second):
    """vLLM 0.32's hash_block_tokens for tokens 1..8, block size 4, LoRA ("a", "a") and salt "a" (one object)."""
    got = VllmBlockHasher(algo, DEFAULT_SEED, 4).hashes([1, 2, 3, 4, 5, 6, 7, 8], lora=("a", "a"), cache_salt="a")
    assert [h.hex() for h in got] == [first, second]


# -- hashing finer than the block: several KV-cache groups, prefix_match_unit ----------------------------------


def _fp(scheme: str, bs: int = 16) -> LayoutFingerprint:
    return LayoutFingerprint(model_id="m#w-1", dtype="float32", tokens_per_block=bs, kv_layout="HND", num_layers=2,
                             num_kv_heads=2, head_dim=64, tp_size=1, hash_scheme=scheme)


def test_a_worker_whose_vllm_hashes_finer_than_its_block_is_scored_at_that_unit():
    """vLLM with several KV-cache groups hashes every hash_block_size tokens (8 here), and the connector publishes
    each 16-token block's last fine hash (block_identity.prompt_block_hashes). Before, the scorer hashed per 16
    tokens: no hash matched, and the worker was scored 0."""
    from remote_g2.adapters.vllm.block_identity import prompt_block_hashes

    tokens = list(range(1000, 1000 + 16 * 12 + 5))
    fine = VllmBlockHasher("sha256", DEFAULT_SEED, 8).hashes(tokens, cache_salt="a")
    published = prompt_block_hashes(fine, len(tokens), len(tokens), 16)  # what the connector publishes
    assert len(published) == 12
    scheme = with_hash_unit(scheme_name("sha256", DEFAULT_SEED), 8, 16)  # what the connector names it
    assert scheme == scheme_name("sha256", DEFAULT_SEED) + "/u8"
    store = MemoryStore(lease_ttl_ms=60_000)
    store.register_worker(RegisterWorker("fine", "tcp://10.0.0.2:7000", _fp(scheme), 1))
    store.apply_events(Events("fine", 1, 1, [BlockEvent("stored", published[:7])]))
    reply = Scorer(store).score(ScoreRequest("m", tokens, cache_salt="a"))
    (w,) = reply.workers
    assert (w.matched_blocks, w.matched_tokens, w.block_size) == (7, 7 * 16, 16) and reply.unscored == []


def test_the_unit_leaves_a_per_block_scheme_as_it_was():
    plain = scheme_name("sha256_cbor", "9")
    assert with_hash_unit(plain, None, 16) == with_hash_unit(plain, 16, 16) == plain  # one group: unchanged
    assert parse_scheme(with_hash_unit(plain, 4, 16)) == ("sha256_cbor", plain.split("/")[2], 4)
    assert hasher_for_scheme(with_hash_unit(plain, 4, 16), 16, ["9"]).block_size == 4


@pytest.mark.parametrize("scheme, reason", [
    (scheme_name("sha256", DEFAULT_SEED) + "/u5", "unknown_scheme"),  # 5 does not divide 16: nothing shared
    (scheme_name("sha256", DEFAULT_SEED) + "/x8", "unknown_scheme"),
    ("vllm/xxhash/seeded/u8", "unknown_scheme"),
    (scheme_name("sha256", "other") + "/u8", "seed_unknown"),
])
def test_a_unit_that_cannot_be_hashed_exactly_is_unscored_with_the_reason(scheme, reason):
    store = MemoryStore(lease_ttl_ms=60_000)
    store.register_worker(RegisterWorker("odd", "tcp://10.0.0.2:7000", _fp(scheme), 1))
    store.register_worker(RegisterWorker("plain", "tcp://10.0.0.3:7000", _fp(scheme_name("sha256", DEFAULT_SEED)), 1))
    reply = Scorer(store).score(ScoreRequest("m", list(range(64))))
    assert [w.worker_id for w in reply.workers] == ["plain"]
    assert [(u["worker_id"], u["reason"]) for u in reply.unscored] == [("odd", reason)]


def test_an_instance_without_a_model_identity_is_unscored_not_zero():
    """It registers only for operators to see (adapters/vllm/worker_side.py) and publishes nothing: whatever its
    engine holds is unknown here, so it is listed with its reason, for token ids and block hashes alike."""
    from dataclasses import replace

    from remote_g2.identity.model_identity import unshared_model_id

    tokens = list(range(64))
    scheme = scheme_name("sha256", DEFAULT_SEED)
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(tokens)
    store = MemoryStore(lease_ttl_ms=60_000)
    store.register_worker(RegisterWorker("plain", "tcp://10.0.0.3:7000", _fp(scheme), 1))
    store.apply_events(Events("plain", 1, 1, [BlockEvent("stored", hashes[:2])]))
    unshared = replace(_fp(scheme), model_id=unshared_model_id("m", "changed"))
    store.register_worker(RegisterWorker("flipped", "unshared://flipped", unshared, 1))
    for req in (ScoreRequest("m", tokens), ScoreRequest("m", block_hashes=hashes)):
        reply = Scorer(store).score(req)
        assert [(w.worker_id, w.matched_blocks) for w in reply.workers] == [("plain", 2)]
        assert [(u["worker_id"], u["reason"]) for u in reply.unscored] == [("flipped", "no_identity")]
        assert "(changed)" in reply.unscored[0]["message"]
    store.drain_worker("plain")
    with pytest.raises(CannotScore) as e:  # nothing else to score: an error, never a silent zero
        Scorer(store).score(ScoreRequest("m", tokens))
    assert e.value.reason == "no_identity"


def test_a_vllm_tier_worker_is_scored_by_its_chunks():
    """A RemoteG2Tier worker publishes one key per chunk: the hash of the chunk's last hash unit (vLLM's
    OffloadKey without its group). Its fingerprint names the chunk's tokens and the unit (adapters/vllm_tier/
    identity.py), so the scorer hashes the prompt at the unit and takes every chunk's last hash: scored exactly,
    readable, like a connector's blocks."""
    tokens = list(range(5000, 5000 + 64 * 5 + 20))
    unit, blocks_per_chunk = 16, 4
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, unit).hashes(tokens)
    chunk_keys = hashes[blocks_per_chunk - 1::blocks_per_chunk]  # vLLM's OffloadingConnectorScheduler naming
    assert len(chunk_keys) == 5
    scheme = with_hash_unit(scheme_name("sha256", DEFAULT_SEED), unit, unit * blocks_per_chunk)
    tier_fp = LayoutFingerprint(model_id="m#w-1", dtype="bfloat16", tokens_per_block=unit * blocks_per_chunk,
                                kv_layout="tier/tp1/default/r262144", num_layers=2, num_kv_heads=2, head_dim=64,
                                tp_size=1, hash_scheme=scheme)
    store = MemoryStore(lease_ttl_ms=60_000)
    store.register_worker(RegisterWorker("tier-a", "tcp://10.0.0.4:7000", tier_fp, 1))
    store.apply_events(Events("tier-a", 1, 1, [BlockEvent("stored", chunk_keys[:3])]))
    reply = Scorer(store).score(ScoreRequest("m", tokens))
    (w,) = reply.workers
    assert (w.matched_blocks, w.matched_tokens, w.block_size, w.readable) == (3, 3 * 64, 64, True)
    assert reply.unscored == []
