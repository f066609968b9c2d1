"""Scores for request routers: which worker holds the longest cached prefix of a prompt, and what it is worth.

A router holds token ids (or block hashes), not the registry's keys. The
:class:`Scorer` answers "who holds how much of this prompt" for each live
worker that serves the request's model:

1. **Which workers.** The live workers whose fingerprint names ``model`` —
   by label (the part of ``model_id`` before ``#``: the path or name the
   engine loaded), by whole ``model_id``, or by identity — grouped by
   compat key: a group shares one hash space and block size, and only its
   members can read each other's blocks.
2. **Which hashes.** Per group, vLLM's block hashes of the token ids
   (:mod:`remote_g2.identity.vllm_hashing`), in the group's hash scheme and block
   size, with the request's LoRA adapter and ``cache_salt`` folded in as
   vLLM folds them. Where the scheme names a hash unit finer than the block
   (several KV-cache groups, ``prefix_match_unit``:
   :func:`~remote_g2.identity.vllm_hashing.with_hash_unit`), the chain runs per unit
   and a block's hash is its last unit's, as the worker publishes it. A
   group whose hashes cannot be computed exactly (a scheme it does not
   know, a seed it was not given; for a LoRA request by token ids, every
   connector worker: it binds those hashes to the adapter files' digest) is
   listed as unscored
   with the reason — never a silent zero. Or the caller sends
   ``block_hashes`` directly. The chain is computed only as far as its
   blocks are held anywhere, where the store can tell that locally
   (:meth:`Scorer._hashes_needed`): a long prompt with a short cached
   prefix costs about its prefix.
3. **How much each holds.** One registry lookup per group with every holder
   (:meth:`~..stores.contract.RegistryStore.held_prefixes`; answered by the server's
   mirror when it keeps one): each worker's match runs from block 0 without
   a gap. Dead workers are never in a lookup's answer, so a worker that dies
   leaves the scores at once.

**Tiers.** ``tier`` counts each tier's match: ``g2`` is what the store says
a source-registered worker holds in its G2 (host memory remote-g2 reads),
and, where this server follows the engine's KV events
(:mod:`.engine_caches`), ``g1`` is its device cache. An engine without
remote-g2 (an events-only record) is scored from its events alone, in the
hash space learned from them, with ``readable`` False: it can reuse its
blocks, nobody can read them. A worker's match is its longest tier's.

Each :class:`WorkerScore` also carries what the match is worth: the prefill
time it saves (``prefill_ms_per_1k_tokens``, configured: it depends on the
model and the hardware, which the registry cannot see) and the time to fetch
its G2 match from it over remote-g2 (those KV bytes over the configured
``fetch_gbps`` plus ``fetch_overhead_ms``; None for an engine nobody can
read). Candidates whose hashes cannot be computed exactly are listed in
``unscored`` with the reason; when no candidate can be scored the request is
a :class:`~remote_g2.errors.CannotScore`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from remote_g2.errors import CannotScore, ConfigError
from remote_g2.protocol.messages import LayoutFingerprint, WorkerRecord
from remote_g2.identity.model_identity import identity_of, model_label, unshared_kind
from remote_g2.identity.vllm_hashing import DEFAULT_SEED, PromptChain, VllmBlockHasher, hasher_for_scheme

from .engine_caches import EngineCaches
from ..stores.contract import RegistryStore

__all__ = ["ScoreRequest", "WorkerScore", "ScoreReply", "Scorer", "ScoringConfig", "block_bytes",
           "MAX_SCORE_TOKENS", "MAX_SCORE_HASHES", "parse_prefill_rates"]

#: The longest prompt scored (tokens); longer ones are refused, not truncated.
MAX_SCORE_TOKENS = 262_144
#: The most block hashes a request may send (the registry's lookup limit).
MAX_SCORE_HASHES = 65_536
#: A prompt's blocks hashed first, and by how much that grows while some worker holds the last of them
#: (:meth:`Scorer._hashes_needed`): at 16 tokens a block, 1,024 tokens, then 8,192, then 65,536.
_FIRST_BLOCKS = 64
_GROWTH = 8
#: How long a scorer reuses the list of live workers of a store without a ``generation`` (Redis). A worker
#: that died meanwhile is never in a lookup's answer: it scores 0 until the list is read again. A store with
#: one (the embedded store) is listed again whenever it changes, and a lease that lapsed drops its worker.
_WORKERS_TTL_S = 1.0
#: Why a connector worker is not scored for a LoRA request: the connector keys an adapter's blocks by vLLM's hash
#: and the digest of the adapter files it loaded (``adapters/vllm/lora_identity.py``), which a request cannot name.
_LORA_KEYED_BY_DIGEST = ("a remote-g2 worker keys a LoRA request's blocks by the digest of the adapter files it "
                         "loaded, which the request cannot name: its cached prefix is unknown (send block_hashes)")
#: Per-worker reasons (``unscored``) answered 422 ``unknown_scheme`` when no candidate can be scored.
_NOT_A_CHAIN = frozenset({"scheme_not_learned", "kv_cache_groups", "block_too_large"})
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "uint8": 1, "int8": 1}


class PrefixIndex(Protocol):
    """What the scorer asks of the server's registry mirror (:class:`remote_g2.registry.client.mirror.RegistryMirror`).

    Both answer from local memory, without a round trip to the store, and None while the mirror holds no
    complete copy (the scorer then asks the store).
    """

    def held_prefixes(self, hashes: Sequence[bytes], compat_key: str) -> dict[str, int] | None:
        """Per holder of ``compat_key``'s layout, how many of ``hashes`` it holds from block 0 on."""

    def holds_any(self, block_hash: bytes) -> bool | None:
        """Whether anyone holds ``block_hash``."""


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """A prompt to score: ``token_ids`` with ``model`` (and the request's LoRA adapter and salt), or
    ``block_hashes`` directly (``model`` then optional); ``workers`` limits the answer to those ids."""

    model: str | None = None
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[bytes] | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    workers: Sequence[str] | None = None


