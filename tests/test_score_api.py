"""The scoring API for routers: vLLM's hashes from token ids, scores over real HTTP, hostile input, the CLI.

Real parts: the registry's stores (embedded; Redis where marked), the HTTP
server on a loopback socket, `remote-g2 serve` and `remote-g2 admin score` as
processes. The vLLM suite (tests/test_vllm_score_hashing.py) holds the
hashes to real vLLM's ``request.block_hashes``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import cbor2
import msgspec
import pytest

from remote_g2.errors import CannotScore, ConfigError
from remote_g2.protocol.messages import BlockEvent, Events, LayoutFingerprint, RegisterWorker
from remote_g2.registry import MemoryStore, RegistryClient
from remote_g2.registry.scoring.http_server import ScoreHttpServer
from remote_g2.registry.scoring.scorer import MAX_SCORE_TOKENS, Scorer, ScoreRequest, ScoringConfig
from remote_g2.identity.vllm_hashing import DEFAULT_SEED, VllmBlockHasher, hasher_for_scheme, scheme_name

from conftest import free_port

SCHEME = scheme_name("sha256", DEFAULT_SEED)


def _reference(algo: str, seed: str, bs: int, toks: list[int], lora=None, salt=None) -> list[bytes]:
    """vLLM's chain written out plainly (kv_cache_utils.hash_block_tokens + generate_block_hash_extra_keys)."""
    if algo == "sha256":
        def h(o):
            return hashlib.sha256(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    else:
        def h(o):
            return hashlib.sha256(cbor2.dumps(o, canonical=True)).digest()
    parent, out = h(seed), []
    for i in range(len(toks) // bs):
        keys = ([("lora", lora[0], lora[1])] if lora else []) + ([("cache_salt", salt)] if salt and i == 0 else [])
        parent = h((parent, tuple(toks[i * bs:(i + 1) * bs]), tuple(keys) if keys else None))
        out.append(parent)
    return out


@pytest.fixture(params=["cpu-sha", "portable"])
def sha_path(request):
    """Both SHA-256s of cpp_ext/vllm_hash.cpp: the CPU's SHA extensions (where present) and the portable one."""
    from remote_g2 import _vllm_hash

    if request.param == "cpu-sha" and not _vllm_hash.accelerated():
        pytest.skip("this CPU has no SHA extensions: the portable SHA-256 is the only one")
    _vllm_hash.set_portable(request.param == "portable")
    yield request.param
    _vllm_hash.set_portable(False)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_hashes_follow_vllms_chain(algo, sha_path):
    rng = random.Random(7)
    for trial in range(60):
        bs = rng.choice([1, 2, 3, 4, 16, 32, 128])
        toks = [rng.choice([rng.randrange(256), rng.randrange(65536), rng.randrange(2**31)])
                for _ in range(rng.randrange(0, 700))]
        lora = rng.choice([None, ("sql", "/adapters/sql"), ("n" * 300, "é/ü" * 90)])
        salt = rng.choice([None, "", "tenant-a", "s" * 500])
        seed = rng.choice([DEFAULT_SEED, "42", "ü" * 100])
        got = VllmBlockHasher(algo, seed, bs).hashes(toks, lora=lora, cache_salt=salt)
        assert got == _reference(algo, seed, bs, toks, lora, salt), (trial, bs, len(toks))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_blocks_past_one_pickle_frame_take_pickles_own_path(algo):
    """4,096-token blocks with keys of 16 KiB: a pickle body past 64 KiB, which pickle frames its own way."""
    rng = random.Random(1)
    toks = [rng.randrange(2**31) for _ in range(3 * 4096 + 5)]
    lora, salt = ("\U0001F600" * 4096, "\u00e9" * 4096), "\U0001F601" * 4096
    got = VllmBlockHasher(algo, DEFAULT_SEED, 4096).hashes(toks, lora=lora, cache_salt=salt)
    assert got == _reference(algo, DEFAULT_SEED, 4096, toks, lora, salt) and len(got) == 3


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("bs", [1, 3, 16, 4096])
def test_a_chain_computed_in_pieces_is_the_whole_chain(algo, bs):
    """PromptChain resumes the chain at its last hash: any cut gives the whole chain's hashes (the salt on
    block 0 only, the adapter on every block), on the C++ path and, at 4,096-token blocks with long keys,
    pickle's own."""
    from remote_g2.identity.vllm_hashing import PromptChain

    rng = random.Random(bs)
    hasher = VllmBlockHasher(algo, DEFAULT_SEED, bs)
    long_keys = bs == 4096
    for _ in range(3 if long_keys else 12):
        toks = [rng.randrange(2**31) for _ in range(bs * rng.randint(0, 3 if long_keys else 70) + rng.randrange(bs))]
        lora = ("\U0001F600" * 4096, "p" * 4096) if long_keys else rng.choice([None, ("sql", "/a/sql")])
        salt = rng.choice([None, "s" * (4096 if long_keys else 5)])
        whole = hasher.hashes(toks, lora=lora, cache_salt=salt)
        chain = PromptChain(hasher, toks, lora=lora, cache_salt=salt)
        assert chain.total == len(whole)
        for n in sorted(rng.sample(range(chain.total + 2), min(4, chain.total + 2))):
            assert chain.upto(n) == whole[:n]
        assert chain.upto(chain.total) == whole
    with pytest.raises(ValueError, match="parent"):
        hasher.hashes([1] * bs * 2, start=1)


def test_salt_and_lora_change_every_hash_they_should():
    h = VllmBlockHasher("sha256", DEFAULT_SEED, 16)
    toks = list(range(64))
    plain, salted = h.hashes(toks), h.hashes(toks, cache_salt="t")
    assert all(a != b for a, b in zip(plain, salted))  # block 0 differs, and the chain carries it on
    assert h.hashes(toks, lora=("a", "/p")) != h.hashes(toks, lora=("a", "/q"))  # the path counts too


def test_scheme_names_match_the_connectors():
    from remote_g2.adapters.vllm.block_identity import hash_scheme

    assert hash_scheme("sha256", {}) == SCHEME
    assert hash_scheme("sha256_cbor", {"PYTHONHASHSEED": "9"}) == scheme_name("sha256_cbor", "9")


def test_a_seed_is_only_used_for_the_scheme_its_digest_names():
    assert hasher_for_scheme(scheme_name("sha256", "9"), 16, [DEFAULT_SEED, "9"]).seed == "9"
    with pytest.raises(CannotScore) as e:
        hasher_for_scheme(scheme_name("sha256", "secret"), 16, [DEFAULT_SEED])
    assert e.value.reason == "seed_unknown"
    for scheme in ("vllm/xxhash/seeded", "trtllm/u64", "vllm/sha256"):
        with pytest.raises(CannotScore) as e:
            hasher_for_scheme(scheme, 16, [DEFAULT_SEED])
        assert e.value.reason == "unknown_scheme"


@pytest.mark.parametrize("bad", [[True], [1.0], [-1], [2**31], ["3"], [None]])
def test_bad_token_ids_are_refused_not_hashed(bad):
    with pytest.raises(CannotScore) as e:
        VllmBlockHasher("sha256", DEFAULT_SEED, 1).hashes(bad)
    assert e.value.reason == "bad_request"


def _json_reference(text: bytes) -> list[int] | None:
    """What token_ids_from_json must answer: the ids JSON holds, or None where it must refuse."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return None
    ok = isinstance(doc, list) and all(type(v) is int and 0 <= v <= 2**31 - 1 for v in doc) and b"-" not in text
    return doc if ok else None


def test_token_ids_parse_as_json_reads_them():
    """The C++ reader of token_ids (word-at-a-time digits) against json.loads, on valid and broken texts."""
    from remote_g2.registry.scoring.json_wire import token_ids_from_json

    rng = random.Random(7)
    edges = [0, 9, 10, 99, 12345678, 99999999, 100000000, 999999999, 1000000000, 2**31 - 1, 2**31, 9999999999,
             10**10, 10**11, 10**19]
    texts = [b"[]", b" [ ] ", b"[0]", b"[\t1,\r\n2 ,3]", b"[2147483647]", b"[2147483648]", b"[00]", b"[01]", b"[-0]",
             b"[1.0]", b"[1e3]", b"[1E3]", b"[1,]", b"[,1]", b"[1 2]", b"[[1]]", b'["1"]', b"[1]]", b"1", b"", b" ",
             b"[", b"[1", b"[1,2", b"[true]", b"[null]", b"[1]\x00", b"[1\x002]", b"\x00[1]", b"[+1]", b"[0x10]",
             b"[12345678901234567890]", b"[1,\xff]", b"[" + b"9" * 40 + b"]"]
    for _ in range(400):
        ids = [rng.choice(edges) if rng.random() < 0.2 else rng.randrange(10 ** rng.randint(1, 10))
               for _ in range(rng.randint(0, 40))]
        sep = rng.choice([",", ", ", " ,", ",\n  "])
        text = ("[" + sep.join(map(str, ids)) + "]").encode()
        if rng.random() < 0.3:  # one byte changed, dropped or doubled
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice([b"", bytes([rng.randrange(256)]), text[i:i + 1] * 2]) + text[i + 1:]
        texts.append(text)
    for text in texts:
        want = _json_reference(text)
        if want is None:
            with pytest.raises(CannotScore) as e:
                token_ids_from_json(text)
            assert e.value.reason == "bad_request"
        else:
            assert list(token_ids_from_json(text)) == want, text


def test_token_ids_cut_from_the_body_read_as_the_whole_body_does():
    """The body's token_ids array, cut out in C++ before msgspec reads the rest, gives what decoding the
    whole body gives: the same fields and ids, or a refusal for the same bodies."""
    from remote_g2.registry.scoring import json_wire as score_wire

    def outcome(read, body):
        try:
            b, ids = read(body)
        except CannotScore as e:
            return ("refused", e.reason)
        return (msgspec.structs.asdict(b) | {"token_ids": None}, None if ids is None else list(ids))

    rng = random.Random(11)
    bodies = [b'{"model": "m", "token_ids": [1, 2]}', b'{"token_ids": [1], "token_ids": [2]}',
              b'{"token_\\u0069ds": [3], "model": "m"}', b'{"model": "a\\"b", "token_ids": [4]}',
              b'{"model": "m", "token_ids": [5], "x": {"token_ids": [6]}}', b'{"x": "[\\"", "token_ids": [7]}',
              b'{"token_ids": [8]} {}', b'{"token_ids": [9],}', b'{"token_ids": null}', b'{"token_ids": []}',
              b'{"model": "m" "token_ids": [1]}', b'{"model": "\xff", "token_ids": [1]}', b'{"token_ids": [1]',
              b'{"workers": ["a", "b"], "token_ids": [1, 2], "cache_salt": "s"}', b'{"model": 7, "token_ids": [1]}']
    for _ in range(600):
        doc = {k: v for k, v in [("model", rng.choice(["m", "x y", 'q"', "\u00e9"])), ("cache_salt", "s"),
                                 ("workers", ["a"]), ("extra", {"token_ids": [1], "s": "]}"}),
                                 ("token_ids", [rng.randrange(2**31) for _ in range(rng.randint(0, 30))])]
               if rng.random() < 0.7}
        body = json.dumps(doc, indent=rng.choice([None, 1])).encode()
        if rng.random() < 0.4:  # one byte changed, dropped or doubled
            i = rng.randrange(len(body))
            body = body[:i] + rng.choice([b"", bytes([rng.randrange(256)]), body[i:i + 1] * 2]) + body[i + 1:]
        bodies.append(body)
    for body in bodies:
        assert outcome(score_wire._read, body) == outcome(score_wire._read_whole, body), body


# -- the scorer against a real store ---------------------------------------------------------------

def _fp(model_id: str = "tiny#w-1", *, scheme: str = SCHEME, bs: int = 16, dtype: str = "bfloat16",
        layers: int = 2) -> LayoutFingerprint:
    return LayoutFingerprint(model_id=model_id, dtype=dtype, tokens_per_block=bs, kv_layout="HND", num_layers=layers,
                             num_kv_heads=4, head_dim=64, tp_size=1, hash_scheme=scheme)


def _add(store, wid: str, fp: LayoutFingerprint, hashes: list[bytes], *, tp: int = 1) -> None:
    from dataclasses import replace

    store.register_worker(RegisterWorker(wid, f"tcp://10.0.0.{len(wid)}:7000", replace(fp, tp_size=tp), 1))
    if hashes:
        assert store.apply_events(Events(wid, 1, 1, [BlockEvent("stored", hashes)])).status == "ok"


@pytest.fixture
def prompt():
    rng = random.Random(3)
    return [rng.randrange(50_000) for _ in range(1000)]


def test_scores_rank_workers_by_cached_prefix(prompt):
    store = MemoryStore()
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)
    _add(store, "a", _fp(), hashes[:40])
    _add(store, "b", _fp(), hashes[:10] + hashes[11:30], tp=2)  # a gap at block 10: its match ends there
    _add(store, "c", _fp(), [])
    _add(store, "other-model", _fp("big#w-2"), hashes)
    rates = {"tiny": 100.0}
    reply = Scorer(store, ScoringConfig(fetch_gbps=2.0, fetch_overhead_ms=1.0,
                                        prefill_ms_per_1k_tokens=rates)).score(ScoreRequest("tiny", prompt))
    got = [(w.worker_id, w.matched_blocks, w.matched_tokens, w.tp_size) for w in reply.workers]
    assert got == [("a", 40, 640, 1), ("b", 10, 160, 2), ("c", 0, 0, 1)]
    assert reply.best == "a" and reply.num_tokens == 1000
    a = reply.workers[0]
    assert a.tier == {"g2": 40} and a.prefill_saved_ms == 64.0
    block = 2 * 2 * 4 * 64 * 16 * 2  # layers, K/V, heads, head_dim, tokens, bf16
    assert a.fetch_ms == pytest.approx(1.0 + 40 * block / 2e6, abs=1e-3)
    # by whole model id, and by identity: the same workers
    assert [w.worker_id for w in Scorer(store).score(ScoreRequest("tiny#w-1", prompt)).workers] == ["a", "b", "c"]
    only = Scorer(store).score(ScoreRequest("tiny", prompt, workers=["b", "zz"]))
    assert [w.worker_id for w in only.workers] == ["b"]


def test_salted_and_lora_prefixes_match_only_for_callers_who_send_them(prompt):
    store = MemoryStore()
    h = VllmBlockHasher("sha256", DEFAULT_SEED, 16)
    _add(store, "salted", _fp(), h.hashes(prompt, cache_salt="tenant-a"))
    _add(store, "lora", _fp(), h.hashes(prompt, lora=("sql", "/a/sql")))
    s = Scorer(store)

    def matched(**kw):
        return {w.worker_id: w.matched_blocks for w in s.score(ScoreRequest("tiny", prompt, **kw)).workers}

    assert matched() == {"salted": 0, "lora": 0}
    assert matched(cache_salt="tenant-b") == {"salted": 0, "lora": 0}
    assert matched(cache_salt="tenant-a") == {"salted": 62, "lora": 0}
    # A connector keys a LoRA request's blocks by the adapter files' digest too (adapters/vllm/lora_identity.py):
    # a LoRA request by token ids cannot be scored exactly, so its workers are unscored, never a zero.
    for path in ("/a/sql", "/b/sql"):
        with pytest.raises(CannotScore) as e:
            matched(lora_name="sql", lora_path=path)
        assert e.value.reason == "unsupported_input" and "digest of the adapter files" in e.value.message
    # by the blocks' keys themselves, it is scored as before
    reply = s.score(ScoreRequest("tiny", block_hashes=h.hashes(prompt, lora=("sql", "/a/sql")),
                                 lora_name="sql", lora_path="/a/sql"))
    assert {w.worker_id: w.matched_blocks for w in reply.workers} == {"salted": 0, "lora": 62}


def test_what_cannot_be_hashed_exactly_is_an_error_never_a_zero(prompt):
    store = MemoryStore()
    _add(store, "secret", _fp(scheme=scheme_name("sha256", "not-given")), [b"x" * 32])
    with pytest.raises(CannotScore) as e:
        Scorer(store).score(ScoreRequest("tiny", prompt))
    assert e.value.reason == "seed_unknown" and "--score-hash-seed" in e.value.message
    # given the seed, it scores
    assert Scorer(store, ScoringConfig(hash_seeds=(DEFAULT_SEED, "not-given"))).score(
        ScoreRequest("tiny", prompt)).workers[0].worker_id == "secret"
    for req, reason in [(ScoreRequest("tiny"), "bad_request"), (ScoreRequest(None, prompt), "bad_request"),
                        (ScoreRequest("tiny", prompt, lora_name="x"), "bad_request"),
                        (ScoreRequest("tiny", [1] * (MAX_SCORE_TOKENS + 1)), "too_large")]:
        with pytest.raises(CannotScore) as e:
            Scorer(store).score(req)
        assert e.value.reason == reason


def test_block_hashes_score_without_hashing(prompt):
    store = MemoryStore()
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)
    _add(store, "a", _fp(scheme="trtllm/u64"), hashes[:5])  # no scheme here could hash; the caller did
    reply = Scorer(store).score(ScoreRequest(None, block_hashes=hashes))
    assert [(w.worker_id, w.matched_blocks) for w in reply.workers] == [("a", 5)] and reply.num_tokens is None


def test_a_long_prompt_is_hashed_only_as_far_as_someone_holds_it():
    """Scores computed with the chain hashed in growing pieces equal those from the whole chain, for matches
    that end before, at and past each piece's end, and the prompt is hashed no further than they need."""
    from remote_g2.registry.scoring import scorer as scoring

    rng = random.Random(5)
    hasher = VllmBlockHasher("sha256", DEFAULT_SEED, 16)
    toks = [rng.randrange(50_000) for _ in range(16 * 700 + 3)]
    whole = hasher.hashes(toks)
    first, growth = scoring._FIRST_BLOCKS, scoring._GROWTH
    ends = [0, 1, first - 1, first, first + 1, first * growth - 1, first * growth, 700]
    store = MemoryStore()
    for i, n in enumerate(ends):
        _add(store, f"w{i}", _fp(), whole[:n])
    calls = []
    hashes = VllmBlockHasher.hashes

    def counted(self, *a, **k):
        out = hashes(self, *a, **k)
        calls.append(len(out))
        return out

    scorer = Scorer(store)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VllmBlockHasher, "hashes", counted)
        reply = scorer.score(ScoreRequest("tiny", toks))
        assert {w.worker_id: w.matched_blocks for w in reply.workers} == {f"w{i}": n for i, n in enumerate(ends)}
        assert sum(calls) == 700  # every block once
        for top in (first + 1, first, first - 1, 1, 0):  # the longest match decides how far the prompt is hashed
            for i, n in enumerate(ends):
                if n > top:
                    store.drain_worker(f"w{i}")
            calls.clear()
            reply = scorer.score(ScoreRequest("tiny", toks))
            assert max(w.matched_blocks for w in reply.workers) == top
            assert sum(calls) == (first if top < first else first * growth)


def test_a_dead_worker_leaves_the_scores_at_once(prompt):
    store = MemoryStore(lease_ttl_ms=300)
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)
    _add(store, "a", _fp(), hashes)
    _add(store, "b", _fp(), hashes[:3])
    s = Scorer(store)
    assert s.score(ScoreRequest("tiny", prompt)).best == "a"
    store.drain_worker("a")
    assert [w.worker_id for w in s.score(ScoreRequest("tiny", prompt)).workers] == ["b"]
    time.sleep(0.4)  # b's lease lapses: no heartbeat
    assert s.score(ScoreRequest("tiny", prompt)).workers == []


