"""remote-g2's vLLM plugin: refuse a configuration the connector cannot serve before vLLM loads the model.

vLLM 0.32 builds its KV connectors only after its workers loaded the model,
so a setting the connector refuses (a TP size that would replicate KV heads, a hash
space no other process shares) would cost a model load and end with the
traceback printed by the engine core and again by the frontend. vLLM loads
``vllm.general_plugins`` entry points (this package declares :func:`register`)
in every process as soon as it builds its engine arguments; :func:`register`
wraps ``EngineArgs.create_engine_config`` so that a config naming
``RemoteG2Connector`` goes through
:func:`~remote_g2.adapters.vllm.connector.check_vllm_config` the moment it
exists: in the frontend (``LLM(...)``, ``vllm serve``), before any engine
process starts, once. The connector checks again when it is built, for
engines created without ``EngineArgs``.

It also records what the model's path names before anything is loaded
(:class:`~remote_g2.identity.load_snapshot.LoadSnapshot`: the moment, each component
and symlink of the path, the hub ref and the commit it names) and hands it
to the engine's processes through their environment (for the connector, and
for vLLM's own offloading with remote-g2's tier): the connector, which
digests the weights only after vLLM loaded them, gives an identity only
when nothing on that path changed since (:mod:`remote_g2.identity.load_snapshot`).
The snapshot is taken before vLLM reads ``config.json``.

Registering twice is harmless (vLLM may load plugins more than once); with
vLLM absent or shaped otherwise, the plugin does nothing.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["register", "uses_remote_g2", "uses_remote_g2_tier"]

log = logging.getLogger("remote_g2.adapters.vllm")

_MARK = "_remote_g2_checks_config"


def uses_remote_g2(kv_transfer_config: Any) -> bool:
    """Whether vLLM's ``kv_transfer_config`` names this package's connector."""
    return (kv_transfer_config is not None and getattr(kv_transfer_config, "kv_connector", None) == "RemoteG2Connector"
            and str(getattr(kv_transfer_config, "kv_connector_module_path", None) or "").startswith("remote_g2"))


def uses_remote_g2_tier(kv_transfer_config: Any) -> bool:
    """Whether vLLM's ``kv_transfer_config`` runs vLLM's offloading with this package's secondary tier
    (``remote_g2.adapters.vllm_tier``)."""
    if kv_transfer_config is None or getattr(kv_transfer_config, "kv_connector", None) != "OffloadingConnector":
        return False
    tiers = (getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}).get("secondary_tiers") or []
    return any(isinstance(t, dict) and str(t.get("module_path") or "").startswith("remote_g2") for t in tiers)


def _snapshot(engine_args: Any) -> Any:
    """The :class:`~remote_g2.identity.load_snapshot.LoadSnapshot` of the model ``engine_args`` names, or None."""
    from remote_g2.identity.load_snapshot import LoadSnapshot

    try:
        return LoadSnapshot.take(str(engine_args.model), getattr(engine_args, "revision", None),
                                 getattr(engine_args, "download_dir", None))
    except (OSError, ValueError, AttributeError) as e:  # the connector falls back to its process's start time
        log.warning("remote-g2: no snapshot of the model's path before the load (%s)", e)
        return None


def register() -> None:
    """vLLM's entry point: check RemoteG2Connector configs where vLLM creates them."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # pragma: no cover - a vLLM without EngineArgs: the connector's own check remains
        return
    create = getattr(EngineArgs, "create_engine_config", None)
    if create is None or getattr(create, _MARK, False):
        return

    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        snapshot = _snapshot(self)  # before vLLM reads the model's config: the mark precedes every read
        config = create(self, *args, **kwargs)
        kv_transfer_config = getattr(config, "kv_transfer_config", None)
        if uses_remote_g2(kv_transfer_config):
            from .connector import check_vllm_config

            check_vllm_config(config)
            if snapshot is not None:
                snapshot.publish()
        elif uses_remote_g2_tier(kv_transfer_config) and snapshot is not None:
            snapshot.publish()  # the tier's identity checks against it too (adapters/vllm_tier/identity.py)
        return config

    setattr(create_engine_config, _MARK, True)
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
