"""vLLM's block hashes computed from token ids, byte for byte, without vLLM: what a router's prompt maps to.

vLLM (``vllm/v1/core/kv_cache_utils.py``, 0.32) hashes a request's full
blocks as a chain::

    NONE_HASH = H(seed)                               seed: PYTHONHASHSEED, else "vllm-none-hash"
    h_0 = H((NONE_HASH, tuple(tokens[0:B]), extra_0))
    h_i = H((h_{i-1},   tuple(tokens[iB:(i+1)B]), extra_i))

where ``H`` is the instance's ``prefix_caching_hash_algo``: ``sha256``
(SHA-256 of the object's pickle, protocol 5) or ``sha256_cbor`` (SHA-256 of
its canonical CBOR). ``extra_i`` is None or a tuple of tagged keys, in this
order: ``("lora", lora_name, lora_path)`` on every block of a LoRA request,
then ``("cache_salt", salt)`` on block 0 of a salted one (multimodal inputs
and prompt embeddings add keys this module does not compute: such requests
are refused, never guessed).

:class:`VllmBlockHasher` writes the chain in C++ (``cpp_ext/vllm_hash.cpp``:
for these objects both encodings are a fixed frame around the token ids, and
the extra keys are encoded once, by :func:`pickle.dumps` or ``cbor2``, the
encoders vLLM uses, in their place in the outer tuple so that pickle's
back-references are vLLM's); a pickle too large for one frame goes through
:func:`pickle.dumps` block by block. ``tests/test_score_api.py`` and
``tests/test_score_exactness.py`` hold the chain to vLLM's code written out
with those encoders, and the vLLM suite to vLLM's own
``request.block_hashes``. Only encoding happens here: nothing is unpickled.

A hash space is named as the vLLM connector names it (:func:`scheme_name`:
``vllm/<algo>/<8 hex digits of the seed's digest>``): the registry matches a
seed it was given to a worker's published scheme by that digest, so a seed
is never guessed — vLLM's documented default included, which is used only
where a worker's scheme names it. A worker whose vLLM hashes more finely than
its block names that unit too (:func:`with_hash_unit`).
"""

from __future__ import annotations

import array
import functools
import hashlib
import pickle  # to encode, as vLLM's sha256 does: nothing here is ever unpickled
from collections.abc import Iterable, Sequence

from remote_g2 import _vllm_hash
from remote_g2.errors import CannotScore

__all__ = ["ALGORITHMS", "DEFAULT_SEED", "MAX_BLOCK_SIZE", "MAX_TOKEN_ID", "VllmBlockHasher", "PromptChain",
           "scheme_name", "with_hash_unit", "parse_scheme", "hasher_for_scheme"]

assert array.array("I").itemsize == 4  # cpp_ext/vllm_hash.cpp reads token buffers as uint32

#: The algorithms whose hashes can be recomputed here (xxhash's seed must stay secret: never shared).
ALGORITHMS = ("sha256", "sha256_cbor")
#: vLLM's chain seed for the SHA-256 algorithms when PYTHONHASHSEED is unset (``DEFAULT_NONE_HASH_SEED``).
DEFAULT_SEED = "vllm-none-hash"
#: Token ids are pickled as 4-byte signed ints below this; no tokenizer's vocabulary comes near it.
MAX_TOKEN_ID = 2**31 - 1
#: The largest block (tokens) hashed here.
MAX_BLOCK_SIZE = 4096
_MAX_KEY_CHARS = 4096  # a LoRA name or path, a salt: longer ones are refused
_PICKLE_FRAME_TARGET = 64 * 1024  # pickle's _FRAME_SIZE_TARGET: a body under it is one frame
# The outer tuple the extra keys are pickled inside (VllmBlockHasher._encode_extra): a parent hash, a token tuple.
_STAND_IN_PARENT = bytes(32)
_STAND_IN_HEAD = b"C " + _STAND_IN_PARENT + b"\x94K\x00\x85\x94"  # SHORT_BINBYTES 32, MEMOIZE, (0,), MEMOIZE
_EXTRA_AT = 11 + len(_STAND_IN_HEAD)


