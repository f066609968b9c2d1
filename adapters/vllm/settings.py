"""The vLLM connector's settings: ``kv_connector_extra_config``, checked (imports without vLLM).

The target client's settings the extra config leaves unset keep the target's
own (``REMOTE_G2_TARGET_*``, then its defaults): an operator's environment is
never silently overridden by a connector default.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from remote_g2.errors import ConfigError
from remote_g2.target import TargetConfig

__all__ = ["ConnectorSettings"]


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``, checked. ``registry`` may also come from ``REMOTE_G2_REGISTRY``."""

    registry: str | None
    worker_id: str
    g2_blocks: int = 1024
    landing_blocks: int = 256
    source: bool = True
    target: bool = True
    transfer: str | None = None  # None: the target's own setting (REMOTE_G2_TARGET_TRANSFER, else nixl)
    transfer_timeout_ms: int | None = None  # None: REMOTE_G2_TARGET_TIMEOUT_MS, else the target's default
    ipc_dir: str | None = None
    model_id: str | None = None
    failed_source_cooldown_s: float = 30.0
    save_threshold: int = 1  # save a prompt block once this many of this instance's requests held it
    load: str = "async"
    registry_mirror: bool = True
    tp_exchange: str = "links"  # how TP ranks agree each step: "links" (local sockets) or "gloo" (vLLM's group)
    g2_prefault: bool = True  # fault the G2 pool in at start-up, in the background (HostPool.prefault)

    @classmethod
    def from_extra(cls, extra: dict[str, Any], *, default_worker_id: str | None = None) -> ConnectorSettings:
        """``default_worker_id``: the name when ``worker_id`` is not set (the same in every process of the
        instance: its scheduler and every TP rank must agree on it)."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(extra) - known
        if unknown:
            raise ConfigError(f"unknown remote-g2 settings in kv_connector_extra_config: {sorted(unknown)} "
                              f"(known: {sorted(known)})")
        values = dict(extra)
        values.setdefault("registry", os.environ.get("REMOTE_G2_REGISTRY"))
        values.setdefault("worker_id", default_worker_id or f"vllm-{socket.gethostname()}-{os.getpid()}")
        s = cls(**values)
        if s.g2_blocks < 1 or s.landing_blocks < 1:
            raise ConfigError("g2_blocks and landing_blocks must be >= 1")
        if s.load not in ("async", "sync"):
            raise ConfigError(f"load must be 'async' or 'sync', not {s.load!r}")
        if s.tp_exchange not in ("links", "gloo"):
            raise ConfigError(f"tp_exchange must be 'links' or 'gloo', not {s.tp_exchange!r}")
        if not isinstance(s.g2_prefault, bool):
            raise ConfigError(f"g2_prefault must be true or false, not {s.g2_prefault!r}")
        if s.save_threshold < 1:
            raise ConfigError(f"save_threshold must be >= 1 (1: save every full prompt block), not {s.save_threshold}")
        if not s.failed_source_cooldown_s >= 0:
            raise ConfigError(f"failed_source_cooldown_s must be >= 0, not {s.failed_source_cooldown_s}")
        return s

    def target_config(self, *, env: Mapping[str, str] | None = None, **fields: Any) -> TargetConfig:
        """The target client's config: ``REMOTE_G2_TARGET_*`` (of ``env``, else the process's), then what this
        config sets of it (``transfer``, ``transfer_timeout_ms``; unset keeps the target's own), then ``fields``."""
        mine = {k: v for k in ("transfer", "transfer_timeout_ms") if (v := getattr(self, k)) is not None}
        return replace(TargetConfig.from_env(env=env), enabled=True, **fields, **mine)
