"""The source service: serves a worker's G2 pool to remote readers, from every TP rank.

Engine-facing entry point::

    from remote_g2.source import maybe_start_source_service, SourceConfig

    service = maybe_start_source_service(pool, worker_id="w0", config=SourceConfig.from_env())
    ...
    if service is not None:
        service.shutdown()

Modules::

    service.py        SourceService (a rank's start-up and lifetime), start/maybe_start_source_service
    rank0_rpc.py      Rank0Handlers: rank 0's resolve / release / renew / get_metadata, fanned out
    config.py         SourceConfig (code or REMOTE_G2_SOURCE* environment)
    leases.py         LeaseTable (per-rank pins per lease, expiry), PinBudget
    siblings.py       sibling IPC sockets, handlers, rank 0's concurrent fan-out
    peer.py           peer_resolve: each rank answers a target rank's share itself
    rank_agent.py     the rank's NIXL agent, registered pool, progress thread (pace: progress_pace.py)
    gather.py         gathered reads, packed into the staging region of staging.py
    metrics.py        Prometheus metrics (one private registry per service)

May import: the core (``remote_g2``'s packages) and, to announce the worker,
the registry's client (``remote_g2.registry``, loaded only when a registry is
configured); never ``target`` or ``adapters``.

Names are imported lazily so ``import remote_g2.source`` stays cheap (NIXL,
MPI and prometheus load when a service starts).
"""

from __future__ import annotations

from remote_g2.lazy_exports import lazy_getattr

_EXPORTS = {
    "maybe_start_source_service": ".service",
    "start_source_service": ".service",
    "SourceService": ".service",
    "SourceConfig": ".config",
    "LeaseTable": ".leases",
    "PinBudget": ".leases",
    "SourceMetrics": ".metrics",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