def scheme_name(algo: str, seed: str) -> str:
    """The hash space's name, ``vllm/<algo>/<digest of seed>`` (the vLLM connector publishes the same)."""
    return f"vllm/{algo}/{hashlib.blake2b(seed.encode(), digest_size=4).hexdigest()}"


def with_hash_unit(scheme: str, hash_unit: int | None, block_size: int) -> str:
    """The hash space a worker publishes in when vLLM hashes every ``hash_unit`` tokens and the worker
    publishes one hash per block of ``block_size`` (the last of the block's): ``<scheme>/u<hash_unit>``.

    vLLM hashes more finely than the block with several KV-cache groups (the
    GCD of their block sizes, or ``prefix_match_unit``); the published hash
    of a block is then the hash of its last unit, which chains over the
    whole prefix. The same tokens give other hashes than with one unit per
    block, so it is another hash space, and named so: a scorer that cannot
    read the suffix lists the worker as unscored instead of scoring it zero.
    ``scheme`` unchanged where the unit is the block (or not known: vLLM then
    hashes per block).
    """
    if type(hash_unit) is not int or hash_unit <= 0 or hash_unit == block_size:
        return scheme
    return f"{scheme}/u{hash_unit}"


def parse_scheme(scheme: str) -> tuple[str, str, int | None]:
    """``(algo, seed digest, hash unit or None)`` of a scheme name (:func:`scheme_name`, :func:`with_hash_unit`);
    :class:`CannotScore` for one these hashes cannot reproduce."""
    parts = scheme.split("/")
    unit: int | None = None
    if len(parts) == 4 and parts[3][:1] == "u" and parts[3][1:].isascii() and parts[3][1:].isdigit():
        unit = int(parts[3][1:])
        parts = parts[:3]
    if len(parts) != 3 or parts[0] != "vllm":
        raise CannotScore(f"hash scheme {scheme!r} is not a vLLM one: its block hashes cannot be computed from "
                          "token ids here (send block_hashes instead)", reason="unknown_scheme")
    if parts[1] not in ALGORITHMS:
        raise CannotScore(f"hash scheme {scheme!r}: vLLM's {parts[1]!r} hashes are seeded with a secret, or unknown "
                          f"here; computable: {', '.join(ALGORITHMS)} (send block_hashes instead)",
                          reason="unknown_scheme")
    return parts[1], parts[2], unit


def hasher_for_scheme(scheme: str, block_size: int, seeds: Iterable[str]) -> VllmBlockHasher:
    """A hasher for a worker's published ``scheme``, with the one of ``seeds`` whose digest the scheme names.

    Its ``block_size`` is the scheme's hash unit (``block_size`` itself
    without one): a worker of blocks of ``block_size`` tokens publishes
    every ``block_size // hasher.block_size``-th of its hashes
    (:class:`PromptChain`'s ``stride``).
    """
    algo, digest, unit = parse_scheme(scheme)
    if unit is not None and not (1 <= unit <= MAX_BLOCK_SIZE and block_size % unit == 0):
        raise CannotScore(f"hash scheme {scheme!r}: vLLM hashes every {unit} tokens, which does not divide the "
                          f"worker's {block_size}-token blocks (its connector then shares nothing)",
                          reason="unknown_scheme")
    base = scheme.rsplit("/", 1)[0] if unit is not None else scheme
    for seed in seeds:
        if scheme_name(algo, seed) == base:
            return VllmBlockHasher(algo, seed, unit or block_size)
    raise CannotScore(f"hash scheme {scheme!r}: none of the configured hash seeds has digest {digest} (give the "
                      "workers' PYTHONHASHSEED to `remote-g2 serve --score-hash-seed`)", reason="seed_unknown")