@pytest.mark.redis
def test_scores_from_redis(redis_url, prompt):
    from remote_g2.registry.stores.factory import open_store

    store = open_store(redis_url=redis_url, key_prefix="score-test:")
    try:
        hashes = VllmBlockHasher("sha256_cbor", DEFAULT_SEED, 32).hashes(prompt)
        _add(store, "r1", _fp("redis-model#w-9", scheme=scheme_name("sha256_cbor", DEFAULT_SEED), bs=32), hashes[:7])
        reply = Scorer(store).score(ScoreRequest("redis-model", prompt))
        assert [(w.worker_id, w.matched_tokens) for w in reply.workers] == [("r1", 224)]
    finally:
        store.drain_worker("r1")
        store.close()


def test_scores_from_a_servers_mirror_equal_the_stores(redis_url, prompt):
    """serve --mirror-lookups: the scorer asks the server's in-process copy of Redis, and gets what Redis says."""
    from remote_g2.registry import RegistryServer
    from remote_g2.registry.stores.factory import open_store

    store = open_store(redis_url=redis_url, key_prefix="score-mirror:")
    server = RegistryServer(store, bind="tcp://127.0.0.1:0", feed_bind="tcp://127.0.0.1:0", mirror_lookups=True)
    endpoint = server.start()
    try:
        assert server.mirror is not None and server.mirror.wait_ready(10), server.mirror.last_error
        hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)
        with RegistryClient(endpoint) as c:
            for wid, n in (("m1", 12), ("m2", 5), ("m3", 0)):
                c.register_worker(wid, f"tcp://127.0.0.1:{9000 + n}", _fp(), 1)
                if n:
                    c.events(wid, 1, 1, [BlockEvent("stored", hashes[:n])])
        deadline = time.monotonic() + 5
        while server.mirror.held_prefixes(hashes, _fp().compat_key()) != {"m1": 12, "m2": 5} \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.mirror.held_prefixes(hashes, _fp().compat_key()) == {"m1": 12, "m2": 5}
        assert server.mirror.holds_any(hashes[11]) is True and server.mirror.holds_any(hashes[12]) is False
        assert store.holds_any(hashes[0]) is None  # Redis itself: not without a round trip
        mirrored = Scorer(store, mirror=server.mirror).score(ScoreRequest("tiny", prompt))
        direct = Scorer(store).score(ScoreRequest("tiny", prompt))
        assert [(w.worker_id, w.matched_blocks) for w in mirrored.workers] == [("m1", 12), ("m2", 5), ("m3", 0)]
        assert mirrored == direct
    finally:
        server.close()
        for wid in ("m1", "m2", "m3"):
            store.drain_worker(wid)
        store.close()


