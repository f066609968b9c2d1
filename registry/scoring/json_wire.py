"""The scoring API's JSON, both ways: request bodies into :class:`~.scorer.ScoreRequest`, answers into bytes.

Two request shapes are read (docs/scoring.md maps every field):

* ``POST /v1/score``: ``{"model", "token_ids" | "block_hashes", "lora_name",
  "lora_path", "cache_salt", "workers"}``, answered with
  ``{"model", "num_tokens", "best", "workers": [...], "unscored"}``;
* ``POST /query``, the shape of Dynamo's standalone indexer and Mooncake's
  conductor: ``{"model_name" | "model", "token_ids", "lora_name",
  "cache_salt", "instance_id", "block_size"}``, answered per instance in
  tokens, ``{"longest_matched", "gpu", "cpu", "disk", "dp"}``, with the tiers
  cumulative as those routers read them, and ``scores`` (device tokens per
  DP rank) alike. A LoRA adapter is named there without its path, which vLLM
  hashes too, so ``/query`` needs ``serve --score-lora NAME=PATH``.

``model_name`` is accepted for ``model`` (Dynamo's and llm-d's name for it);
``block_hashes`` are hex strings; ``token_ids`` are parsed in C++ straight
from the JSON text (:func:`token_ids_from_json`),
never as a Python int per token. Unknown fields are ignored, as Dynamo's
indexer ignores them. Anything malformed is :class:`~remote_g2.errors.CannotScore`
with reason ``bad_request``; nothing here touches a socket.
"""

from __future__ import annotations

import array
from typing import Any

import msgspec

from remote_g2 import _vllm_hash
from remote_g2.errors import CannotScore
from remote_g2.identity.hashing import hash_from_hex

from .scorer import ScoreReply, ScoreRequest

__all__ = ["token_ids_from_json", "split_token_ids", "request_from_json", "query_request", "query_reply",
           "score_answer", "query_answer", "error_answer"]


def token_ids_from_json(raw: bytes | memoryview | object) -> array.array:
    """A JSON array of token ids (its raw text: any bytes-like object, ``msgspec.Raw`` included) as
    ``array('I')``, parsed in C++ without a Python int per token; :class:`CannotScore` (``bad_request``)
    for anything but integers in ``[0, MAX_TOKEN_ID]`` (:mod:`remote_g2.identity.vllm_hashing`)."""
    try:
        ids = array.array("I")
        ids.frombytes(_vllm_hash.parse_ids(raw))
        return ids
    except ValueError as e:
        raise CannotScore(str(e), reason="bad_request") from None


def split_token_ids(body: bytes | bytearray) -> tuple[array.array, bytes] | None:
    """A JSON body's ``token_ids`` array, cut out: ``(ids, the body with the array replaced by null)``.

    Only for the plain case (a JSON object with unescaped keys, exactly one
    ``token_ids``, an array of valid ids); None for anything else, which the
    caller then decodes whole (and refuses with its own errors). What is cut
    is where the object's structure puts that member's value, and every
    other byte stays in the rest for the caller's decoder to validate.
    """
    split = _vllm_hash.split_ids(body)
    if split is None:
        return None
    ids = array.array("I")
    ids.frombytes(split[0])
    return ids, split[1]


class _Body(msgspec.Struct, forbid_unknown_fields=False):  # unknown fields are ignored, as Dynamo's indexer does
    model: str | None = None
    model_name: str | None = None
    token_ids: msgspec.Raw = msgspec.Raw()  # parsed in C++ (token_ids_from_json): no Python int per token
    block_hashes: list[str] | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    workers: list[str] | None = None
    instance_id: str | None = None  # /query: one instance (Mooncake)
    block_size: int | None = None   # /query: the caller's block size (Mooncake); checked, never assumed


_decoder = msgspec.json.Decoder(_Body)
_encoder = msgspec.json.Encoder()


def _decode(body: bytes) -> _Body:
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise CannotScore(f"malformed request body: {e}", reason="bad_request") from None
    except RecursionError:  # msgspec's guard against a deeply nested body (in any field, known or not)
        raise CannotScore("malformed request body: nested too deeply", reason="bad_request") from None


def _model(b: _Body) -> str | None:
    """The request's model, named ``model`` or (Dynamo, llm-d) ``model_name``; both, they must agree."""
    if b.model and b.model_name and b.model != b.model_name:
        raise CannotScore("model and model_name differ", reason="bad_request")
    return b.model or b.model_name