class VllmBlockHasher:
    """One vLLM hash space (algorithm, seed) at one block size: token ids → the chain of block hashes.

    Thread-safe (no state changes after construction). Token ids must be
    ints in ``[0, MAX_TOKEN_ID]``; anything else raises :class:`CannotScore`
    with reason ``bad_request``.
    """

    def __init__(self, algo: str, seed: str, block_size: int) -> None:
        if algo not in ALGORITHMS:
            raise CannotScore(f"algorithm {algo!r} is not one of {ALGORITHMS}", reason="unknown_scheme")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise CannotScore(f"block size {block_size} out of range", reason="bad_request")
        self.algo, self.seed, self.block_size = algo, seed, block_size
        self.scheme = scheme_name(algo, seed)
        self._cbor = algo == "sha256_cbor"
        self._encode = _cbor_encoder() if self._cbor else _pickle_encoder
        self.none_hash = hashlib.sha256(self._encode(seed)).digest()

    def hashes(self, token_ids: Sequence[int], *, lora: tuple[str, str] | None = None,
               cache_salt: str | None = None, max_blocks: int | None = None, start: int = 0,
               parent: bytes | None = None) -> list[bytes]:
        """The hash of every full block of ``token_ids`` (at most ``max_blocks``), as vLLM computes them.

        ``lora`` is ``(lora_name, lora_path)`` as the instance loaded the
        adapter (vLLM hashes both); ``cache_salt`` the request's salt. From
        block ``start`` on, resuming the chain at ``parent`` (the hash of
        block ``start - 1``), the answer is what the whole chain would hold
        from there: :class:`PromptChain` computes a prompt's hashes in pieces.
        """
        bs = self.block_size
        if start and parent is None:
            raise ValueError("a chain resumed past block 0 needs its parent hash")
        n = max(0, len(token_ids) // bs - start)
        n = n if max_blocks is None else min(n, max_blocks)
        lora_keys: list[tuple[str, ...]] = []
        if lora is not None:
            name, path = (_as_engine_str(x) for x in lora)
            lora_keys.append(("lora", name, path))
        first = lora_keys + ([("cache_salt", _as_engine_str(cache_salt))] if cache_salt else [])
        extra = tuple(lora_keys) if lora_keys else None
        extra0 = (tuple(first) if first else None) if start == 0 else extra  # the salt is block 0's only
        enc0, enc = self._encode_extra(extra0), self._encode_extra(extra)
        parent = self.none_hash if start == 0 else parent
        # One pickle frame holds the whole body below pickle's frame target; past it (huge blocks with
        # long keys) pickle splits frames its own way, so pickle itself encodes (_chain_python).
        if self._cbor or 5 * bs + max(len(enc0), len(enc)) + 64 < _PICKLE_FRAME_TARGET:
            try:
                return _vllm_hash.chain(parent, token_ids, bs, n, self._cbor, enc0, enc, start)
            except (ValueError, TypeError) as e:
                raise CannotScore(f"token ids must be ints in [0, {MAX_TOKEN_ID}] ({e})", reason="bad_request") \
                    from None
        return self._chain_python(token_ids[start * bs:(start + n) * bs], n, parent, extra0, extra)

    def _encode_extra(self, extra: tuple[tuple[str, ...], ...] | None) -> bytes:
        """``extra`` as its encoding reads inside the block's tuple (cpp_ext/vllm_hash.cpp's contract).

        A pickle writes an object it has already written as a back-reference
        to the memo index it got then (BINGET n). Inside vLLM's outer tuple
        the parent hash took index 0 and the token tuple index 1, so the keys
        are pickled in that place: inside ``(32 bytes, (token,), extra)``,
        and cut out. Pickled alone they would count from 0, and every
        back-reference (two keys that are one object: :func:`_as_engine_str`)
        would point at the wrong object.
        """
        if extra is None:
            return b"\xf6" if self._cbor else b"N"
        if self._cbor:  # canonical CBOR without value sharing: no back-references
            return self._encode(extra)
        data = _pickle_encoder((_STAND_IN_PARENT, (0,), extra))
        # PROTO 5, FRAME <8-byte length>, then the parent and the token tuple as the C++ chain writes them;
        # after the keys, TUPLE3 MEMOIZE STOP.
        assert data[:3] == b"\x80\x05\x95" and data[11:_EXTRA_AT] == _STAND_IN_HEAD and data[-3:] == b"\x87\x94."
        return data[_EXTRA_AT:-3]

    def _chain_python(self, token_ids: Sequence[int], n: int, parent: bytes, extra0: object,
                      extra: object) -> list[bytes]:
        """The chain with vLLM's encoder itself, block by block (about ten times slower than the C++ one)."""
        if token_ids and (set(map(type, token_ids)) != {int} or min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID):
            raise CannotScore(f"token ids must be ints in [0, {MAX_TOKEN_ID}]", reason="bad_request")
        bs, encode, sha = self.block_size, self._encode, hashlib.sha256
        out: list[bytes] = []
        for i in range(n):
            parent = sha(encode((parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra0 if i == 0 else extra))).digest()
            out.append(parent)
        return out


class PromptChain:
    """One prompt's block hashes in one hash space, computed only as far as asked, each block once.

    A scorer asks for the first blocks, and for more only while some worker
    holds every block asked so far: a long prompt whose cached prefix is
    short is not hashed to its end. ``total`` is how many full blocks the
    prompt has (at most ``max_blocks``). With ``stride`` > 1 a block is
    ``stride`` of the hasher's units and its hash is the last of theirs
    (:func:`with_hash_unit`: what a worker publishes when vLLM hashes more
    finely than its block).
    """

    def __init__(self, hasher: VllmBlockHasher, token_ids: Sequence[int], *, lora: tuple[str, str] | None = None,
                 cache_salt: str | None = None, max_blocks: int | None = None, stride: int = 1) -> None:
        if stride < 1:
            raise ValueError("stride must be at least 1")
        self.hasher, self._tokens, self._lora, self._salt, self.stride = hasher, token_ids, lora, cache_salt, stride
        n = len(token_ids) // (hasher.block_size * stride)
        self.total = n if max_blocks is None else min(n, max_blocks)
        self._hashes: list[bytes] = []
        self._units: list[bytes] = []  # with a stride: every unit's hash so far

    def upto(self, n: int) -> list[bytes]:
        """The hashes of blocks ``0 .. min(n, total) - 1`` (the list itself: read, do not change it)."""
        n = min(n, self.total)
        have = self._hashes
        if n > len(have):
            k = self.stride
            units = self._units if k > 1 else have
            start = len(units)
            units += self.hasher.hashes(self._tokens, lora=self._lora, cache_salt=self._salt,
                                        max_blocks=n * k - start, start=start, parent=units[-1] if units else None)
            if k > 1:
                have += units[len(have) * k + k - 1:n * k:k]
        return have if n == len(have) else have[:n]


def _as_engine_str(s: object) -> str:
    """``s`` as vLLM's engine core holds such a key: one object shared with an equal key exactly when
    CPython shares it, within the size vLLM's keys have.

    A pickle writes a str object a second time as a back-reference, so
    which keys are one object changes vLLM's hash. vLLM's engine core gets
    each request decoded from msgpack (``EngineCoreRequest``, the LoRA
    name and path and the salt each a string of its own), and CPython hands
    out one shared object only for the empty string and for each
    one-character Latin-1 string: two keys ``"a"`` are one object there,
    two keys ``"ab"`` are two. A copy here gives exactly that (a slice of
    one character below U+0100 is CPython's shared one), and is never the
    ``"lora"`` or ``"cache_salt"`` tag (interned) either. A caller that
    builds vLLM requests in its own process and passes one string object
    twice (an in-process engine) gets hashes no outside scorer can know.
    """
    if not isinstance(s, str):
        raise CannotScore(f"a LoRA name or path, or a cache salt, is a string, not {type(s).__name__}",
                          reason="bad_request")
    if len(s) > _MAX_KEY_CHARS:
        raise CannotScore(f"a hash key of {len(s)} characters (at most {_MAX_KEY_CHARS})", reason="bad_request")
    return (s + ".")[:-1]


def _pickle_encoder(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=5)  # vLLM: pickle.HIGHEST_PROTOCOL, 5 on the Pythons it supports


def _cbor_encoder():  # noqa: ANN202 - cbor2 is imported on first use (only sha256_cbor needs it)
    import cbor2

    return functools.partial(cbor2.dumps, canonical=True)