class WorkerScore(msgspec.Struct, frozen=True):
    """One worker's share of a prompt's cache (see the module docstring); a msgspec Struct, which the HTTP
    answer encodes as it is. Read-only: a worker that holds nothing of a prompt gets the same object in
    every answer until the store changes."""

    worker_id: str
    endpoint: str
    tp_size: int
    model_id: str
    compat_key: str
    block_size: int
    matched_blocks: int
    matched_tokens: int
    tier: dict[str, int]
    load: int
    prefill_saved_ms: float | None
    fetch_ms: float | None
    readable: bool = True  # remote-g2 can read its G2 (a source registered it); False: an engine's own tiers


@dataclass(frozen=True, slots=True)
class ScoreReply:
    """Every candidate worker, best first (most matched tokens, then least load, then worker id)."""

    model: str | None
    num_tokens: int | None
    workers: list[WorkerScore]
    best: str | None
    #: candidates whose hashes could not be computed exactly: ``{"worker_id", "reason", "message"}``
    unscored: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    """What a :class:`Scorer` is told rather than sees (``remote-g2 serve --score-*``)."""

    #: vLLM hash seeds (PYTHONHASHSEED values) a worker's scheme may name; vLLM's default is matched by digest
    hash_seeds: tuple[str, ...] = (DEFAULT_SEED,)
    #: remote-g2 READ bandwidth to assume, GB/s (for ``fetch_ms``)
    fetch_gbps: float = 5.0
    #: fixed cost of a remote load (lookup, resolve, agreement), ms
    fetch_overhead_ms: float = 3.0
    #: prefill time per 1,000 tokens, per model label or ``*`` (for ``prefill_saved_ms``); none: not estimated
    prefill_ms_per_1k_tokens: dict[str, float] = field(default_factory=dict)


def block_bytes(fp: LayoutFingerprint) -> int | None:
    """Bytes of one block of a worker of fingerprint ``fp`` over all its ranks (None: dtype unknown here)."""
    size = _DTYPE_BYTES.get(fp.dtype.split("/")[0])
    if size is None:
        return None
    kv = 1 if fp.is_mla else 2
    heads = 1 if fp.is_mla else fp.num_kv_heads
    return fp.num_layers * kv * heads * fp.head_dim * fp.tokens_per_block * size


