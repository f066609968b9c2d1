"""One load as the leader's coordinator sees it: its state, its lease, and the moves allowed between states.

A load is a request's blocks on their way from one source into this
worker. It moves through named states, and :meth:`Load.enter` is the only
way to change state: a transition the table below does not list is a bug and
raises, instead of leaving a load half in one mode and half in another::

    LOOKING_UP ──▶ RESOLVING ──▶ READING ──▶ DONE
        │              │           │  └────▶ RELEASING ──▶ DONE / FAILED
        └──────────────┴───────────┴───────▶ FAILED
                       ▲           │
                       └───────────┘  (the source restarted under a peer load: resolve it again, classically)

* ``LOOKING_UP``: waiting for the registry (no cached answer from ``lookup``);
* ``RESOLVING``: waiting for the source to pin the prefix (the classic
  strategy: source rank 0's ``resolve``; its metadata when new);
* ``READING``: every target rank was handed its share and the leader waits
  for each one's ``target_done`` (under the peer strategy each rank first
  resolves its own share with its peer source rank);
* ``RELEASING``: every rank answered, but after the lease may have lapsed
  on the source: the release's answer decides (released: the pins held);
* ``DONE`` / ``FAILED``: reported to the engine; the coordinator forgets it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client import TargetMatch
    from .resolve_strategies import ResolveStrategy

__all__ = ["Load", "LoadState", "LeaseClock"]


class LoadState(enum.Enum):
    LOOKING_UP = "looking_up"
    RESOLVING = "resolving"
    READING = "reading"
    RELEASING = "releasing"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (LoadState.DONE, LoadState.FAILED)


_MOVES: dict[LoadState, frozenset[LoadState]] = {
    LoadState.LOOKING_UP: frozenset({LoadState.RESOLVING, LoadState.READING, LoadState.FAILED}),
    LoadState.RESOLVING: frozenset({LoadState.READING, LoadState.FAILED}),
    LoadState.READING: frozenset({LoadState.RESOLVING, LoadState.RELEASING, LoadState.DONE, LoadState.FAILED}),
    LoadState.RELEASING: frozenset({LoadState.DONE, LoadState.FAILED}),
    LoadState.DONE: frozenset(),
    LoadState.FAILED: frozenset(),
}


@dataclass
class LeaseClock:
    """The lease a load holds on its source: where it was taken (renew and release go there: its owner),
    when it may expire (``time.monotonic()``, counted from when the resolve was *sent*, so never late), and
    when to renew it."""

    lease_id: int = 0
    endpoint: str | None = None
    expires: float = 0.0
    renew_at: float = 0.0
    renewing: bool = False

    def granted(self, sent: float, expires_in_ms: int) -> None:
        """The source granted (or renewed) the lease for ``expires_in_ms`` on a call sent at ``sent``."""
        self.expires = sent + expires_in_ms / 1000.0
        self.renew_at = sent + expires_in_ms / 2000.0


@dataclass
class Load:
    """The leader's view of one request's load (see the module docstring)."""

    load_id: int
    request_id: str
    hashes: list[bytes]
    dst: list[int]
    state: LoadState = LoadState.LOOKING_UP
    match: TargetMatch | None = None
    strategy: ResolveStrategy | None = None  # how its lease is being resolved (set on entering RESOLVING/READING)
    lease: LeaseClock = field(default_factory=LeaseClock)
    # Under the peer strategy, the leader's shares on the other source ranks it reads (each its own lease,
    # renewed and released where it was taken, like ``lease``).
    other_shares: list[LeaseClock] = field(default_factory=list)
    waiting: set[int] = field(default_factory=set)       # ranks whose target_done is still due
    errors: list[str] = field(default_factory=list)
    invalid_tail: list[int] = field(default_factory=list)  # destination blocks past what the source pinned
    loaded: dict[int, int] = field(default_factory=dict)   # rank -> leading blocks it loaded
    deadline: float = 0.0     # the ranks': no READ starts after it
    report_by: float = 0.0    # the leader's: ranks still silent then are given up
    started: float = field(default_factory=time.monotonic)
    dispatched: float = 0.0   # when every rank was handed its share (for the "reads" phase)
    source_epoch: int = 0     # the source's epoch the lease was taken in
    resolve_again: bool = False  # READING → RESOLVING once every rank answered (a restarted source)

    def enter(self, state: LoadState) -> None:
        """Move to ``state``; a move the state table does not allow is a bug (``RuntimeError``)."""
        if state not in _MOVES[self.state]:
            raise RuntimeError(f"load {self.load_id} ({self.request_id}): {self.state.name} -> {state.name} "
                               "is not a move a load makes")
        self.state = state

    def hand_back_tail(self) -> None:
        """Before resolving again: every destination block is wanted again, nothing has been read."""
        self.dst, self.invalid_tail = self.dst + self.invalid_tail, []
        self.lease, self.other_shares = LeaseClock(), []
        self.errors, self.loaded, self.report_by, self.resolve_again = [], {}, 0.0, False

    def leases(self) -> list[LeaseClock]:
        """Every lease this load holds for the leader (``lease`` first)."""
        return [self.lease, *self.other_shares]

    def keep_prefix(self, n: int) -> None:
        """Only the first ``n`` destination blocks will be loaded; the rest are invalid (recomputed)."""
        self.invalid_tail, self.dst = self.dst[n:] + self.invalid_tail, self.dst[:n]
