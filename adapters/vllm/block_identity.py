"""When a block of one vLLM instance is the same block in another: hashes, hash space, KV dtype, fingerprint.

Reuse must never change an output, so two blocks are exchanged only when
vLLM itself would treat them as the same cached block *and* their bytes mean
the same thing:

* **Which block** — vLLM's own block hashes (``request.block_hashes``):
  32-byte chained hashes that already fold in the LoRA adapter (name and
  path), multimodal inputs, ``cache_salt`` and prompt embeddings. Equal
  hashes across processes need the same hash space: the algorithm
  (``prefix_caching_hash_algo``) and the seed of the chain (vLLM derives it
  from ``PYTHONHASHSEED`` when set; otherwise from a fixed default for the
  SHA-256 algorithms and from random bytes for xxhash, which therefore cannot
  be shared). :func:`hash_scheme` names that space, or refuses with a
  :class:`~remote_g2.errors.ConfigError` saying what to set.
* **What the bytes mean** — the model as loaded (:func:`model_identity`: a
  digest of the weight files vLLM read and the options that change K and V,
  never the path they were read from; given only when nothing on the
  weights' path changed after the engine started, :mod:`remote_g2.identity.load_snapshot`),
  the KV tensors' dtype (and the KV-cache
  quantisation, if any), the block size and the per-layer shape: the
  :class:`~remote_g2.protocol.messages.LayoutFingerprint` built by
  :func:`fingerprint`. The scheduler builds it from the configuration
  (:func:`kv_dtype_name` resolves ``"auto"`` the way vLLM allocates its
  tensors); each worker builds it from the tensors it was given and refuses
  to start when the two disagree, since lookups would then never match.

Nothing here imports vLLM: the functions read vLLM's config objects by
attribute, so they are tested without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from remote_g2.errors import ConfigError
from remote_g2.identity.load_snapshot import LoadSnapshot, StartMark, changed_after, hub_repo_dir, start_mark
from remote_g2.protocol.messages import LayoutFingerprint
from remote_g2.identity.model_identity import (
    WeightsDigest,
    checkpoint_files,
    model_id_for,
    override_model_id,
    weights_digest,
)
from remote_g2.identity.mounts import untrusted_reason
from remote_g2.identity.vllm_hashing import ALGORITHMS, DEFAULT_SEED, scheme_name

__all__ = ["CONFIG_FILES", "ModelIdentity", "config_files", "hash_scheme", "kv_dtype_name", "load_options",
           "model_identity", "prompt_block_hashes", "fingerprint", "weights_location"]

log = logging.getLogger("remote_g2.vllm")

_CRYPTO_ALGOS = frozenset(ALGORITHMS)
_SEEDED_ONLY_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


def hash_scheme(algo: str, environ: Mapping[str, str] = os.environ) -> str:
    """The hash space of this process's vLLM block hashes, e.g. ``vllm/sha256/1f0e33c2``.

    For the SHA-256 algorithms the seed's digest is part of the name, so
    instances whose seeds differ are told apart in the registry (their hashes
    would never be equal anyway). For xxhash the seed must stay secret (it
    is what stops precomputed collisions), so only its presence is named.
    Raises ``ConfigError`` when the hashes would be random per process.
    """
    seed = environ.get("PYTHONHASHSEED")
    if algo in _CRYPTO_ALGOS:
        return scheme_name(algo, seed if seed is not None else DEFAULT_SEED)
    if algo in _SEEDED_ONLY_ALGOS:
        if seed is None or seed == "random":
            raise ConfigError(
                f"prefix_caching_hash_algo={algo!r} without PYTHONHASHSEED: vLLM seeds its block hashes at random "
                "in every process, so no two instances can share a block. Set PYTHONHASHSEED to one secret value "
                "shared by every instance (in the environment of `vllm serve` / your process), or use "
                "prefix_caching_hash_algo='sha256' (vLLM's default).")
        return f"vllm/{algo}/seeded"
    raise ConfigError(f"prefix_caching_hash_algo={algo!r} is not one remote-g2 knows "
                      f"({sorted(_CRYPTO_ALGOS | _SEEDED_ONLY_ALGOS)}); not sharing blocks whose hash space is unknown")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_dtype_name(tensor_dtype: torch.dtype, cache_dtype: str) -> str:
    """The fingerprint's ``dtype``: the KV tensors' dtype, plus the quantisation when ``cache_dtype`` sets one.

    ``cache_dtype="auto"`` stores the model's dtype, so the tensors' dtype says
    it all; a quantised cache (``fp8``, ``fp8_e5m2``, ...) keeps its name
    too, since two formats can share a storage dtype.
    """
    name = _dtype_name(tensor_dtype)
    return name if cache_dtype in ("auto", "", None) else f"{name}/{cache_dtype}"


def resolved_kv_dtype(model_dtype: Any, cache_dtype: str) -> torch.dtype:
    """The dtype vLLM allocates its KV tensors in, from the model's dtype and ``cache_dtype`` (the scheduler's view)."""
    if cache_dtype in ("auto", "", None):
        if isinstance(model_dtype, torch.dtype):
            return model_dtype
        named = getattr(torch, str(model_dtype).removeprefix("torch."), None)
        if isinstance(named, torch.dtype):
            return named
        raise ConfigError(f"cannot resolve the model dtype {model_dtype!r} to a torch dtype")
    try:
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    except ImportError as e:  # pragma: no cover - the connector only runs inside vLLM
        raise ConfigError(f"cannot resolve kv cache dtype {cache_dtype!r} without vLLM ({e})") from e
    if cache_dtype not in STR_DTYPE_TO_TORCH_DTYPE:
        raise ConfigError(f"kv cache dtype {cache_dtype!r} is not one vLLM names")
    return STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]


# Config keys that say nothing about the computation (or differ between installs of one model), at any depth.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path"})
# Files beside config.json that vLLM 0.32 reads to build the model, digested byte for byte with the options:
# the config itself (and Mistral's params.json), the quantisation files its quantisation methods read
# (quantize_config.json, quant_config.json: get_config_filenames(); hf_quant_config.json: ModelOpt, merged into
# the config), and what the multimodal processor reads (an image's tokens are K and V like any other).
CONFIG_FILES = ("config.json", "params.json", "quantize_config.json", "quant_config.json", "hf_quant_config.json",
                "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
# vLLM load formats whose weights are files remote-g2 can find and digest (vLLM 0.32's loaders), with the
# checkpoint forms each reads, in its order of preference. Any other format (tensorizer, a streamer from
# object storage, ...) has no identity here: the instance shares nothing unless the model_id setting names it.
_FILE_FORMATS: dict[str, tuple[str, ...]] = {
    "auto": ("safetensors", "bin", "pt"), "hf": ("safetensors", "bin", "pt"),
    "safetensors": ("safetensors",), "fastsafetensors": ("safetensors",), "instanttensor": ("safetensors",),
    "mistral": ("safetensors",), "sharded_state": ("safetensors",),
    "pt": ("pt",), "npcache": ("bin",), "bitsandbytes": ("safetensors", "bin", "pt"), "gguf": ("gguf",),
}
_GENERATED_FORMATS = frozenset({"dummy"})


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The fingerprint's ``model_id`` for this instance, or why it has none (then it shares nothing).

    ``caveat``: what the after-start check could not prove (weights on a filesystem whose ctime cannot be
    trusted); the identity is given, and the log says so.
    """

    model_id: str | None
    why_not: str = ""
    weights: WeightsDigest | None = None
    where: str = ""  # the checkpoint that was digested
    caveat: str = ""
    #: digest, override; or why none: generated, load_format, absent, changed (after the start), unreadable
    kind: str = "digest"


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it, volatile and private keys left out at every depth (configs nest)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()
                if not str(k).startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(value):  # a callable hf_overrides: what it does is unknown, its name at least tells two apart
        return f"callable {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def config_files(where: Path | None, model_config: Any) -> dict[str, Path]:
    """The files beside the weights that vLLM reads to build the model (:data:`CONFIG_FILES`, by name), and the
    quantisation file ``hf_overrides.quantization_config_file`` names, wherever it is."""
    found = {name: where / name for name in CONFIG_FILES if where is not None and (where / name).is_file()}
    overrides = getattr(model_config, "hf_overrides", None)
    if isinstance(overrides, Mapping) and isinstance(overrides.get("quantization_config_file"), str):
        found["hf_overrides.quantization_config_file"] = Path(overrides["quantization_config_file"])
    return found