def _by_matched_tokens(s: WorkerScore) -> int:
    return s.matched_tokens


def _serves(fp: LayoutFingerprint, model: str) -> bool:
    return model in (fp.model_id, model_label(fp.model_id), identity_of(fp.model_id))


class _Candidate:
    """A live worker as one listing of the store has it, for one model: its lease's end, compat key, costs
    per block and, built on first use, its score when it holds nothing (most workers, for most prompts:
    reused until the store changes, which lists again)."""

    __slots__ = ("worker", "wid", "ends", "key", "costs", "events_only", "unshared", "fixed", "zeros")

    def __init__(self, worker: WorkerRecord, ends: float, key: str,
                 costs: tuple[float | None, float | None]) -> None:
        self.worker, self.wid, self.ends, self.key, self.costs = worker, worker.worker_id, ends, key, costs
        self.events_only = worker.kind == "events-only"  # an engine without remote-g2
        self.unshared = unshared_kind(worker.fingerprint.model_id)  # an instance without a model identity: why
        # the fields of its WorkerScore that no prompt changes, in their order
        self.fixed = (worker.worker_id, worker.endpoint, worker.tp_size, worker.fingerprint.model_id, key)
        self.zeros: dict[tuple[Any, ...], WorkerScore] = {}  # (*tier names, block size) -> that score at 0


