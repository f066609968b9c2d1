"""Settings shared by the parts, read from the environment with clear errors.

Every variable is ``REMOTE_G2_*``. Parts take explicit arguments first and fall
back to these, so a deployment can configure a worker without code changes.
Every part reads its variables with the same helpers (:func:`env_str`,
:func:`env_int`, :func:`env_flag`, :func:`env_float`, :func:`env_fingerprint`), from ``os.environ`` or
the ``env`` mapping its ``from_env(env=...)`` was given; a set but malformed
variable is a :class:`~remote_g2.errors.ConfigError` naming it. A part with
many variables lists them as an :data:`EnvTable` (variable, field, reader)
and reads the set ones with :func:`env_fields`. The shared ones:

=============================  ===================================================
``REMOTE_G2_REGISTRY``         registry endpoint, e.g. ``tcp://10.0.0.5:7450``
``REMOTE_G2_RPC_TIMEOUT_MS``   default RPC timeout (ms)
``REMOTE_G2_CURVE_SERVER_KEY`` server public key (file or Z85) for CURVE clients
``REMOTE_G2_LOG_LEVEL``        see :mod:`remote_g2.log`
=============================  ===================================================
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

from remote_g2.errors import ConfigError
from remote_g2.protocol.messages import LayoutFingerprint

__all__ = ["ClientSettings", "env_str", "env_int", "env_flag", "env_float", "env_fingerprint", "env_flag_or_none",
           "env_positive", "env_word", "EnvTable", "env_fields", "DEFAULT_REGISTRY_ENDPOINT"]

DEFAULT_REGISTRY_ENDPOINT = "tcp://127.0.0.1:7450"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return env if env is not None else os.environ


def env_str(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A string variable as it is set, or None when unset or empty."""
    return _environ(env).get(name) or None


def env_int(name: str, env: Mapping[str, str] | None = None) -> int | None:
    """An integer variable, or None when unset or blank; anything else is a :class:`ConfigError`."""
    raw = _environ(env).get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def env_flag(name: str, env: Mapping[str, str] | None = None, default: bool | None = False) -> bool | None:
    """A boolean variable, or ``default`` when unset or blank.

    Anything but the usual spellings is a :class:`ConfigError`. ``default=None``
    tells an unset variable from one set to a false value.
    """
    raw = _environ(env).get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_float(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """A positive number variable, or ``default`` when unset."""
    raw = _environ(env).get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    return value


def env_fingerprint(name: str, env: Mapping[str, str] | None = None) -> LayoutFingerprint | None:
    """A :class:`~remote_g2.protocol.messages.LayoutFingerprint` given as a JSON object, or None when unset or blank."""
    raw = _environ(env).get(name, "").strip()
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not JSON: {e}") from None
    known = {f.name for f in fields(LayoutFingerprint)}
    if not isinstance(data, dict) or set(data) - known:
        raise ConfigError(f"{name} must be an object with fields {sorted(known)}")
    try:
        return LayoutFingerprint(**data)
    except TypeError as e:
        raise ConfigError(f"{name}: {e}") from None


def env_flag_or_none(name: str, env: Mapping[str, str] | None = None) -> bool | None:
    """A boolean variable, or None when unset or blank (:func:`env_flag` with ``default=None``)."""
    return env_flag(name, env, default=None)


def env_positive(name: str, env: Mapping[str, str] | None = None) -> float | None:
    """A positive number variable (see :func:`env_float`), or None when unset or empty."""
    if env_str(name, env) is None:
        return None
    return env_float(name, 1.0, env)  # a value of blanks reads as 1.0, as SourceConfig always read it


def env_word(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A word variable (a mode's name), trimmed and lower-cased, or None when unset or blank.

    Whether the word is one the field takes is the settings' own check.
    """
    raw = _environ(env).get(name, "").strip()
    return raw.lower() if raw else None


EnvReader = Callable[[str, Mapping[str, str] | None], object]
#: Rows ``(variable, field, reader)``: ``reader(variable, env)`` is the field's value, or None when unset.
EnvTable = Sequence[tuple[str, str, EnvReader]]


def env_fields(table: EnvTable, env: Mapping[str, str] | None = None) -> dict[str, object]:
    """``{field: value}`` for each row of ``table`` whose variable is set, read in the table's order.

    A field whose variable is unset is left out (the settings' own default
    holds); the first malformed variable, in table order, is the
    :class:`ConfigError`.
    """
    values: dict[str, object] = {}
    for var, field, read in table:
        if (value := read(var, env)) is not None:
            values[field] = value
    return values


@dataclass(frozen=True)
class ClientSettings:
    """How a client reaches the registry: endpoint, timeout, optional CURVE server key."""

    registry_endpoint: str = DEFAULT_REGISTRY_ENDPOINT
    rpc_timeout_ms: float = 5000.0
    curve_server_key: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSettings:
        return cls(
            registry_endpoint=env_str("REMOTE_G2_REGISTRY", env) or DEFAULT_REGISTRY_ENDPOINT,
            rpc_timeout_ms=env_float("REMOTE_G2_RPC_TIMEOUT_MS", 5000.0, env),
            curve_server_key=env_str("REMOTE_G2_CURVE_SERVER_KEY", env),
        )
