"""Settings shared by the parts, read from the environment with clear errors.

Every variable is ``REMOTE_G2_*``. Parts take explicit arguments first and fall
back to these, so a deployment can configure a worker without code changes:

=============================  ===================================================
``REMOTE_G2_REGISTRY``         registry endpoint, e.g. ``tcp://10.0.0.5:7450``
``REMOTE_G2_RPC_TIMEOUT_MS``   default RPC timeout (ms)
``REMOTE_G2_CURVE_SERVER_KEY`` server public key (file or Z85) for CURVE clients
``REMOTE_G2_LOG_LEVEL``        see :mod:`remote_g2.log`
=============================  ===================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from remote_g2.errors import ConfigError

__all__ = ["ClientSettings", "env_flag", "env_float", "DEFAULT_REGISTRY_ENDPOINT"]

DEFAULT_REGISTRY_ENDPOINT = "tcp://127.0.0.1:7450"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """A boolean variable; anything but the usual spellings is a :class:`ConfigError`."""
    raw = (env if env is not None else os.environ).get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_float(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """A positive number variable, or ``default`` when unset."""
    raw = (env if env is not None else os.environ).get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class ClientSettings:
    """How a client reaches the registry: endpoint, timeout, optional CURVE server key."""

    registry_endpoint: str = DEFAULT_REGISTRY_ENDPOINT
    rpc_timeout_ms: float = 5000.0
    curve_server_key: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSettings:
        e = env if env is not None else os.environ
        return cls(
            registry_endpoint=e.get("REMOTE_G2_REGISTRY") or DEFAULT_REGISTRY_ENDPOINT,
            rpc_timeout_ms=env_float("REMOTE_G2_RPC_TIMEOUT_MS", 5000.0, e),
            curve_server_key=e.get("REMOTE_G2_CURVE_SERVER_KEY") or None,
        )
