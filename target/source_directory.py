"""What the leader knows of each source worker it has loaded from: epoch, ranks, and what its ranks were sent.

Per source worker, for its current epoch (a new epoch is a restart and
starts from nothing): every source rank's :class:`~remote_g2.protocol.messages.RankInfo`,
the agents whose metadata every target rank already holds (sent once with a
``target_load``; the ranks keep it per epoch), the endpoint that metadata came
from, and whether peer resolve failed against that epoch. Used by the
coordinator's thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from remote_g2.protocol.messages import RankInfo

from .peer_share import peer_endpoints

__all__ = ["SourceDirectory"]


@dataclass
class _Source:
    epoch: int
    infos: dict[int, RankInfo] = field(default_factory=dict)
    sent: set[str] = field(default_factory=set)  # agent names every target rank holds metadata for


class SourceDirectory:
    """Source workers' ranks as the leader learned them (see the module docstring)."""

    def __init__(self) -> None:
        self._sources: dict[str, _Source] = {}
        self._endpoints: dict[str, str | None] = {}  # worker -> the endpoint its infos came from
        self._peer_off: set[tuple[str, int]] = set()  # (worker, epoch) whose peer resolve failed

    def known_agents(self, worker: str) -> list[str]:
        """Agents of ``worker`` whose metadata the ranks hold: a resolve need not carry them again."""
        source = self._sources.get(worker)
        return sorted(source.sent) if source else []

    def learn(self, worker: str, epoch: int, metadata: list[RankInfo]) -> tuple[dict[int, RankInfo], bool]:
        """Add what a reply told of ``worker``'s ranks; every known rank's info for ``epoch``, and True when
        an agent's metadata is still missing (ask ``get_metadata``)."""
        source = self._sources.get(worker)
        if source is None or source.epoch != epoch:
            source = self._sources[worker] = _Source(epoch)
        for info in metadata:
            if info.agent_metadata is not None or info.rank not in source.infos:
                source.infos[info.rank] = info
        missing = not source.infos or any(i.agent_metadata is None and i.agent_name not in source.sent
                                          for i in source.infos.values())
        return source.infos, missing

    def came_from(self, worker: str, endpoint: str | None) -> None:
        self._endpoints[worker] = endpoint

    def first_sent(self, worker: str, infos: dict[int, RankInfo]) -> set[str]:
        """The agents of ``infos`` the ranks have not been sent yet; from now on they count as sent."""
        source = self._sources[worker]
        new = {info.agent_name for info in infos.values() if info.agent_name not in source.sent}
        source.sent.update(new)
        return new

    def current(self, worker: str) -> tuple[int, dict[int, RankInfo]]:
        source = self._sources[worker]
        return source.epoch, source.infos

    def forget(self, worker: str) -> None:
        """``worker`` restarted (or its lane went away): learn it again from its next resolve."""
        self._sources.pop(worker, None)

    def peer_ready(self, worker: str, endpoint: str, tp_size: int, *, is_mla: bool = False,
                   mla_offset: Callable[[int], int] = lambda source_tp: 0) -> bool:
        """Whether every target rank can resolve its own share of a load from ``worker`` (docs/target.md).

        Needs a peer endpoint on every source rank a target rank reads from
        (:func:`~remote_g2.tp.head_slices.source_ranks_for`; ``mla_offset(source_tp)``
        as the reads are planned) — for source rank 0 only when a target
        rank > 0 reads it, since the leader may ask rank 0 at the worker's
        endpoint — and the source's current metadata on every target rank
        (sent with an earlier load, from the same endpoint: a new one is a
        restart); not after a peer call to that source epoch failed. (The
        caller checks the target's own config: peer resolve on.)
        """
        source = self._sources.get(worker)
        if source is None or (worker, source.epoch) in self._peer_off or self._endpoints.get(worker) != endpoint:
            return False
        source_tp = len(source.infos)
        if set(source.infos) != set(range(source_tp)):
            return False
        if not all(info.agent_name in source.sent for info in source.infos.values()):
            return False
        if not is_mla and max(source_tp, tp_size) % min(source_tp, tp_size):
            return False  # no such plan: the classic resolve says why
        offset = mla_offset(source_tp)
        return all(all(peer_endpoints(r, source.infos.get, source_tp=source_tp, target_tp=tp_size, is_mla=is_mla,
                                      mla_offset=offset, rank0_endpoint=endpoint if r == 0 else None).values())
                   for r in range(tp_size))

    def peer_failed(self, worker: str, epoch: int) -> bool:
        """Stop peer resolve against ``worker``'s ``epoch``; True the first time."""
        if (worker, epoch) in self._peer_off:
            return False
        self._peer_off.add((worker, epoch))
        return True