def load_options(model_config: Any, load_config: Any, cache_config: Any,
                 files: Mapping[str, Path] | None = None) -> dict[str, Any]:
    """Everything besides the weights' bytes that changes K or V for the same tokens, as vLLM resolved it.

    The model's whole config as vLLM read it (``hf_config``: every
    architecture field after ``hf_overrides``, the vision or audio tower's
    config, the quantisation config vLLM merged in from
    ``hf_quant_config.json``; its text config too; keys starting with ``_``
    and ``transformers_version`` left out at every depth), the model dtype,
    the weight quantisation (the method, the user's ``quantization_config``,
    ``hf_overrides`` as given: ``quantization_config_file``,
    ``quantization_config_dict_json``), the multimodal processor's kwargs,
    the load format (``bitsandbytes`` quantises while loading), the loader's
    extra config, the model implementation, whether fp8 KV scales are
    computed at run time, and the bytes of ``files`` (:func:`config_files`:
    the quantisation and processor files vLLM reads beside ``config.json``).
    """
    text = getattr(model_config, "hf_text_config", None)
    full = getattr(model_config, "hf_config", None)
    mm = getattr(model_config, "multimodal_config", None)
    options = {
        "config": _plain(text or {}),
        "dtype": str(getattr(model_config, "dtype", "")).removeprefix("torch."),
        "quantization": getattr(model_config, "quantization", None),
        "model_impl": str(getattr(model_config, "model_impl", "auto")),
        "load_format": str(getattr(load_config, "load_format", "auto")),
        "model_loader_extra_config": _plain(getattr(load_config, "model_loader_extra_config", None) or {}),
        "calculate_kv_scales": bool(getattr(cache_config, "calculate_kv_scales", False)),
    }
    # Keys past the original seven only when set, so that what they cannot change keeps its identity.
    extra = {
        "hf_config": _plain(full) if full is not None and full is not text else None,
        "quantization_config": _plain(getattr(model_config, "quantization_config", None)),
        "hf_overrides": _plain(getattr(model_config, "hf_overrides", None)) or None,
        "mm_processor_kwargs": _plain(getattr(mm, "mm_processor_kwargs", None)) or None,
        "files": {name: _file_digest(f) for name, f in (files or {}).items()} or None,
    }
    options.update({k: v for k, v in extra.items() if v is not None})
    return options


