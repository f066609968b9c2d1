"""Starting one part of a worker (a source service, a target client) on every rank of its TP group.

:func:`start_on_every_rank` is the start-up both parts share: check the
worker id, find this rank's TP group (:func:`~.group.resolve_tp_group`:
collective over MPI world when no communicator is given), build the part
for that group and start it. A part whose start raises is shut down before
the error goes on, so a failed start leaves nothing bound or registered;
the part's start is itself collective over the group (every rank must call
this, and every rank raises when any failed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from remote_g2.errors import ConfigError

from .group import TpGroup, resolve_tp_group

__all__ = ["RankPart", "start_on_every_rank"]


class RankPart(Protocol):
    """What :func:`start_on_every_rank` starts: something it can shut down (idempotently) when its start fails."""

    def shutdown(self) -> None: ...


P = TypeVar("P", bound=RankPart)


def start_on_every_rank(build: Callable[[TpGroup], P], start: Callable[[P], None], *, worker_id: str,
                        tp_rank: int | None, tp_size: int | None, comm: Any) -> P:
    """This rank's part: ``build(group)``, then ``start(part)``; shut down and re-raised when the start fails.

    Raises :class:`ConfigError` for a ``worker_id`` that is empty or longer
    than 128 characters (before any collective call) and for a TP group that
    ``tp_rank`` / ``tp_size`` / ``comm`` do not describe.
    """
    if not worker_id or len(worker_id) > 128:
        raise ConfigError(f"worker_id must be 1..128 characters, got {worker_id!r}")
    group = resolve_tp_group(tp_rank, tp_size, comm)
    part = build(group)
    try:
        start(part)
    except BaseException:
        part.shutdown()
        raise
    return part