# -- over HTTP -------------------------------------------------------------------------------------

@pytest.fixture
def api(prompt):
    store = MemoryStore()
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)
    _add(store, "a", _fp(), hashes[:20])
    srv = ScoreHttpServer(Scorer(store), "127.0.0.1:0", loras={"sql": "/a/sql"})
    srv.start()
    yield srv
    srv.close()


def _post(url: str, body: object = None, *, raw: bytes | None = None, headers: dict | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _raw(url: str, data: bytes) -> bytes:
    """What the server answers to ``data`` on a connection of its own, up to its closing it (every error that
    leaves the stream in doubt closes it; a client's half-close would end the connection unanswered)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_score_over_http(api, prompt):
    status, doc = _post(api.url + "/v1/score", {"model": "tiny", "token_ids": prompt})
    assert status == 200 and doc["best"] == "a" and doc["workers"][0]["matched_tokens"] == 320
    assert doc["workers"][0]["endpoint"] == "tcp://10.0.0.1:7000" and doc["workers"][0]["tier"] == {"g2": 20}
    # Dynamo's name for the model, and its /query shape (Mooncake's conductor reads the same "instances")
    status, doc = _post(api.url + "/query", {"model_name": "tiny", "token_ids": prompt, "routing_group": "x"})
    assert status == 200
    assert doc["instances"]["a"] == {"longest_matched": 320, "gpu": 0, "cpu": 320, "disk": 320, "dp": {"0": 0}}
    assert doc["scores"] == {"a": {"0": 0}}
    status, doc = _post(api.url + "/query", {"model": "tiny", "token_ids": prompt, "block_size": 64})
    assert status == 422 and "block_size 64" in doc["error"]["message"]
    status, doc = _post(api.url + "/query", {"model_name": "tiny", "token_ids": prompt, "lora_name": "nope"})
    assert status == 422 and "--score-lora" in doc["error"]["message"]
    status, doc = _post(api.url + "/query", {"model_name": "tiny", "token_ids": prompt, "lora_name": "sql"})
    assert status == 422 and doc["error"]["reason"] == "unsupported_input"  # LoRA blocks: keyed by a digest
    with urllib.request.urlopen(api.url + "/healthz", timeout=5) as r:
        assert json.loads(r.read()) == {"ok": True}


@pytest.mark.parametrize("body, status, reason", [
    (b'{"model": "tiny", "token_ids": "1,2"}', 400, "bad_request"),
    (b'{"model": "tiny", "token_ids": [1, 2.5]}', 400, "bad_request"),
    (b'{"model": 7, "token_ids": [1]}', 400, "bad_request"),
    (b'[1, 2, 3]', 400, "bad_request"),
    (b'{"model": "\xff\xfe", "token_ids": [1]}', 400, "bad_request"),
    (b'{"model": "tiny", "token_ids": [1]', 400, "bad_request"),
    (b'{"model": "tiny", "token_ids": [-5]}', 400, "bad_request"),
    (b'{"block_hashes": ["zz"]}', 400, "bad_request"),
    (b'{"model": "tiny"}', 400, "bad_request"),
    (b'{"model": "tiny", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b', "token_ids": [1]}', 400, "bad_request"),
])
@pytest.mark.parametrize("route", ["/v1/score", "/query"])
def test_hostile_bodies_get_4xx_and_the_server_keeps_serving(api, prompt, body, status, reason, route):
    got, doc = _post(api.url + route, raw=body)
    assert (got, doc["error"]["reason"]) == (status, reason), doc
    assert _post(api.url + "/v1/score", {"model": "tiny", "token_ids": prompt})[0] == 200


def test_a_million_tokens_and_oversized_bodies_are_refused(api, prompt):
    status, doc = _post(api.url + "/v1/score", {"model": "tiny", "token_ids": [1] * 1_000_000})
    assert status == 413 and doc["error"]["reason"] == "too_large"
    status, doc = _post(api.url + "/v1/score", {"model": "tiny", "token_ids": [1] * (MAX_SCORE_TOKENS + 1)})
    assert status == 413 and str(MAX_SCORE_TOKENS) in doc["error"]["message"]
    assert _post(api.url + "/v1/score", {"model": "tiny", "token_ids": prompt})[0] == 200


@pytest.mark.parametrize("data, status", [
    (b"GARBAGE\r\n\r\n", b"400"),
    (b"POST /v1/score HTTP/2.0\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", b"400"),
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", b"411"),
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", b"400"),
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: \xb2\r\n\r\n", b"400"),  # a digit to isdigit()
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"1" * 5000 + b"\r\n\r\n", b"400"),  # overflow
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n", b"413"),
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", b"400"),
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n"
     b"Content-Length: 2\r\n\r\n{}", b"400"),
    (b"POST /v1/score HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", b"400"),  # HTTP/1.1 without Host (RFC 9112)
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", b"415"),
    (b"GET /v1/score HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"405"),
    (b"GET /admin HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"404"),
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 20_000 + b"\r\n\r\n", b"431"),
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 100 + b"\r\n", b"431"),
    (b"\x00\xff\xfe\r\n\r\n", b"400"),
])
def test_hostile_http_gets_an_error_and_the_server_keeps_serving(api, prompt, data, status):
    reply = _raw(api.url, data)
    assert reply.split(b" ", 2)[1] == status and b"application/json" in reply, reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["reason"], reply
    assert _post(api.url + "/v1/score", {"model": "tiny", "token_ids": prompt})[0] == 200


def test_answers_name_the_api_not_the_http_library_and_its_version(api, prompt):
    body = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
    for data in (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body),  # answered by the API
                 b"GARBAGE\r\n\r\n"):  # answered by aiohttp's error path
        head = _raw(api.url, data).split(b"\r\n\r\n", 1)[0].lower()
        assert b"\r\nserver: remote-g2\r\n" in head and b"aiohttp" not in head and b"python" not in head, head


def test_a_silent_client_does_not_stop_the_others(api, prompt):
    host, port = api.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(20)]
    try:
        idle[0].sendall(b"POST /v1/score HTTP/1.1\r\nContent-Le")  # half a request, then nothing
        assert _post(api.url + "/v1/score", {"model": "tiny", "token_ids": prompt})[0] == 200
    finally:
        for s in idle:
            s.close()


def test_keep_alive_and_expect_continue(api, prompt):
    body = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
    host, port = api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        f = s.makefile("rb")
        for _ in range(3):  # three requests on one connection
            s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body))
            assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
            s.sendall(body)
            assert f.readline().startswith(b"HTTP/1.1 200")
            length = 0
            while (line := f.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            assert json.loads(f.read(length))["best"] == "a"


def _answers(f, n: int) -> list[tuple[bytes, dict]]:
    """n HTTP answers read off a socket file: (status line, JSON body) each."""
    out = []
    for _ in range(n):
        status, length = f.readline(), 0
        while (line := f.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        out.append((status, json.loads(f.read(length))))
    return out


def test_pipelined_requests_are_answered_in_order(api, prompt):
    ok = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
    bad = b'{"model": "tiny", "token_ids": [1.5]}'
    host, port = api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        # four requests in one write, one of them refused: each answered, in order, on one connection
        s.sendall(b"".join(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b)
                           for b in (ok, bad, ok, ok)) + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        got = _answers(s.makefile("rb"), 5)
    assert [st.split()[1] for st, _ in got] == [b"200", b"400", b"200", b"200", b"200"]
    assert got[0][1]["best"] == "a" and got[1][1]["error"]["reason"] == "bad_request" and got[4][1] == {"ok": True}


def test_slow_and_idle_clients_are_cut_off(prompt):
    from remote_g2.registry.scoring.http_server import ScoreLimits

    store = MemoryStore()
    _add(store, "a", _fp(), VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)[:5])
    body = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
    limits = ScoreLimits(request_timeout_s=0.5, idle_timeout_s=1.0)
    with ScoreHttpServer(Scorer(store), "127.0.0.1:0", limits=limits) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        addr = (host, int(port))
        with socket.create_connection(addr, timeout=10) as slow:  # half a body, then nothing: 400 in time
            t0 = time.monotonic()
            slow.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body[:100]))
            reply = slow.makefile("rb").read()
            assert reply.startswith(b"HTTP/1.1 400") and b"did not arrive within" in reply
            assert 0.4 < time.monotonic() - t0 < 5
        with socket.create_connection(addr, timeout=10) as idle:  # answered, then silent: closed after 1 s
            idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            f = idle.makefile("rb")
            assert _answers(f, 1)[0][1] == {"ok": True}
            t0 = time.monotonic()
            assert f.read() == b"" and 0.8 < time.monotonic() - t0 < 5


def _wide_store(prompt) -> MemoryStore:
    """64 workers: an answer of about 15 KB to a request of 100 bytes."""
    store = MemoryStore()
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)
    for w in range(64):
        _add(store, f"worker-{w:02d}", _fp(), hashes[:w % 7])
    return store


def _small_request(prompt) -> bytes:
    small = json.dumps({"model": "tiny", "token_ids": prompt[:32]}).encode()
    return b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(small), small)


def test_a_client_that_reads_no_answers_is_not_read_from_until_it_does(prompt):
    """Pipelined requests whose answers the client leaves unread: once the answers back up, the server stops
    reading (and scoring) that connection, serves others meanwhile, and goes on when the client reads."""
    scored = []

    class Counting(Scorer):
        def score(self, req):
            scored.append(1)
            return super().score(req)

    store = _wide_store(prompt)
    request = _small_request(prompt)
    n = 3000  # 45 MB of answers: several times what the kernel's socket buffers hold
    with ScoreHttpServer(Counting(store), "127.0.0.1:0") as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as greedy:
            greedy.sendall(request * n)  # (300 KB: the kernel takes it all)
            time.sleep(1.5)
            held_back = len(scored)
            assert held_back < n, "the server kept reading a client that reads none of its answers"
            assert _post(srv.url + "/v1/score", {"model": "tiny", "token_ids": prompt})[0] == 200
            got = _answers(greedy.makefile("rb"), n)  # now read: the rest is read, scored and answered
        assert len(got) == n and all(st.startswith(b"HTTP/1.1 200") and len(doc["workers"]) == 64 for st, doc in got)
        assert len(scored) == n + 1


def test_a_client_that_never_reads_its_answers_is_disconnected(prompt):
    from remote_g2.registry.scoring.http_server import ScoreLimits

    limits = ScoreLimits(idle_timeout_s=1.0)
    with ScoreHttpServer(Scorer(_wide_store(prompt)), "127.0.0.1:0", limits=limits) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as greedy:
            greedy.sendall(_small_request(prompt) * 3000)
            time.sleep(2.5)  # backed up since about the first second: cut off after one more
            assert srv.connection_counts()["authenticated"] == 0
            got = 0
            with pytest.raises(ConnectionError):  # what the kernel held arrives, then the reset
                while chunk := greedy.recv(1 << 20):
                    got += len(chunk)
                raise ConnectionResetError("closed without a reset")  # (an orderly close is not what we want)
            assert got < 3000 * 10_000


def test_beyond_loopback_a_token_is_required(prompt):
    store = MemoryStore()
    with pytest.raises(ConfigError, match="bearer token"):
        ScoreHttpServer(Scorer(store), "0.0.0.0:0")
    with pytest.raises(ConfigError, match="bearer token"):
        ScoreHttpServer(Scorer(store), "10.1.2.3:0")
    srv = ScoreHttpServer(Scorer(store), "127.0.0.1:0", tokens=["old-token", "new-token"])
    with srv:
        body = {"model": "tiny", "token_ids": prompt}
        assert _post(srv.url + "/v1/score", body)[0] == 401
        assert _post(srv.url + "/v1/score", body, headers={"Authorization": "Bearer nope"})[0] == 401
        assert _post(srv.url + "/v1/score", body, headers={"Authorization": "Basic new-token"})[0] == 401
        for token in ("old-token", "new-token"):  # rotation: both accepted
            assert _post(srv.url + "/v1/score", body, headers={"Authorization": f"Bearer {token}"})[0] == 200
        reply = _raw(srv.url, b"POST /query HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 401") and b"WWW-Authenticate: Bearer" in reply


# -- the holes of issue 53: smuggling, lock-out, bodies read before authentication ---------------------

def _until_closed(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("head", [
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-A: 1\nContent-Length: %d\r\n\r\n",  # two header lines to a lenient proxy
    b"POST /v1/score HTTP/1.1\nHost: x\nContent-Length: %d\n\n",
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\n",
])
def test_a_bare_lf_in_a_head_is_refused_and_never_answered_as_a_second_request(api, prompt, head):
    """Request smuggling: to a proxy that ends lines at a bare LF, ``X-A: 1\\nContent-Length: N`` frames N bytes of
    body, and those bytes are a request of their own to a server that does not. Refused whole: one 400, the
    connection closed, nothing of the smuggled request answered."""
    smuggled = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = _raw(api.url, head % len(smuggled) + smuggled)
    assert reply.split(b" ", 2)[1] == b"400" and reply.count(b"HTTP/1.") == 1 and b'"ok"' not in reply, reply
    assert _post(api.url + "/v1/score", {"model": "tiny", "token_ids": prompt})[0] == 200


def _token_server(prompt, **kw) -> ScoreHttpServer:
    store = MemoryStore()
    _add(store, "a", _fp(), VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)[:5])
    return ScoreHttpServer(Scorer(store), "127.0.0.1:0", tokens=["t0ken"], **kw)


def test_no_body_is_read_before_its_request_is_authenticated(prompt):
    """/healthz needs no token and takes no body: one announced is refused unread. A request without a token
    is answered 401 from its head: the client gets the answer before it has sent a byte of its body."""
    with _token_server(prompt) as srv:
        addr = srv.url.removeprefix("http://").split(":")
        for head in (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 4194304\r\n\r\n",
                     b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                     b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n",
                     b"POST /query HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\nContent-Length: 100\r\n\r\n"):
            with socket.create_connection((addr[0], int(addr[1])), timeout=5) as s:
                s.sendall(head)  # and no body: the answer must not wait for it
                reply = _until_closed(s)
            want = b"401" if head.startswith(b"POST") else b"400"
            assert reply.split(b" ", 2)[1] == want and b"Connection: close" in reply, reply
        # without a body, /healthz answers anyone; a connection that has not authenticated carries one answer
        with socket.create_connection((addr[0], int(addr[1])), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = _until_closed(s)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"ok":true}'), reply
        # a token holder's connection is kept alive
        with socket.create_connection((addr[0], int(addr[1])), timeout=5) as s:
            f = s.makefile("rb")
            for _ in range(2):
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0ken\r\n\r\n")
                assert _answers(f, 1)[0][1] == {"ok": True}
        assert srv.connection_counts()["unauthenticated"] <= 1


def test_idle_strangers_cannot_lock_out_a_client_with_a_token(prompt):
    """More idle connections than every connection cap (512 before), some with half a head: the ones that
    never authenticated share a small budget, the oldest of the busiest source leaves for a new one, and a
    client with a valid token gets its 200 at once."""
    from remote_g2.registry.scoring.http_server import ScoreLimits

    body = {"model": "tiny", "token_ids": prompt}
    with _token_server(prompt) as srv:
        addr = srv.url.removeprefix("http://").split(":")
        budget = ScoreLimits().max_unauthenticated
        strangers = []
        try:
            for i in range(520):
                s = socket.create_connection((addr[0], int(addr[1])), timeout=5)
                if i % 50 == 0:
                    s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Le")
                strangers.append(s)
            t0 = time.monotonic()
            assert _post(srv.url + "/v1/score", body, headers={"Authorization": "Bearer t0ken"})[0] == 200
            assert time.monotonic() - t0 < 3
            counts = srv.connection_counts()
            assert counts["unauthenticated"] <= budget and counts["evicted_unauthenticated"] >= 520 - budget
        finally:
            for s in strangers:
                s.close()


def test_the_budgets_evict_the_busiest_sources_oldest_and_never_a_busy_authenticated_connection():
    from remote_g2.registry.scoring.admission import Admission, source_of

    class Conn:
        def __init__(self, source: str) -> None:
            self.source, self.idle, self.evicted = source, True, False

        def evict(self) -> None:
            self.evicted = True

    a = Admission(max_unauthenticated=3, max_authenticated=2)
    client = Conn("10.0.0.9")
    attackers = [Conn("10.0.0.66") for _ in range(2)]
    for c in [attackers[0], client, attackers[1]]:
        a.admit(c)
    for _ in range(5):  # a flood from one host evicts its own connections, never the client's
        c = Conn("10.0.0.66")
        a.admit(c)
        attackers.append(c)
    assert not client.evicted and a.unauthenticated == 3 and sum(c.evicted for c in attackers) == 5
    assert a.authenticate(client) and a.unauthenticated == 2 and a.authenticated == 1
    other = Conn("10.0.0.10")
    a.admit(other)
    assert a.authenticate(other) and a.authenticated == 2
    client.idle, other.idle = False, False  # both busy: a third is refused rather than either closed
    third = Conn("10.0.0.11")
    a.admit(third)
    assert not a.authenticate(third) and not client.evicted and not other.evicted
    other.idle = True
    a.touch(client)
    assert a.authenticate(third) and other.evicted and not client.evicted  # the idle one gave way
    a.release(third)
    a.release(third)
    assert a.authenticated == 1
    assert source_of(("2001:db8::1", 1, 0, 0)) == source_of(("2001:db8::ffff", 1, 0, 0)) == "2001:db8::/64"
    assert source_of(("::ffff:10.1.2.3", 1, 0, 0)) == "10.1.2.3" and source_of(None) == ""


# -- `remote-g2 serve --score-bind` and `remote-g2 admin score`, as processes -----------------------

def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_g2.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_serve_and_admin_score(tmp_path: Path, prompt):
    port, score_port = free_port(), free_port()
    token_file = tmp_path / "tokens"
    token_file.write_text("t0ken\n")
    serve = subprocess.Popen([sys.executable, "-m", "remote_g2.cli", "serve", "--bind", f"tcp://127.0.0.1:{port}",
                              "--feed-bind", "none", "--score-bind", f"127.0.0.1:{score_port}",
                              "--score-token-file", str(token_file), "--score-prefill-ms-per-1k", "tiny=50"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = serve.stdout.readline()  # the one line serve prints, once everything is up
        assert f"scoring API on http://127.0.0.1:{score_port}" in line, line
        hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)
        with RegistryClient(f"tcp://127.0.0.1:{port}") as c:
            c.register_worker("w1", "tcp://127.0.0.1:9001", _fp(), 1)
            c.events("w1", 1, 1, [BlockEvent("stored", hashes[:12])])
        tokens = tmp_path / "prompt.json"
        tokens.write_text(json.dumps(prompt))
        url = f"http://127.0.0.1:{score_port}"
        r = _cli("admin", "score", "--url", url, "--model", "tiny", "--tokens-file", str(tokens), "--json",
                 env={"REMOTE_G2_SCORE_TOKEN": "t0ken"})
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["best"] == "w1" and doc["workers"][0]["matched_tokens"] == 192
        assert doc["workers"][0]["prefill_saved_ms"] == pytest.approx(9.6)
        r = _cli("admin", "score", "--url", url, "--model", "tiny", "--tokens", ",".join(map(str, prompt[:200])),
                 "--token-file", str(token_file))
        assert r.returncode == 0 and "w1" in r.stdout and "best: w1 (192 tokens cached of 200 tokens)" in r.stdout
        r = _cli("admin", "score", "--url", url, "--model", "tiny", "--tokens", "1,2,3")
        assert r.returncode == 1 and "HTTP 401 unauthorized" in r.stderr
        r = _cli("admin", "score", "--url", f"http://127.0.0.1:{free_port()}", "--tokens", "1")
        assert r.returncode == 1 and "cannot reach" in r.stderr
    finally:
        serve.terminate()
        serve.wait(10)


# -- HTTPS, and client certificates in place of a token ----------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl command."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates with")
    d = tmp_path_factory.mktemp("pki")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=remote-g2 test CA")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", *ext)
    return d


def test_https_with_client_certificates(pki: Path, prompt):
    import ssl

    from remote_g2.registry.scoring.http_server import tls_context

    store = MemoryStore()
    _add(store, "a", _fp(), VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)[:7])
    mutual = tls_context(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"))
    # client certificates admit their holders: no token needed beyond loopback; TLS alone does not
    ScoreHttpServer(Scorer(store), "10.1.2.3:0", tls=mutual)
    with pytest.raises(ConfigError, match="client certificates"):
        ScoreHttpServer(Scorer(store), "10.1.2.3:0", tls=tls_context(str(pki / "server.pem"), str(pki / "server.key")))
    with ScoreHttpServer(Scorer(store), "127.0.0.1:0", tls=mutual) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        body = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        with urllib.request.urlopen(urllib.request.Request(srv.url + "/v1/score", data=body), context=ctx,
                                    timeout=10) as r:
            assert json.loads(r.read())["workers"][0]["matched_blocks"] == 7
        no_cert = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            with urllib.request.urlopen(urllib.request.Request(srv.url + "/v1/score", data=body), context=no_cert,
                                        timeout=10) as r:
                r.read()
        with pytest.raises((urllib.error.URLError, ConnectionError, http_client_errors())):
            urllib.request.urlopen(urllib.request.Request(srv.url.replace("https", "http") + "/v1/score",
                                                          data=body), timeout=10).read()
        r = _cli("admin", "score", "--url", srv.url, "--model", "tiny", "--tokens", ",".join(map(str, prompt)),
                 "--ca-file", str(pki / "ca.pem"), "--cert", str(pki / "client.pem"), "--key", str(pki / "client.key"),
                 "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["best"] == "a", r.stderr
        # the server still answers after the refused handshakes
        with urllib.request.urlopen(urllib.request.Request(srv.url + "/v1/score", data=body), context=ctx,
                                    timeout=10) as r:
            assert r.status == 200


def http_client_errors() -> type[Exception]:
    import http.client

    return http.client.HTTPException


def test_tls_handshakes_count_in_the_unauthenticated_budget_and_time_out(pki: Path, prompt):
    """Handshakes that never finish (silent, or half a ClientHello) are held in the same small budget, evicted
    by newer connections and closed at the request timeout; a token holder's HTTPS request gets its 200."""
    import ssl

    from remote_g2.registry.scoring.http_server import ScoreLimits, tls_context

    limits = ScoreLimits(request_timeout_s=1.0, max_unauthenticated=16)
    with _token_server(prompt, tls=tls_context(str(pki / "server.pem"), str(pki / "server.key")),
                       limits=limits) as srv:
        host, port = srv.url.removeprefix("https://").split(":")
        strangers = []
        try:
            for i in range(60):
                s = socket.create_connection((host, int(port)), timeout=5)
                if i % 3 == 0:
                    s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello
                strangers.append(s)
            time.sleep(0.2)
            counts = srv.connection_counts()
            assert counts["unauthenticated"] <= 16 and counts["evicted_unauthenticated"] >= 60 - 16, counts
            ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
            req = urllib.request.Request(srv.url + "/v1/score", data=json.dumps({"model": "tiny", "token_ids": prompt})
                                         .encode(), headers={"Authorization": "Bearer t0ken"})
            t0 = time.monotonic()
            with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                assert r.status == 200 and time.monotonic() - t0 < 1.0
            t0 = time.monotonic()  # the survivors' handshakes end at the deadline
            survivor = strangers[-1]
            assert survivor.recv(10) == b"" and time.monotonic() - t0 < 2.5
            while srv.connection_counts()["unauthenticated"] and time.monotonic() - t0 < 3:
                time.sleep(0.02)  # (the others' ends are seen on the server's loop a moment later)
            assert srv.connection_counts()["unauthenticated"] == 0
        finally:
            for s in strangers:
                s.close()
