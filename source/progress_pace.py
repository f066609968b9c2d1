"""How much progress a source rank's NIXL agent gets: the rule, apart from the thread that applies it.

A reader's READ of this rank's pool needs the source's UCX worker to make
progress in two cases only:

* the **wire-up**: the reader's first READ connects to us, and the
  connection completes only once our worker answers it;
* an **emulated READ**: a transport without one-sided get (``tcp``, the
  ``ud`` family, the ``posix``/``sysv`` shared-memory mailboxes) carries a
  READ as messages our worker must answer, one round per fragment.

Over ``cma``/``knem``/``xpmem`` on one host, and over RDMA (``rc``/``dc``),
a connected reader's READs complete without us, and progress we make
there only takes CPU from the ranks doing the copying.

Two modes:

``event`` (the default)
    NIXL's own progress thread sleeps in ``poll()`` on the UCX worker's
    event descriptor and progresses when something arrives: every emulated
    READ's message and every wire-up wakes it at once, a one-sided READ
    never does, and an idle source sleeps. NIXL also wakes it every
    ``event_timeout_s`` (its guard against a wake-up UCX misses).
``poll``
    Used when asked for, or when this NIXL cannot run an event-driven
    thread: our own thread calls into the agent at the pace
    :meth:`ProgressPace.poll_interval_s` gives — fast while leases are open
    and READs may be emulated (``UCX_TLS`` allows such a transport, or is
    unset: UCX then picks per peer and we cannot know), slower while leases
    are open and every allowed transport is one-sided (only wire-ups need
    us), and seldom while no lease is open (no reader is reading).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODES", "ProgressPace", "reads_need_source"]

MODES = ("event", "poll")

#: UCX transports (and aliases) whose READ (get) completes without the remote side's progress.
ONE_SIDED_TRANSPORTS = frozenset({
    "cma", "knem", "xpmem",
    "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5",
    "cuda_copy", "cuda_ipc", "gdr_copy", "rocm_copy", "rocm_ipc", "rocm_gdr", "ze_copy", "ze_ipc",
    "self",
})
#: What UCX's aliases expand to, where an alias mixes both kinds: ``sm`` holds the mailboxes.
_ALIASES = {
    "sm": {"cma", "knem", "xpmem", "posix", "sysv"}, "shm": {"cma", "knem", "xpmem", "posix", "sysv"},
    "mm": {"posix", "sysv"}, "ib": {"rc", "rc_x", "dc_x", "ud", "ud_x"},
    "ud": {"ud", "ud_v", "ud_x"}, "tcp": {"tcp"},
}


def _expand(names: set[str]) -> set[str]:
    out: set[str] = set()
    for n in names:
        out |= _ALIASES.get(n, {n})
    return out


def reads_need_source(ucx_tls: str | None) -> bool:
    """Whether READs over the transports ``UCX_TLS`` allows may need this side's progress.

    True unless every allowed transport is one-sided: unset, ``all``, an
    exclusion list (``^…``: UCX keeps everything else, ``tcp`` or ``ud``
    among it unless excluded) and any emulating transport named all count
    as "may". Unknown names count as emulating: when in doubt, progress.
    """
    text = (ucx_tls or "").strip().lower()
    if not text:
        return True
    if text.startswith("^"):
        excluded = _expand({t.strip() for t in text[1:].split(",") if t.strip()})
        return not {"tcp", "ud", "ud_v", "ud_x", "posix", "sysv"} <= excluded
    allowed = _expand({t.strip() for t in text.split(",") if t.strip()})
    return "all" in allowed or not allowed <= ONE_SIDED_TRANSPORTS


@dataclass(frozen=True)
class ProgressPace:
    """The progress settings of one source rank (``SourceConfig`` fills them; see the module docstring).

    ``emulated_s`` / ``one_sided_s`` / ``idle_s`` are poll mode's intervals;
    ``event_timeout_s`` is event mode's longest sleep. ``ucx_tls`` is the
    ``UCX_TLS`` the agent is created under.
    """

    mode: str = "event"
    emulated_s: float = 0.0002
    one_sided_s: float = 0.005
    idle_s: float = 1.0
    event_timeout_s: float = 0.1
    ucx_tls: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, got {self.mode!r}")
        if min(self.emulated_s, self.one_sided_s, self.idle_s, self.event_timeout_s) <= 0:
            raise ValueError("progress intervals must be > 0")

    @property
    def reads_need_source(self) -> bool:
        return reads_need_source(self.ucx_tls)

    def poll_interval_s(self, leases_open: bool) -> float:
        """Poll mode: how long to sleep between two progress calls in this state."""
        if not leases_open:
            return self.idle_s
        return self.emulated_s if self.reads_need_source else self.one_sided_s

    def describe(self, mode: str) -> str:
        """One line for the start-up log: the mode in effect and its paces."""
        if mode == "event":
            return f"event-driven (NIXL's thread, woken by UCX; at most {self.event_timeout_s * 1e3:g} ms asleep)"
        kind = "may be emulated" if self.reads_need_source else "one-sided"
        return (f"polled: every {self.poll_interval_s(True) * 1e3:g} ms while leases are open "
                f"(READs {kind}, UCX_TLS={self.ucx_tls or 'unset'}), every {self.idle_s * 1e3:g} ms otherwise")
