"""The target side: reading remote G2 blocks into a reusing worker, from every TP rank.

Engine-facing entry point::

    from remote_g2.target import maybe_start_target_client, TargetConfig

    client = maybe_start_target_client(pool, tp_rank=r, tp_size=n, worker_id="w1",
                                       config=TargetConfig.from_env())
    # rank 0: client.lookup / start_load / get_finished / invalid_block_ids

Modules::

    client.py       TargetClient, start/maybe_start_target_client; the leader's coordinator
    rank_worker.py  one rank's data path: plan, READ, poll, report (owns the transfer adapter)
    tp_mapping.py   which bytes each target rank reads from which source rank (pure)
    config.py       TargetConfig (code or REMOTE_G2_TARGET* environment)

Names are imported lazily so ``import remote_g2.target`` stays cheap.

May import: the core, and the registry's client side (``registry.client``: the typed client and the mirror
its leader looks up through) when a registry is configured. Never ``source`` or ``adapters``.
"""

from __future__ import annotations

from remote_g2.lazy_exports import lazy_getattr

_EXPORTS = {
    "maybe_start_target_client": ".client",
    "start_target_client": ".client",
    "TargetClient": ".client",
    "TargetMatch": ".client",
    "TargetConfig": ".config",
    "RankWorker": ".rank_worker",
    "plan_reads": ".tp_mapping",
    "ReadPlanner": ".tp_mapping",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
