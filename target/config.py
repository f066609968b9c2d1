"""Settings of the target client, from code or from ``REMOTE_G2_TARGET*`` variables.

======================================  ==========================================  ===================
variable                                field                                       default
======================================  ==========================================  ===================
``REMOTE_G2_TARGET``                    ``enabled``                                 off
``REMOTE_G2_REGISTRY``                  ``registry_endpoint``                       unset (no lookups)
``REMOTE_G2_TARGET_REGISTRY_MIRROR``    ``registry_mirror`` (lookups from memory)   off
``REMOTE_G2_TARGET_TRANSFER``           ``transfer`` (adapter name)                 ``nixl``
``REMOTE_G2_TARGET_IPC_DIR``            ``ipc_dir`` (private, mode 0700)            the source's default
``REMOTE_G2_TARGET_LEASE_TTL_MS``       ``lease_ttl_ms``                            10000
``REMOTE_G2_TARGET_RPC_TIMEOUT_MS``     ``rpc_timeout_ms`` (lookup, resolve, ...)   2000
``REMOTE_G2_TARGET_TIMEOUT_MS``         ``transfer_timeout_ms`` (whole load)        10000
``REMOTE_G2_TARGET_FINGERPRINT``        ``fingerprint`` (JSON of LayoutFingerprint) unset
``REMOTE_G2_TARGET_METRICS_PORT``       ``metrics_port`` (leader's /metrics)        off
``REMOTE_G2_TARGET_PEER_RESOLVE``       ``peer_resolve`` (each rank its own share)  on
``REMOTE_G2_TARGET_GATHER``             ``gather`` (sources stage small pieces)     on
``REMOTE_G2_TARGET_BOUNCE_MIB``         ``bounce_mib`` (per rank; 0: off)           64
``REMOTE_G2_CURVE_SERVER_KEY``          ``registry_curve`` (registry's public key)  unset (plain TCP)
``REMOTE_G2_SOURCE_CURVE_SERVER_KEY``   ``source_curve`` (sources' public key)      unset (plain TCP)
``REMOTE_G2_CURVE_CLIENT_KEY``          this client's key pair (for allow-lists)    generated per process
======================================  ==========================================  ===================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from remote_g2.config import EnvTable, env_fields, env_fingerprint, env_flag, env_flag_or_none, env_int, env_str
from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.errors import ConfigError
from remote_g2.rpc.ipc_paths import default_ipc_dir
from remote_g2.protocol.messages import LayoutFingerprint

__all__ = ["TargetConfig", "ENABLE_ENV"]

ENABLE_ENV = "REMOTE_G2_TARGET"

# What :meth:`TargetConfig.from_env` reads, in this order (the first malformed variable is the error);
# the CURVE keys, which take two variables each, are read apart.
_ENV_FIELDS: EnvTable = (
    (ENABLE_ENV, "enabled", env_flag_or_none),
    ("REMOTE_G2_TARGET_REGISTRY_MIRROR", "registry_mirror", env_flag_or_none),
    ("REMOTE_G2_TARGET_PEER_RESOLVE", "peer_resolve", env_flag_or_none),
    ("REMOTE_G2_TARGET_GATHER", "gather", env_flag_or_none),
    ("REMOTE_G2_REGISTRY", "registry_endpoint", env_str),
    ("REMOTE_G2_TARGET_TRANSFER", "transfer", env_str),
    ("REMOTE_G2_TARGET_IPC_DIR", "ipc_dir", env_str),
    ("REMOTE_G2_TARGET_LEASE_TTL_MS", "lease_ttl_ms", env_int),
    ("REMOTE_G2_TARGET_RPC_TIMEOUT_MS", "rpc_timeout_ms", env_int),
    ("REMOTE_G2_TARGET_TIMEOUT_MS", "transfer_timeout_ms", env_int),
    ("REMOTE_G2_TARGET_BOUNCE_MIB", "bounce_mib", env_int),
    ("REMOTE_G2_TARGET_METRICS_PORT", "metrics_port", env_int),
    ("REMOTE_G2_TARGET_FINGERPRINT", "fingerprint", env_fingerprint),
)


@dataclass(frozen=True)
class TargetConfig:
    """How one worker's target client runs; every rank of the worker gets the same one.

    * ``registry_endpoint`` — where :meth:`~remote_g2.target.TargetClient.lookup` asks: one server, or a
      failover list separated by commas (servers of one store; the next is asked when one does not answer).
    * ``registry_mirror`` — keep an in-process copy of the registry
      (:class:`~remote_g2.registry.RegistryMirror`, following the server's
      change feed) and answer lookups from it: no network round trip per
      lookup, at the cost of the index in the leader's memory. Until the copy
      is complete (and while it retakes one) lookups go to the server.
    * ``fingerprint`` — this worker's layout; lookups only return compatible
      sources, and a TP ratio the layout cannot serve is refused at lookup time.
    * ``lease_ttl_ms`` — asked of the source at resolve; renewed when a load
      outlives half of it.
    * ``transfer_timeout_ms`` — a load not finished on every rank by then fails
      (its blocks are invalid; the engine recomputes them).
    * ``peer_resolve`` — from a source whose ranks serve ``peer_resolve``
      and whose metadata every rank already holds, each rank resolves its
      own share with the source ranks it reads, in parallel, under the lease
      id the leader picks plus its rank (docs/target.md, "Peer resolve");
      False: the leader always resolves every share.
    * ``gather`` — every resolve says what this worker's ranks read
      (:class:`~remote_g2.protocol.messages.GatherWish`), so that a source rank packs
      a rank's many small pieces (another TP size's head slices, small
      scattered blocks) into one staged run first (docs/source.md,
      "Gathered reads"); False: always read every piece in place.
    * ``bounce_mib`` — each rank's bounce region (host memory registered
      beside its pool, a pool in host memory only): a READ whose destination
      pieces are small and scattered while its source rows are adjacent lands
      there in one run and is scattered locally (``target/bounce.py``);
      0: every piece lands where it belongs.
    * ``metrics_port`` — the leader serves Prometheus ``/metrics`` there
      (``remote_g2_target_*``: lookups by answer, loads by outcome, blocks
      loaded and invalid, load latency); 0 picks a free port.
    * ``registry_curve`` / ``source_curve`` — CURVE keys for talking to a
      registry / sources whose TCP endpoints require them (docs/security.md).
    """

    enabled: bool = False
    registry_endpoint: str | None = None
    registry_mirror: bool = False
    transfer: str = "nixl"
    ipc_dir: str | None = None
    lease_ttl_ms: int = 10_000
    rpc_timeout_ms: int = 2_000
    transfer_timeout_ms: int = 10_000
    fingerprint: LayoutFingerprint | None = None
    registry_curve: CurveClientConfig | None = None
    source_curve: CurveClientConfig | None = None
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    peer_resolve: bool = True
    gather: bool = True
    bounce_mib: int = 64

    def __post_init__(self) -> None:
        for name in ("lease_ttl_ms", "rpc_timeout_ms", "transfer_timeout_ms"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TargetConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.bounce_mib <= 1 << 20:
            raise ConfigError(f"TargetConfig.bounce_mib must be 0..{1 << 20} (MiB), got {self.bounce_mib}")

    @property
    def ipc_directory(self) -> str:
        return self.ipc_dir or default_ipc_dir()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TargetConfig:
        """Read ``REMOTE_G2_TARGET*`` (see the module docstring); a malformed variable is a :class:`ConfigError`."""
        e = os.environ if env is None else env
        values = env_fields(_ENV_FIELDS, e)
        values["registry_curve"] = CurveClientConfig.from_env("REMOTE_G2_CURVE_SERVER_KEY", dict(e))
        values["source_curve"] = CurveClientConfig.from_env("REMOTE_G2_SOURCE_CURVE_SERVER_KEY", dict(e))
        return cls(**values)  # type: ignore[arg-type]

    def with_env_enable(self) -> TargetConfig:
        """This config, enabled when ``REMOTE_G2_TARGET=1`` is set."""
        if not self.enabled and env_flag(ENABLE_ENV):
            return replace(self, enabled=True)
        return self
