"""Starting remote-g2 from TensorRT-LLM's executor: one call per TP rank, after the KV cache manager exists.

::

    from remote_g2.adapters.trtllm import start_remote_g2
    hooks = start_remote_g2(kv_cache_manager, worker_id="node7-engine0", executor=self,  # in PyExecutor.__init__
                            checkpoint="/models/llama-3.1-8b-instruct")  # the engine or checkpoint it loaded
    ...
    hooks.pool.notify("stored", u64_hashes)   # from the executor's KV-cache events for the secondary pool
    hooks.shutdown()                          # in PyExecutor.shutdown

The layout fingerprint both hooks use is resolved here, from the pool
(:func:`resolve_fingerprint`): a configured one is checked against it, never
trusted in its place. Its model part is the digest of the files the engine
loaded (``checkpoint=``, or ``$REMOTE_G2_MODEL_CHECKPOINT``: a TensorRT
engine directory, a TensorRT-LLM checkpoint or a Hugging Face directory;
:mod:`remote_g2.identity.model_identity`), or an operator's ``model_id`` that must
change whenever the weights do.

Not run against TensorRT-LLM (no GPU here); see :mod:`.pool`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from remote_g2.config import env_flag
from remote_g2.errors import ConfigError
from remote_g2.protocol.messages import BlockLayout, LayoutFingerprint
from remote_g2.identity.model_identity import checkpoint_files, model_id_for, override_model_id, weights_digest

from .pool import TrtllmSecondaryPool, tp_from_executor

__all__ = ["CHECKPOINT_ENV", "RemoteG2Hooks", "checkpoint_model_id", "resolve_fingerprint", "start_remote_g2"]

log = logging.getLogger("remote_g2.trtllm")
# The weights, else (an engine directory) the engines alone; with either, the build options (dtype, quantisation,
# RoPE) and every engine built from them.
_ORDER = ("safetensors", "bin", "pt", "engine")
_ALSO = ("config.json", "*.engine")

CHECKPOINT_ENV = "REMOTE_G2_MODEL_CHECKPOINT"
_SOURCE_FP_ENV = "REMOTE_G2_SOURCE_FINGERPRINT"
_TARGET_FP_ENV = "REMOTE_G2_TARGET_FINGERPRINT"


@dataclass
class RemoteG2Hooks:
    """What :func:`start_remote_g2` started on this rank (each hook None when disabled)."""

    pool: TrtllmSecondaryPool
    source: Any
    target: Any
    tp_rank: int
    tp_size: int

    def shutdown(self) -> None:
        for hook in (self.target, self.source):
            if hook is not None:
                hook.shutdown()
        self.target = self.source = None


def start_remote_g2(kv_cache_manager: Any, *, worker_id: str, executor: Any = None, comm: Any = None,
                    layout: BlockLayout | None = None, model_id: str | None = None,
                    checkpoint: str | os.PathLike[str] | None = None, source_config: Any = None,
                    target_config: Any = None) -> RemoteG2Hooks:
    """Wrap the manager's secondary pool and start the source service and target client when enabled.

    ``tp_rank``/``tp_size`` come from ``executor.mapping`` (or ``.dist``),
    else MPI world. Each hook follows its config or, when None, the
    ``REMOTE_G2_SOURCE*`` / ``REMOTE_G2_TARGET*`` environment. Collective over
    the TP group (every rank calls it).

    When either hook is enabled, both get the fingerprint
    :func:`resolve_fingerprint` builds from the pool and the model's
    identity: the digest of ``checkpoint`` (else ``$REMOTE_G2_MODEL_CHECKPOINT``),
    the files this engine loaded; or ``model_id``, an operator's name for the
    weights, else the configured fingerprint's. Raises ``ConfigError`` before
    starting anything when there is no model identity, or when a configured
    fingerprint disagrees with the pool.
    """
    from remote_g2.source import SourceConfig, maybe_start_source_service
    from remote_g2.source.config import ENABLE_ENV as SOURCE_ENABLE_ENV
    from remote_g2.target import TargetConfig, maybe_start_target_client
    from remote_g2.target.config import ENABLE_ENV as TARGET_ENABLE_ENV

    pool = TrtllmSecondaryPool(kv_cache_manager, layout=layout)
    tp_rank, tp_size = tp_from_executor(executor)
    if not (_enabled(source_config, SOURCE_ENABLE_ENV) or _enabled(target_config, TARGET_ENABLE_ENV)):
        return RemoteG2Hooks(pool, None, None, tp_rank, tp_size)
    fp = resolve_fingerprint(pool, tp_size=tp_size, model_id=model_id,
                             checkpoint=checkpoint or os.environ.get(CHECKPOINT_ENV, "").strip() or None,
                             configured=_configured_fingerprints(source_config, target_config))
    if source_config is None:
        source_config = SourceConfig.from_env(fingerprint=fp)
    if target_config is None:
        target_config = TargetConfig.from_env()
    source_config = replace(source_config, fingerprint=fp)
    target_config = replace(target_config, fingerprint=fp)
    source = maybe_start_source_service(pool, worker_id=worker_id, tp_rank=tp_rank, tp_size=tp_size,
                                        config=source_config, comm=comm)
    try:
        target = maybe_start_target_client(pool, worker_id=worker_id, tp_rank=tp_rank, tp_size=tp_size,
                                           config=target_config, comm=comm)
    except BaseException:
        if source is not None:
            source.shutdown()
        raise
    return RemoteG2Hooks(pool, source, target, tp_rank, tp_size)


def checkpoint_model_id(checkpoint: str | os.PathLike[str]) -> str:
    """``PATH#w-…``: the identity of the TensorRT-LLM model at ``checkpoint``, from every byte it loads.

    A directory's weight files (safetensors, else ``.bin``, else ``.pt``) with
    its ``config.json`` (a TensorRT-LLM checkpoint's or engine's build options:
    dtype, quantisation, RoPE) and every ``*.engine``; or the one file given.
    A directory of engines alone is its engines and config.
    """
    path = Path(checkpoint)
    files = checkpoint_files(path, order=_ORDER, also=_ALSO)
    digest = weights_digest(files, path if path.is_dir() else path.parent)
    log.info("model identity of %s: %s", path, digest.summary())
    return model_id_for(str(path), digest.digest, {"engine": "tensorrt_llm"})


def resolve_fingerprint(pool: TrtllmSecondaryPool, *, tp_size: int, model_id: str | None = None,
                        checkpoint: str | os.PathLike[str] | None = None,
                        configured: Sequence[tuple[str, LayoutFingerprint]] = ()) -> LayoutFingerprint:
    """This worker's fingerprint: what the bytes are from the pool, the model's identity from what it loaded.

    The model part is ``model_id`` (an operator's name for the weights:
    ``NAME#o-…``), else the digest of ``checkpoint`` (:func:`checkpoint_model_id`),
    else the first configured fingerprint's ``model_id`` (a name, taken as
    ``model_id`` would be; a full ``LABEL#IDENTITY`` as it is).
    ``configured`` lists the fingerprints the configuration names, each with
    where it was named (for errors). Every configured one must name the same
    model (by that name or identity), and the same dtype, layout and hash
    space as the pool (``tp_size`` excepted: the TP group's is announced). A
    configured fingerprint without ``hash_scheme`` takes the pool's. Anything
    else is a ``ConfigError`` naming both sides: a worker announcing bytes it
    does not hold would hand targets KV that is not theirs.
    """
    if model_id:
        model_where, name = "model_id=", model_id
    elif checkpoint:
        model_where, name = "checkpoint=", None
    elif configured:
        model_where, name = configured[0][0], configured[0][1].model_id
    else:
        raise ConfigError("no model identity for the layout fingerprint: pass start_remote_g2(..., checkpoint=...) "
                          f"(or {CHECKPOINT_ENV}), model_id=..., or a fingerprint in the source/target config or "
                          f"{_SOURCE_FP_ENV} / {_TARGET_FP_ENV}")
    if name is None:
        resolved = checkpoint_model_id(checkpoint)  # type: ignore[arg-type]
    else:
        resolved = name if "#" in name else override_model_id(name, {"engine": "tensorrt_llm"})
    own = pool.fingerprint(model_id=resolved, tp_size=tp_size)
    for where, fp in configured:
        if fp.model_id not in (name, resolved) and fp.model_identity != own.model_identity:
            raise ConfigError(f"{where} names model {fp.model_id!r}, {model_where} names {name or resolved!r}")
        differ = [f.name for f in fields(LayoutFingerprint)
                  if f.name not in ("model_id", "tp_size") and _named(fp, f.name) != _named(own, f.name)
                  and not (f.name == "hash_scheme" and not fp.hash_scheme)]
        if differ:
            raise ConfigError(f"{where} disagrees with the TensorRT-LLM pool tensors: it names "
                              + ", ".join(f"{n}={getattr(fp, n)!r}" for n in differ) + "; the pool holds "
                              + ", ".join(f"{n}={getattr(own, n)!r}" for n in differ)
                              + ". Fix or drop the configured fingerprint; not sharing blocks described wrongly")
    return own


def _named(fp: LayoutFingerprint, name: str) -> object:
    value = getattr(fp, name)
    return value.removeprefix("torch.") if name == "dtype" else value


def _enabled(config: Any, env_var: str) -> bool:
    """Whether the hook will start: as ``maybe_start_*`` decide (the config's flag, else the environment's)."""
    if config is not None and config.enabled:
        return True
    return bool(os.environ.get(env_var, "").strip()) and env_flag(env_var)


def _configured_fingerprints(source_config: Any, target_config: Any) -> list[tuple[str, LayoutFingerprint]]:
    """The fingerprints the configuration names: a config's own, else its environment variable's."""
    from remote_g2.source import SourceConfig
    from remote_g2.target import TargetConfig

    found: list[tuple[str, LayoutFingerprint | None]] = []
    # Parse only the fingerprint variable from the environment: the whole config cannot be built yet,
    # since a registry endpoint needs the fingerprint being resolved here.
    for config, var, cls, name in ((source_config, _SOURCE_FP_ENV, SourceConfig, "source_config.fingerprint"),
                                   (target_config, _TARGET_FP_ENV, TargetConfig, "target_config.fingerprint")):
        if config is not None:
            found.append((name, config.fingerprint))
        elif os.environ.get(var, "").strip():
            found.append((var, cls.from_env({var: os.environ[var]}).fingerprint))
    return [(where, fp) for where, fp in found if fp is not None]