def _read(body: bytes | bytearray) -> tuple[_Body, Any]:
    """The body's fields, and its token ids (None: none sent).

    The usual body (an object with plain keys and one valid ``token_ids``
    array) has its array cut out in C++ first (:func:`split_token_ids`),
    so msgspec reads tens of bytes, not the array a second time; any other
    body is decoded whole, the array then parsed from msgspec's raw view.
    """
    split = split_token_ids(body)
    if split is not None:
        ids, rest = split
        return _decode(rest), ids
    return _read_whole(body)


def _read_whole(body: bytes | bytearray) -> tuple[_Body, Any]:
    b = _decode(body)
    raw = b.token_ids  # (read in place: a Raw is a view of the body)
    return b, (None if len(raw) == 0 or (len(raw) == 4 and bytes(raw) == b"null") else token_ids_from_json(raw))


def request_from_json(body: bytes) -> ScoreRequest:
    """A ``/v1/score`` body as a :class:`ScoreRequest`; :class:`CannotScore` (``bad_request``) if malformed."""
    b, token_ids = _read(body)
    hashes = None
    if b.block_hashes is not None:
        try:
            hashes = [hash_from_hex(h) for h in b.block_hashes]
        except ValueError as e:
            raise CannotScore(f"block_hashes: {e}", reason="bad_request") from None
    return ScoreRequest(model=_model(b), token_ids=token_ids, block_hashes=hashes,
                        lora_name=b.lora_name, lora_path=b.lora_path, cache_salt=b.cache_salt, workers=b.workers)


def query_request(body: bytes, loras: dict[str, str]) -> tuple[ScoreRequest, int | None]:
    """A ``/query`` body (Dynamo / Mooncake) as a :class:`ScoreRequest` and the block size it states."""
    b, token_ids = _read(body)
    model = _model(b)
    if token_ids is None or not model:
        raise CannotScore("/query needs token_ids and model_name", reason="bad_request")
    path = None
    if b.lora_name:
        path = b.lora_path or loras.get(b.lora_name)
        if path is None:
            raise CannotScore(f"LoRA adapter {b.lora_name!r}: vLLM hashes its path too, which this request does not "
                              "name; give it as lora_path, or to `remote-g2 serve --score-lora NAME=PATH`",
                              reason="unsupported_input")
    return ScoreRequest(model=model, token_ids=token_ids, lora_name=b.lora_name or None,
                        lora_path=path, cache_salt=b.cache_salt,
                        workers=None if b.instance_id is None else [b.instance_id]), b.block_size


def query_reply(reply: ScoreReply, block_size: int | None) -> dict[str, Any]:
    """The ``/query`` answer: per instance, tokens matched in each (cumulative) tier."""
    if block_size is not None and any(w.block_size != block_size for w in reply.workers):
        sizes = sorted({w.block_size for w in reply.workers})
        raise CannotScore(f"block_size {block_size}: the workers of this model use {sizes}", reason="unsupported_input")
    instances, scores = {}, {}
    for w in reply.workers:  # their tiers are cumulative: gpu <= cpu <= disk (a prefix held in any faster tier)
        bs = w.block_size
        gpu = w.tier.get("g1", 0) * bs
        cpu = max(gpu, w.tier.get("g2", 0) * bs)
        disk = max(cpu, w.matched_tokens)
        instances[w.worker_id] = {"longest_matched": w.matched_tokens, "gpu": gpu, "cpu": cpu, "disk": disk,
                                  "dp": {"0": gpu}}
        scores[w.worker_id] = {"0": gpu}
    return {"scores": scores, "instances": instances}


def reply_to_json(reply: ScoreReply) -> dict[str, Any]:
    return {"model": reply.model, "num_tokens": reply.num_tokens, "best": reply.best,
            "workers": reply.workers, "unscored": reply.unscored}  # msgspec encodes the Structs as they are


def score_answer(reply: ScoreReply) -> bytes:
    """The ``/v1/score`` answer's bytes."""
    return _encoder.encode(reply_to_json(reply))


def query_answer(reply: ScoreReply, block_size: int | None) -> bytes:
    """The ``/query`` answer's bytes; :class:`CannotScore` when ``block_size`` is not the workers'."""
    return _encoder.encode(query_reply(reply, block_size))


def error_answer(reason: str, message: str) -> bytes:
    """Every error's body: ``{"error": {"reason", "message"}}``."""
    return _encoder.encode({"error": {"reason": reason, "message": message}})