class Scorer:
    """Answers :class:`ScoreRequest` from a store (and the server's mirror, when it keeps one). Thread-safe."""

    def __init__(self, store: RegistryStore, config: ScoringConfig | None = None, *, mirror: PrefixIndex | None = None,
                 engines: EngineCaches | None = None) -> None:
        self.store, self.config, self._mirror, self.engines = store, config or ScoringConfig(), mirror, engines
        self._lock = threading.Lock()
        self._workers: list[tuple[WorkerRecord, float, str]] = []  # each with its lease's end and compat key
        self._by_model: dict[str | None, list[Any]] = {}
        self._workers_at = float("-inf")
        self._workers_gen: int | None = None
        self._hashers: dict[tuple[str, int], VllmBlockHasher] = {}
        self._keys: dict[LayoutFingerprint, str] = {}  # fingerprint -> compat key (a digest: computed once)

    def _compat_key(self, fp: LayoutFingerprint) -> str:
        key = self._keys.get(fp)
        if key is None:
            if len(self._keys) > 4096:  # fingerprints come and go with deployments: start over now and then
                self._keys.clear()
            key = self._keys[fp] = fp.compat_key()
        return key

    def _listing(self, now: float) -> tuple[list[tuple[WorkerRecord, float, str]], dict[str | None, list[Any]]]:
        """The live workers (each with its lease's end and compat key) and, for that list, each model's share.

        Reused while the store's ``generation`` stays the same (for ``_WORKERS_TTL_S`` where it has none).
        """
        gen = self.store.generation
        with self._lock:
            if gen == self._workers_gen if gen is not None else now - self._workers_at < _WORKERS_TTL_S:
                return self._workers, self._by_model
        workers = [(w, now + w.lease_expires_in_ms / 1000.0, self._compat_key(w.fingerprint))
                   for w in self.store.list_workers() if w.live]
        by_model: dict[str | None, list[Any]] = {}
        with self._lock:  # (gen was read before the list: a change meanwhile lists again next time)
            self._workers, self._by_model, self._workers_at, self._workers_gen = workers, by_model, now, gen
        return workers, by_model

    def _candidates(self, model: str | None) -> tuple[list[_Candidate], str | None]:
        """The live workers serving ``model`` (all, for None), least loaded first (then by worker id); a
        lease that lapsed since the store was listed drops its worker. With them, their one compat key when
        they all have the same and each is a remote-g2 worker with an identity (the usual fleet), else None."""
        now = time.monotonic()
        workers, by_model = self._listing(now)
        entry = by_model.get(model)
        if entry is None:
            listed = [_Candidate(w, ends, key, self._costs_of(w.fingerprint, model)) for w, ends, key in workers
                      if model is None or _serves(w.fingerprint, model)]
            listed.sort(key=lambda c: (c.worker.load, c.worker.worker_id))
            keys = {c.key for c in listed}
            uniform = keys.pop() if len(keys) == 1 and not any(c.events_only or c.unshared for c in listed) \
                else None
            entry = (listed, uniform)
            if len(by_model) < 1024:  # models are whatever callers send: bounded (a dict write: atomic)
                by_model[model] = entry
        listed, uniform = entry
        return [c for c in listed if c.ends > now], uniform

    def _hasher(self, fp: LayoutFingerprint) -> VllmBlockHasher:
        key = (fp.hash_scheme, fp.tokens_per_block)
        hasher = self._hashers.get(key)
        if hasher is None:
            if not fp.hash_scheme:
                raise CannotScore(f"workers of {fp.model_id} publish no hash scheme: their block hashes cannot "
                                  "be computed from token ids here (send block_hashes instead)",
                                  reason="unknown_scheme")
            hasher = hasher_for_scheme(fp.hash_scheme, fp.tokens_per_block, self.config.hash_seeds)
            self._hashers[key] = hasher  # (a dict write: safe under the GIL; a race builds one twice)
        return hasher

    def _lookup(self, hashes: list[bytes], compat_key: str) -> dict[str, int]:
        """worker id -> blocks matched from block 0, for every live holder of ``hashes[0]`` of ``compat_key``."""
        mirror = self._mirror
        if mirror is not None:
            held = mirror.held_prefixes(hashes, compat_key)
            if held is not None:
                return held
        return self.store.held_prefixes(hashes, compat_key)

    def _hashes_needed(self, chain: PromptChain) -> list[bytes]:
        """The first blocks of ``chain`` that anyone can match: no further than the first block nobody holds.

        ``_FIRST_BLOCKS`` first; while some worker (any, live or not, of any
        layout: a superset, so nothing is cut short) holds the last of them,
        ``_GROWTH`` times as many. Where the store cannot tell without a
        round trip (Redis without the server's mirror), the whole prompt. A
        long prompt with a short cached prefix then costs about that prefix.
        """
        n = min(chain.total, _FIRST_BLOCKS)
        while n < chain.total:
            last = chain.upto(n)[n - 1]
            mirror = self._mirror
            held = mirror.holds_any(last) if mirror is not None else None
            if held is None:
                held = self.store.holds_any(last)
            if held is False:
                break
            n = chain.total if held is None else min(chain.total, n * _GROWTH)
        return chain.upto(n)

    def score(self, req: ScoreRequest) -> ScoreReply:
        """Score ``req`` (see the module docstring); :class:`CannotScore` when it cannot be answered exactly."""
        if (req.token_ids is None) == (req.block_hashes is None):
            raise CannotScore("send token_ids or block_hashes (one of them)", reason="bad_request")
        if req.token_ids is not None and not req.model:
            raise CannotScore("token_ids need a model (the workers' hashes depend on their hash scheme and block "
                              "size)", reason="bad_request")
        if req.token_ids is not None and len(req.token_ids) > MAX_SCORE_TOKENS:
            raise CannotScore(f"{len(req.token_ids)} tokens: at most {MAX_SCORE_TOKENS} are scored",
                              reason="too_large")
        if req.block_hashes is not None and len(req.block_hashes) > MAX_SCORE_HASHES:
            raise CannotScore(f"{len(req.block_hashes)} block hashes: at most {MAX_SCORE_HASHES}", reason="too_large")
        if (req.lora_name is None) != (req.lora_path is None):
            raise CannotScore("a LoRA adapter is hashed by its name and path: send both lora_name and lora_path",
                              reason="bad_request")
        wanted = set(req.workers) if req.workers is not None else None
        cands, uniform = self._candidates(req.model)
        if wanted is not None:
            cands = [c for c in cands if c.worker.worker_id in wanted]
        lora = (req.lora_name, req.lora_path) if req.lora_name is not None else None
        unscored: list[tuple[str, str, str]] = []  # (worker id, reason code, why)
        chains: dict[tuple[str, int, int], PromptChain] = {}

        def chain_of(hasher: VllmBlockHasher, block_size: int | None = None) -> PromptChain:
            # A worker whose vLLM hashes more finely than its block publishes every stride-th hash.
            stride = (block_size or hasher.block_size) // hasher.block_size
            hk = (hasher.scheme, hasher.block_size, stride)
            if hk not in chains:
                chains[hk] = PromptChain(hasher, req.token_ids or [], lora=lora, cache_salt=req.cache_salt,
                                         max_blocks=MAX_SCORE_HASHES, stride=stride)
            return chains[hk]

        def hashes_of(hasher: VllmBlockHasher) -> list[bytes]:
            chain = chain_of(hasher)
            return chain.upto(chain.total)

        # Per compat key (a hash space and block size): the hashes and who holds how much of them.
        groups: dict[str, tuple[list[bytes], dict[str, int], int] | CannotScore] = {}
        engines = self.engines
        matched: list[WorkerScore] = []  # some tokens matched: sorted below
        idle: list[WorkerScore] = []  # none: already in the answer's order (least loaded, then worker id)
        if uniform is not None and engines is None and (lora is None or req.token_ids is None) and cands:
            cands = self._score_uniform(cands, uniform, req, chain_of, matched, idle, unscored)
        for c in cands:
            if c.unshared is not None:  # publishes nothing: what its own engine holds is not known here
                unscored.append((c.wid, "no_identity", f"this instance has no model identity ({c.unshared}): it "
                                 "shares and publishes no block (its log says why)"))
                continue
            if c.events_only:  # each its own hash space, learned from its events
                hasher, why = (None, "this server follows no KV events (serve --vllm-kv-events)") \
                    if engines is None else engines.hasher(c.wid)
                odd = engines.unscorable(c.wid) if engines is not None else None
                if odd is not None:  # several KV-cache groups, or blocks too large to hash: not one chain
                    unscored.append((c.wid, *odd))
                    continue
                if req.token_ids is not None and hasher is None:
                    unscored.append((c.wid, "scheme_not_learned", why))
                    continue
                # (asked by block hashes, those are its keys whether or not its hash space is known)
                hashes = hashes_of(hasher) if req.token_ids is not None else list(req.block_hashes or ())
                tiers = engines.matched(c.wid, hashes) if engines is not None and hashes else {}
                bs = hasher.block_size if hasher is not None else (engines.block_size(c.wid)
                                                                   if engines is not None else None)
                score = self._worker_score(c, tiers, bs, readable=False)
                (matched if score.matched_tokens else idle).append(score)
                continue
            if lora is not None and req.token_ids is not None:  # (sent block_hashes are its keys as they are)
                unscored.append((c.wid, "unsupported_input", _LORA_KEYED_BY_DIGEST))
                continue
            group = groups.get(c.key)
            if group is None:
                fp = c.worker.fingerprint
                try:
                    if req.token_ids is None:
                        hashes = list(req.block_hashes or ())
                        held = self._lookup(hashes, c.key) if hashes else {}
                    else:  # (an engine's G1 may hold more than any G2: the whole prompt, where engines count)
                        chain = chain_of(self._hasher(fp), fp.tokens_per_block)
                        hashes = self._hashes_needed(chain) if engines is None else chain.upto(chain.total)
                        held = self._lookup(hashes, c.key) if hashes else {}
                except CannotScore as e:
                    group = e
                else:
                    group = (hashes, held, fp.tokens_per_block)
                groups[c.key] = group
            if isinstance(group, CannotScore):
                unscored.append((c.wid, group.reason, group.message))
                continue
            hashes, held, bs = group
            g2 = held.get(c.wid, 0)
            # its engine's own tiers, where this server follows them and they are one chain of blocks (else G2 alone)
            if engines is not None and hashes and engines.unscorable(c.wid) is None:
                score = self._worker_score(c, {**engines.matched(c.wid, hashes), "g2": g2}, bs, readable=True)
                (matched if score.matched_tokens else idle).append(score)
            elif g2:
                matched.append(self._build_score(c, {"g2": g2}, bs, g2, readable=True))
            else:  # the usual answer for most of a fleet: built once per listing
                idle.append(c.zeros.get(("g2", bs)) or self._worker_score(c, {"g2": 0}, bs, readable=True))
        if unscored and not matched and not idle:
            _, reason, why = unscored[0]
            raise CannotScore(f"no worker of this model can be scored: {unscored[0][0]}: {why}",
                              reason="unknown_scheme" if reason in _NOT_A_CHAIN else reason)
        matched.sort(key=_by_matched_tokens, reverse=True)  # stable: least loaded, then worker id, among equals
        best = matched[0].worker_id if matched else None
        return ScoreReply(req.model, None if req.token_ids is None else len(req.token_ids), matched + idle, best,
                          [{"worker_id": wid, "reason": reason, "message": why} for wid, reason, why in unscored])

    def _score_uniform(self, cands: list[_Candidate], key: str, req: ScoreRequest, chain_of: Any,
                       matched: list[WorkerScore], idle: list[WorkerScore],
                       unscored: list[tuple[str, str, str]]) -> list[_Candidate]:
        """:meth:`score`'s loop for the usual fleet (one compat key, remote-g2 workers, G2 alone): one lookup,
        then each worker's score, in the candidates' order. Returns the candidates left to the general loop
        (none)."""
        fp = cands[0].worker.fingerprint
        bs = fp.tokens_per_block
        try:
            if req.token_ids is None:
                hashes = list(req.block_hashes or ())
            else:
                hashes = self._hashes_needed(chain_of(self._hasher(fp), bs))
            held = self._lookup(hashes, key) if hashes else {}
        except CannotScore as e:
            unscored.extend((c.wid, e.reason, e.message) for c in cands)
            return []
        zero = ("g2", bs)
        build, zero_score = self._build_score, self._worker_score
        for c in cands:
            g2 = held.get(c.wid)
            if g2:
                matched.append(build(c, {"g2": g2}, bs, g2, readable=True))
            else:
                idle.append(c.zeros.get(zero) or zero_score(c, {"g2": 0}, bs, readable=True))
        return []

    def _worker_score(self, c: _Candidate, tiers: dict[str, int], block_size: int | None, *,
                      readable: bool) -> WorkerScore:
        """One worker's score: its longest tier's match; a fetch only from what remote-g2 can read (its G2)."""
        n = max(tiers.values(), default=0)
        if n == 0:  # holds nothing: the same answer until the store changes
            names = (*tiers, block_size)
            score = c.zeros.get(names)
            if score is None:
                score = c.zeros[names] = self._build_score(c, tiers, block_size, 0, readable=readable)
            return score
        return self._build_score(c, tiers, block_size, n, readable=readable)

    def _build_score(self, c: _Candidate, tiers: dict[str, int], block_size: int | None, n: int, *,
                     readable: bool) -> WorkerScore:
        fetch_per_block, prefill_per_token = c.costs
        tokens = n * (block_size or 0)
        g2 = tiers.get("g2", 0)
        return WorkerScore(
            *c.fixed, block_size or 0, n, tokens, tiers, c.worker.load,
            None if prefill_per_token is None or block_size is None else round(tokens * prefill_per_token, 3),
            None if fetch_per_block is None or not readable else
            round(self.config.fetch_overhead_ms * (g2 > 0) + g2 * fetch_per_block, 3),
            readable)

    def _costs_of(self, fp: LayoutFingerprint, model: str | None) -> tuple[float | None, float | None]:
        """(fetch ms per block, prefill ms per token) of a worker of ``fp`` asked for ``model``; None: unknown."""
        rates = self.config.prefill_ms_per_1k_tokens
        rate = rates.get(model_label(fp.model_id) or "", rates.get(model or "", rates.get("*")))
        per_block = block_bytes(fp)
        return (None if per_block is None else per_block / (self.config.fetch_gbps * 1e6),
                None if rate is None else rate / 1000.0)


def parse_prefill_rates(texts: Iterable[str]) -> dict[str, float]:
    """``--score-prefill-ms-per-1k`` values, ``MS`` (every model) or ``MODEL=MS``, into a label -> rate map."""
    out: dict[str, float] = {}
    for text in texts:
        model, sep, value = text.rpartition("=")
        try:
            rate = float(value)
        except ValueError:
            raise ConfigError(f"prefill rate {text!r}: expected MS or MODEL=MS") from None
        if not rate >= 0:
            raise ConfigError(f"prefill rate {text!r} is not a non-negative number")
        out[model if sep else "*"] = rate
    return out
