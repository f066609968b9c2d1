"""Settings of the source service, from code or from ``REMOTE_G2_SOURCE*`` variables.

An engine builds a :class:`SourceConfig` itself, or calls
:meth:`SourceConfig.from_env` and lets a deployment configure the worker
without code changes:

======================================  ===========================================  ==========================
variable                                field                                        default
======================================  ===========================================  ==========================
``REMOTE_G2_SOURCE``                    ``enabled``                                  off
``REMOTE_G2_REGISTRY``                  ``registry_endpoint`` (unset: no publishing)  unset
``REMOTE_G2_SOURCE_BIND``               ``bind`` (rank 0's TCP endpoint)             see ``bind`` below
``REMOTE_G2_SOURCE_ADVERTISE``          ``advertise`` (the endpoint others dial)     the bound one
``REMOTE_G2_SOURCE_IPC_DIR``            ``ipc_dir`` (private, mode 0700)             see :func:`~remote_g2.rpc.ipc_paths.default_ipc_dir`
``REMOTE_G2_SOURCE_DEFAULT_TTL_MS``     ``default_lease_ttl_ms``                     10000
``REMOTE_G2_SOURCE_MAX_TTL_MS``         ``max_lease_ttl_ms``                         60000
``REMOTE_G2_SOURCE_MIN_TTL_MS``         ``min_lease_ttl_ms``                         100
``REMOTE_G2_SOURCE_PIN_BUDGET``         ``pin_budget_blocks`` (0: half the pool)     0
``REMOTE_G2_SOURCE_SIBLING_TIMEOUT_MS`` ``sibling_timeout_ms``                       1000
``REMOTE_G2_SOURCE_RPC_WORKERS``        ``rpc_workers``                              4
``REMOTE_G2_SOURCE_PEER_RESOLVE``       ``peer_resolve`` (ranks > 0 answer their own)  on
``REMOTE_G2_SOURCE_PEER_TRANSPORT``     ``peer_transport`` (``stream`` or ``zmq``)   ``stream``
``REMOTE_G2_SOURCE_METRICS_PORT``       ``metrics_port`` (rank r serves port + r)    off
``REMOTE_G2_SOURCE_PROGRESS``           ``progress`` (``poll`` or ``event``)         ``poll``
``REMOTE_G2_SOURCE_EVENT_TIMEOUT_MS``   ``event_timeout_ms`` (event mode)            5
``REMOTE_G2_SOURCE_PROGRESS_MS``        ``progress_interval_ms`` (emulated READs)    0.2
``REMOTE_G2_SOURCE_ONE_SIDED_PROGRESS_MS`` ``one_sided_progress_interval_ms``        5
``REMOTE_G2_SOURCE_IDLE_PROGRESS_MS``   ``idle_progress_interval_ms`` (poll mode)    1000
``REMOTE_G2_SOURCE_STAGING_MIB``        ``staging_mib`` (0: never gather)             64
``REMOTE_G2_SOURCE_GATHER_MIN_DESCRIPTORS`` ``gather_min_descriptors``               16
``REMOTE_G2_SOURCE_GATHER_MAX_PIECE_KIB``  ``gather_max_piece_kib``                  8
``REMOTE_G2_SOURCE_GATHER_CHUNK_KIB``   ``gather_chunk_kib`` (staged per step)       2048
``REMOTE_G2_SOURCE_FINGERPRINT``        ``fingerprint`` (JSON of LayoutFingerprint)  unset
``REMOTE_G2_SOURCE_CURVE_SECRET_KEY``   ``curve`` (server key file)                  unset
``REMOTE_G2_SOURCE_CURVE_ALLOWED``      ``curve`` allow-list directory               unset
``REMOTE_G2_CURVE_SERVER_KEY``          ``registry_curve`` (registry's public key)   unset (plain TCP)
======================================  ===========================================  ==========================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from remote_g2.config import (
    EnvTable, env_fields, env_fingerprint, env_flag_or_none, env_int, env_positive, env_str, env_word,
)
from remote_g2.rpc.curve import CurveClientConfig, CurveServerConfig
from remote_g2.errors import ConfigError
from remote_g2.protocol.messages import LayoutFingerprint
from .progress_pace import MODES, ProgressPace, cma_usable

__all__ = ["SourceConfig", "ENABLE_ENV"]

ENABLE_ENV = "REMOTE_G2_SOURCE"

# What :meth:`SourceConfig.from_env` reads, in this order (the first malformed variable is the error);
# the CURVE keys, which take two variables each, are read apart.
_ENV_FIELDS: EnvTable = (
    ("REMOTE_G2_REGISTRY", "registry_endpoint", env_str),
    ("REMOTE_G2_SOURCE_BIND", "bind", env_str),
    ("REMOTE_G2_SOURCE_ADVERTISE", "advertise", env_str),
    ("REMOTE_G2_SOURCE_IPC_DIR", "ipc_dir", env_str),
    ("REMOTE_G2_SOURCE_DEFAULT_TTL_MS", "default_lease_ttl_ms", env_int),
    ("REMOTE_G2_SOURCE_MAX_TTL_MS", "max_lease_ttl_ms", env_int),
    ("REMOTE_G2_SOURCE_MIN_TTL_MS", "min_lease_ttl_ms", env_int),
    ("REMOTE_G2_SOURCE_SIBLING_TIMEOUT_MS", "sibling_timeout_ms", env_int),
    ("REMOTE_G2_SOURCE_RPC_WORKERS", "rpc_workers", env_int),
    ("REMOTE_G2_SOURCE_METRICS_PORT", "metrics_port", env_int),
    ("REMOTE_G2_SOURCE_PIN_BUDGET", "pin_budget_blocks", env_int),
    ("REMOTE_G2_SOURCE_STAGING_MIB", "staging_mib", env_int),
    ("REMOTE_G2_SOURCE_GATHER_MIN_DESCRIPTORS", "gather_min_descriptors", env_int),
    ("REMOTE_G2_SOURCE_GATHER_MAX_PIECE_KIB", "gather_max_piece_kib", env_int),
    ("REMOTE_G2_SOURCE_GATHER_CHUNK_KIB", "gather_chunk_kib", env_int),
    ("REMOTE_G2_SOURCE_PROGRESS_MS", "progress_interval_ms", env_positive),
    ("REMOTE_G2_SOURCE_ONE_SIDED_PROGRESS_MS", "one_sided_progress_interval_ms", env_positive),
    ("REMOTE_G2_SOURCE_IDLE_PROGRESS_MS", "idle_progress_interval_ms", env_positive),
    ("REMOTE_G2_SOURCE_EVENT_TIMEOUT_MS", "event_timeout_ms", env_positive),
    (ENABLE_ENV, "enabled", env_flag_or_none),
    ("REMOTE_G2_SOURCE_PEER_RESOLVE", "peer_resolve", env_flag_or_none),
    ("REMOTE_G2_SOURCE_PROGRESS", "progress", env_word),
    ("REMOTE_G2_SOURCE_PEER_TRANSPORT", "peer_transport", env_word),
    ("REMOTE_G2_SOURCE_FINGERPRINT", "fingerprint", env_fingerprint),
)


@dataclass(frozen=True)
class SourceConfig:
    """How one worker's source service runs; every rank of the worker gets the same one.

    * ``enabled`` — :func:`~remote_g2.source.maybe_start_source_service` is a
      no-op unless this (or ``REMOTE_G2_SOURCE=1``) is set.
    * ``registry_endpoint`` — where rank 0 registers the worker and streams
      its pool's stored/removed events (one server, or a failover list
      separated by commas: servers of one store, the next used when one
      does not answer); None serves resolves without
      announcing anything (a target must learn the endpoint another way).
    * ``bind`` — rank 0's TCP endpoint; ``:0`` picks a free port, and the bound
      one is what the registry is told. None (the default): ``127.0.0.1``
      when the registry is on this host's loopback (or there is none), else
      the address this host reaches the registry from — so a fleet works
      without setting it. A loopback bind with a registry elsewhere is
      refused at start-up (targets there could not dial it); a wildcard
      (``0.0.0.0``) advertises the address that reaches the registry
      (:mod:`remote_g2.rpc.net_address` states the rule).
    * ``advertise`` — the endpoint to tell the registry when it differs from
      the bound one (a NAT, a chosen interface); its host is also the host
      of the ranks' peer lanes; port 0 means the bound port. Never a
      wildcard; never a loopback address with a registry elsewhere.
    * ``ipc_dir`` — directory of the sibling sockets; created with mode 0700
      and refused when another user owns it or it is open to others.
    * ``default_lease_ttl_ms`` / ``min_lease_ttl_ms`` / ``max_lease_ttl_ms`` —
      a resolve's (and a renew's) TTL is the asked one clamped to
      ``[min, max]`` (the floor keeps a lease from expiring while the resolve
      that made it is still fanning out); the protocol makes
      callers always ask, so the default is only for code that builds requests
      from this config (it is lowered to the maximum if above it).
    * ``pin_budget_blocks`` — most blocks per rank remote leases may hold
      pinned at once; 0 means half the pool.
    * ``sibling_timeout_ms`` — how long rank 0 waits for a sibling's answer.
    * ``sibling_retry_after_ms`` — after a sibling failed, resolves fail fast
      for this long instead of waiting for it again.
    * ``rpc_workers`` — handler threads of rank 0's server. A sibling's server
      is always direct (one thread, no proxy hop): its handlers only touch the
      local pool and never wait on anything remote.
    * ``peer_resolve`` — ranks > 0 also serve ``peer_resolve`` (and
      ``release`` of those shares) on a TCP port of their own on ``bind``'s
      host, so that each rank of a target resolves its share with the
      source ranks it reads directly (``source/peer.py``); advertised in
      the metadata. False: only rank 0 is reachable, targets use ``resolve``.
    * ``peer_transport`` — what those peer endpoints speak. ``stream``: the
      plain-TCP RPC lane (:mod:`remote_g2.rpc.stream`), on every rank, rank 0
      included (a lane beside its worker endpoint for the calls of a peer
      load: ``peer_resolve``, ``renew``, ``release``); it saves the ZMQ I/O
      threads' wake-ups on each load's critical path. ``zmq``: ZMQ TCP on
      ranks > 0, rank 0's worker endpoint for rank 0. With ``curve`` set the
      lane is never used (it is plaintext): ``zmq`` whatever this says.
    * ``metrics_port`` — serve Prometheus ``/metrics`` on ``metrics_addr``,
      port ``metrics_port + tp_rank``; None: not served over HTTP.
    * ``progress`` — how each rank's NIXL agent gets the progress readers
      need (:mod:`source.progress_pace`): ``poll``, our thread at a pace
      chosen by where the open leases' readers are, or ``event``, NIXL's
      thread woken by the UCX worker's event descriptor (asleep at most
      ``event_timeout_ms``; opt-in, see that module). ``event`` falls back
      to ``poll`` where NIXL cannot run its thread.
    * ``progress_interval_ms`` / ``one_sided_progress_interval_ms`` /
      ``idle_progress_interval_ms`` — poll mode's paces: while a reader
      whose READs may be emulated holds a lease (one on another host while
      ``UCX_TLS`` allows TCP or UD, or is unset; one on this host without
      ``cma``), while every reader READs one-sided (only wire-ups need
      us), and while no lease is open; a lease opening wakes the thread at
      once (docs/benchmarks.md, "Source progress", has what each costs).
    * ``reap_interval_ms`` — the lease reaper's longest sleep.
    * ``staging_mib`` — each rank's staging region (registered with its
      agent, touched at start-up): where a resolve that asks for it packs a
      target rank's many small pieces into one run (``source/gather.py``).
      It is the gather budget: a part that finds no room is read in place.
      0: never gather.
    * ``gather_min_descriptors`` / ``gather_max_piece_kib`` — the rule: a
      target rank's part is staged when its direct READ would take at least
      this many descriptors, of at most this many KiB each on average
      (docs/benchmarks.md, "Gathered reads", has the measurements behind the
      defaults).
    * ``gather_chunk_kib`` — a part is staged in chunks of about this much,
      its counter advanced after each, so that the reader's READ of one chunk
      overlaps the packing of the next.
    * ``fingerprint`` — the layout announced to the registry (required with
      ``registry_endpoint``).
    * ``curve`` — CURVE keys for rank 0's TCP endpoint (IPC needs none).
    * ``registry_curve`` — the registry's public key (and this client's keys)
      when the registry's endpoint requires CURVE.
    """

    enabled: bool = False
    registry_endpoint: str | None = None
    bind: str | None = None
    advertise: str | None = None
    ipc_dir: str | None = None
    default_lease_ttl_ms: int = 10_000
    max_lease_ttl_ms: int = 60_000
    min_lease_ttl_ms: int = 100
    pin_budget_blocks: int = 0
    sibling_timeout_ms: int = 1_000
    sibling_retry_after_ms: int = 1_000
    rpc_workers: int = 4
    peer_resolve: bool = True
    peer_transport: str = "stream"
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    progress: str = "poll"
    event_timeout_ms: float = 5.0
    progress_interval_ms: float = 0.2
    one_sided_progress_interval_ms: float = 5.0
    idle_progress_interval_ms: float = 1000.0
    reap_interval_ms: float = 50.0
    staging_mib: int = 64
    gather_min_descriptors: int = 16
    gather_max_piece_kib: int = 8
    gather_chunk_kib: int = 2048
    registry_timeout_s: float = 5.0
    fingerprint: LayoutFingerprint | None = None
    curve: CurveServerConfig | None = None
    registry_curve: CurveClientConfig | None = None

    def __post_init__(self) -> None:
        for name in ("default_lease_ttl_ms", "max_lease_ttl_ms", "min_lease_ttl_ms", "sibling_timeout_ms",
                     "rpc_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"SourceConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("progress_interval_ms", "one_sided_progress_interval_ms", "idle_progress_interval_ms",
                     "event_timeout_ms", "reap_interval_ms", "registry_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"SourceConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.staging_mib < 0 or min(self.gather_min_descriptors, self.gather_max_piece_kib,
                                       self.gather_chunk_kib) < 1:
            raise ConfigError("SourceConfig.staging_mib must be >= 0, gather_min_descriptors, "
                              "gather_max_piece_kib and gather_chunk_kib >= 1")
        if self.sibling_retry_after_ms < 0 or self.pin_budget_blocks < 0:
            raise ConfigError("SourceConfig.sibling_retry_after_ms and pin_budget_blocks must be >= 0")
        if self.max_lease_ttl_ms > 3_600_000:
            raise ConfigError("SourceConfig.max_lease_ttl_ms must be <= 3600000 (the protocol's limit)")
        if self.min_lease_ttl_ms > self.max_lease_ttl_ms:
            raise ConfigError(f"min_lease_ttl_ms {self.min_lease_ttl_ms} > max_lease_ttl_ms {self.max_lease_ttl_ms}")
        if self.default_lease_ttl_ms > self.max_lease_ttl_ms:  # lowering the maximum lowers the default
            object.__setattr__(self, "default_lease_ttl_ms", self.max_lease_ttl_ms)
        if self.progress not in MODES:
            raise ConfigError(f"SourceConfig.progress must be one of {MODES}, got {self.progress!r}")
        if self.peer_transport not in ("stream", "zmq"):
            raise ConfigError(f"SourceConfig.peer_transport must be 'stream' or 'zmq', got {self.peer_transport!r}")
        if self.bind is not None and not self.bind.startswith("tcp://"):
            raise ConfigError(f"SourceConfig.bind must be a tcp:// endpoint, got {self.bind!r}")
        if self.advertise is not None and not self.advertise.startswith("tcp://"):
            raise ConfigError(f"SourceConfig.advertise must be a tcp:// endpoint, got {self.advertise!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"SourceConfig.metrics_port {self.metrics_port} is not a port")
        if self.registry_endpoint is not None and self.fingerprint is None:
            raise ConfigError("SourceConfig.registry_endpoint needs a fingerprint (LayoutFingerprint) to register")

    @property
    def stream_lane(self) -> bool:
        """Whether the peer endpoints are stream lanes (asked for, and no CURVE to keep)."""
        return self.peer_resolve and self.peer_transport == "stream" and self.curve is None

    def progress_pace(self, ucx_tls: str | None = None) -> ProgressPace:
        """The progress settings for a rank's agent created under ``ucx_tls`` (default: this process's ``UCX_TLS``)."""
        return ProgressPace(mode=self.progress, emulated_s=self.progress_interval_ms / 1000, cma_ok=cma_usable(),
                            one_sided_s=self.one_sided_progress_interval_ms / 1000,
                            idle_s=self.idle_progress_interval_ms / 1000, event_timeout_s=self.event_timeout_ms / 1000,
                            ucx_tls=ucx_tls if ucx_tls is not None else os.environ.get("UCX_TLS"))

    def lease_ttl_ms(self, asked_ms: int) -> int:
        """The TTL a lease gets: the asked one, clamped to ``[min_lease_ttl_ms, max_lease_ttl_ms]``."""
        return max(self.min_lease_ttl_ms, min(asked_ms, self.max_lease_ttl_ms))

    def with_overrides(self, **changes: object) -> SourceConfig:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **defaults: object) -> SourceConfig:
        """Read ``REMOTE_G2_SOURCE*`` (see the module docstring) over ``defaults``.

        A set but malformed variable is a :class:`ConfigError` naming it.
        """
        e = env if env is not None else os.environ
        kw: dict[str, object] = dict(defaults)
        kw.update(env_fields(_ENV_FIELDS, e))
        secret = e.get("REMOTE_G2_SOURCE_CURVE_SECRET_KEY")
        if secret:
            kw["curve"] = CurveServerConfig.from_files(secret, e.get("REMOTE_G2_SOURCE_CURVE_ALLOWED") or None)
        elif e.get("REMOTE_G2_SOURCE_CURVE_ALLOWED"):
            raise ConfigError("REMOTE_G2_SOURCE_CURVE_ALLOWED needs REMOTE_G2_SOURCE_CURVE_SECRET_KEY")
        registry_curve = CurveClientConfig.from_env("REMOTE_G2_CURVE_SERVER_KEY", dict(e))
        if registry_curve is not None:
            kw["registry_curve"] = registry_curve
        return cls(**kw)  # type: ignore[arg-type]