def _hub_commit_now(model: str, revision: str | None, download_dir: str | None) -> tuple[str | None, str | None]:
    """(the ref file, the commit it names now) for a hub model in the local cache; a commit revision is itself."""
    if revision is not None and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return None, revision
    ref = hub_repo_dir(model, download_dir) / "refs" / (revision or "main")
    try:
        return str(ref), ref.read_text().strip() or None
    except OSError:
        return str(ref), None


def weights_location(model: str, revision: str | None, download_dir: str | None,
                     snapshot: LoadSnapshot | None = None) -> Path | None:
    """Where vLLM read ``model``'s weights: the local path, or the hub snapshot in the local cache (None if absent).

    A hub revision is resolved once: to the commit ``snapshot`` (taken before
    the load) recorded, else to what the ref names now (the after-start check
    then proves it was not written since). Never the network: by the time
    the connector asks, vLLM has downloaded what it loaded.
    """
    if os.path.exists(model):
        return Path(model)
    if snapshot is not None:
        commit = snapshot.hub_commit
    else:
        _, commit = _hub_commit_now(model, revision, download_dir)
    if commit is None:
        log.debug("no local snapshot of %s@%s", model, revision)
        return None
    where = hub_repo_dir(model, download_dir) / "snapshots" / commit
    return where if where.is_dir() else None


def model_identity(model_config: Any, load_config: Any, cache_config: Any, override: str | None = None, *,
                   digest_cache: Any = True, mark: StartMark | None = None) -> ModelIdentity:
    """This instance's model identity (:mod:`remote_g2.identity.model_identity`): the loaded weights' digest and
    :func:`load_options`; with ``override`` (the ``model_id`` setting) the operator's name in place of the
    digest. No identity — so no sharing — for generated weights (``load_format="dummy"``, whatever the
    override), a load format whose files remote-g2 cannot find, a checkpoint it cannot locate or read, or one
    that changed after ``mark`` (:func:`remote_g2.identity.load_snapshot.changed_after`: then the bytes digested need
    not be the bytes loaded). ``mark`` defaults to the snapshot vLLM's plugin took before the load (inherited
    from this process or an ancestor: :class:`~remote_g2.identity.load_snapshot.LoadSnapshot`), else this process's
    start.
    """
    fmt = str(getattr(load_config, "load_format", "auto"))
    if fmt in _GENERATED_FORMATS:  # not even under an operator's name: each TP size generates other weights
        return ModelIdentity(None, f"the weights are generated, not loaded (load_format={fmt!r}): they have no "
                                   "identity another instance could match", kind="generated")
    model = str(getattr(model_config, "model", ""))
    revision = getattr(model_config, "revision", None)
    download_dir = getattr(load_config, "download_dir", None)
    snapshot = LoadSnapshot.inherited(model, revision)
    if mark is None:
        mark = start_mark(snapshot)
    if snapshot is None and not os.path.exists(model):  # the ref as it is now, proven unwritten since the mark
        ref, commit = _hub_commit_now(model, revision, download_dir)
        if ref is not None:
            snapshot = LoadSnapshot(mark.ns, os.getpid(), 0, model, revision, download_dir, None, (), ref, commit)
    where = weights_location(model, revision, download_dir, snapshot)
    try:
        extra = config_files(where if where is not None and where.is_dir() else None, model_config)
        options = load_options(model_config, load_config, cache_config, extra)
    except OSError as e:
        return ModelIdentity(None, f"cannot read the model's config files: {e}", kind="unreadable")
    if override:
        return ModelIdentity(override_model_id(override, options), where=f"model_id setting {override!r}",
                             kind="override")
    if fmt not in _FILE_FORMATS:
        return ModelIdentity(None, f"load_format={fmt!r} reads weights remote-g2 cannot digest; set the model_id "
                                   "setting to name them (and change it whenever they change)", kind="load_format")
    if where is None and snapshot is not None and snapshot.hub_ref is not None and snapshot.hub_commit is None \
            and os.path.exists(snapshot.hub_ref):
        return ModelIdentity(None, f"{model!r} was not in the local hub cache when {mark.what} (this start "
                                   "downloaded it, or another process did meanwhile): which revision was loaded is "
                                   "not known; the next start has an identity", kind="changed")
    if where is None:
        return ModelIdentity(None, f"the weights of {model!r} are not on this host's disk to digest", kind="absent")
    trust_code = bool(getattr(model_config, "trust_remote_code", False))
    root = where if where.is_dir() else where.parent
    try:
        # GGUF is one file; a directory's checkpoint files as the format reads them. Remote code is the model's
        # computation too.
        files = checkpoint_files(where, order=_FILE_FORMATS[fmt], also=("*.py",) if trust_code else ())
        # Before the read (a change already seen costs no read) and after it (the proof).
        why = changed_after(mark, [*files, *extra.values()], where, snapshot)
        if why is None:
            digest = weights_digest(files, root, cache=digest_cache, fresh_since_ns=mark.ns)
            why = changed_after(mark, [*files, *extra.values()], where, snapshot)
    except (OSError, ConfigError) as e:
        return ModelIdentity(None, f"cannot digest the weights at {where}: {e}", kind="unreadable")
    if why is not None:
        return ModelIdentity(None, f"the weights may not be the ones loaded: {why}", kind="changed")
    caveat = next((r for r in (untrusted_reason(str(f)) for f in files) if r), "")
    if caveat:
        caveat += ("; such a file replaced after the start by one of the same size and mtime would go unseen, and "
                   "its digest is read again at every start")
    return ModelIdentity(model_id_for(model, digest.digest, options), weights=digest, where=str(where), caveat=caveat)


def prompt_block_hashes(block_hashes: Sequence[bytes], num_tokens: int, prompt_len: int,
                        block_size: int) -> list[bytes] | None:
    """vLLM's hash of every full prompt block of ``block_size`` tokens, or None when they cannot be told.

    ``block_hashes`` is ``request.block_hashes`` for a request of ``num_tokens``
    tokens. vLLM may hash at a finer granularity than its block size (a
    divisor of it, for hybrid models); the hash of a block is then the last
    fine-grained hash inside it, which chains over the whole prefix.
    """
    if num_tokens < block_size:
        return []
    for step in (d for d in range(1, block_size + 1) if block_size % d == 0):
        hash_size = block_size // step
        if len(block_hashes) == num_tokens // hash_size:
            full = prompt_len // block_size
            return [bytes(block_hashes[(i + 1) * step - 1]) for i in range(full)]
    return None


def fingerprint(*, model_id: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                scheme: str, tp_size: int = 1, is_mla: bool = False) -> LayoutFingerprint:
    """This instance's layout fingerprint: ``num_kv_heads`` counts the whole model's KV heads (every rank's).

    For MLA, ``num_kv_heads`` is 1 and ``head_dim`` the latent width: every rank holds the same latent cache.
    """
    return LayoutFingerprint(model_id=model_id, dtype=dtype[:64], tokens_per_block=block_size, kv_layout="HND",
                             num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, tp_size=tp_size,
                             is_mla=is_mla, hash_scheme=scheme)
