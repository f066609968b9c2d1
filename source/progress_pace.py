"""How much progress a source rank's NIXL agent gets: the rule, apart from the thread that applies it.

A reader's READ of this rank's pool needs the source's UCX worker to make
progress in two cases only:

* the **wire-up**: the reader's first READ connects to us, and the
  connection completes only once our worker answers it;
* an **emulated READ**: a transport without one-sided get (``tcp``, the
  ``ud`` family, the ``posix``/``sysv`` shared-memory mailboxes) carries a
  READ as messages our worker must answer, one round per fragment.

A reader on this host READs with ``cma`` (one-sided: it copies out of our
memory without us) where ``UCX_TLS`` allows it and the kernel lets
processes read each other (Yama ``ptrace_scope`` 0 or 1, which UCX handles,
or ``CAP_SYS_PTRACE``); a reader on another host READs over RDMA
(one-sided) or TCP (emulated), and unless ``UCX_TLS`` rules TCP and UD out,
we cannot know which. Progress made where it is not needed only takes CPU
from the ranks doing the copying.

Two modes:

``poll`` (the default)
    Our own thread calls into the agent at :meth:`ProgressPace.poll_interval_s`
    for where the open leases' readers are (their connections say:
    :func:`remote_g2.rpc.connection_identity.is_local`): ``emulated_s`` while a
    reader whose READs may be emulated holds a lease, or one this rank has
    not served before (its wire-up), ``one_sided_s`` while every reader's
    READs are one-sided, ``idle_s`` while no lease is open (no reader is
    reading); a lease opening wakes it.
``event``
    NIXL's own progress thread, sleeping in ``poll()`` on the UCX worker's
    event descriptor: woken at once by emulated READs and wire-ups, never
    by one-sided READs, and every ``event_timeout_s`` (NIXL's guard against
    a wake-up UCX misses). Opt-in: inside vLLM's workers a source rank's
    event-driven thread has been seen to spin a core and stop serving
    (docs/source.md, "NIXL").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container
from dataclasses import dataclass

from remote_g2.rpc.connection_identity import is_local

__all__ = ["MODES", "READERS", "ProgressPace", "ServedOwners", "cma_usable", "local_reads_one_sided", "readers_of",
           "reads_need_source"]

MODES = ("poll", "event")
#: who holds the open leases, as :meth:`source.leases.LeaseTable.readers` says
READERS = ("none", "new", "local", "remote")

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


class ServedOwners:
    """The connections that have released a lease here (their READs are past UCX's wire-up), the most recent
    ``limit`` of them: what :func:`readers_of` calls ``served``. Not thread-safe: its owner's lock guards it."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._owners: OrderedDict[bytes, None] = OrderedDict()

    def add(self, owner: bytes) -> None:
        self._owners[owner] = None
        self._owners.move_to_end(owner)
        if len(self._owners) > self.limit:
            self._owners.popitem(last=False)

    def __contains__(self, owner: object) -> bool:
        return owner in self._owners


def readers_of(owners: Collection[bytes], served: Container[bytes]) -> str:
    """Who holds open leases, from their connections' identities (:data:`READERS`): ``none``; ``new`` (a
    connection not in ``served``, those that have released a lease before: its first READ may still be wiring
    UCX up); ``local`` (only connections from this host); ``remote``."""
    if not owners:
        return "none"
    if any(owner not in served for owner in owners):
        return "new"
    return "local" if all(is_local(owner) for owner in owners) else "remote"


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


def _allows(ucx_tls: str | None, transport: str) -> bool:
    text = (ucx_tls or "").strip().lower()
    if not text or text == "all":
        return True
    names = {t.strip() for t in text.lstrip("^").split(",") if t.strip()}
    listed = transport in _expand(names) or "all" in names
    return not listed if text.startswith("^") else listed


def local_reads_one_sided(ucx_tls: str | None, cma_ok: bool) -> bool:
    """Whether a reader on this host READs one-sided: ``cma`` allowed by ``UCX_TLS`` and by the kernel."""
    return cma_ok and _allows(ucx_tls, "cma")


def cma_usable(proc: str = "/proc") -> bool:
    """Whether the kernel lets UCX's ``cma`` read another process (Yama ptrace_scope <= 1, or CAP_SYS_PTRACE)."""
    try:
        with open(f"{proc}/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        return True  # no Yama: ordinary ptrace rules, same user may read
    if scope <= 1:
        return True  # UCX declares any process its ptracer at scope 1
    try:
        with open(f"{proc}/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        return scope == 2 and bool(int(caps, 16) >> 19 & 1)
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class ProgressPace:
    """The progress settings of one source rank (``SourceConfig`` fills them; see the module docstring).

    ``emulated_s`` / ``one_sided_s`` / ``idle_s`` are poll mode's intervals;
    ``event_timeout_s`` is event mode's longest sleep. ``ucx_tls`` is the
    ``UCX_TLS`` the agent is created under.
    """

    mode: str = "poll"
    emulated_s: float = 0.0002
    one_sided_s: float = 0.005
    idle_s: float = 1.0
    event_timeout_s: float = 0.005
    ucx_tls: str | None = None
    cma_ok: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, got {self.mode!r}")
        if min(self.emulated_s, self.one_sided_s, self.idle_s, self.event_timeout_s) <= 0:
            raise ValueError("progress intervals must be > 0")

    @property
    def reads_need_source(self) -> bool:
        return reads_need_source(self.ucx_tls)

    def one_sided(self, local: bool) -> bool:
        """Whether a reader's READs of this agent need none of its progress once wired up: on this host
        (``local``), ``cma`` allowed by ``UCX_TLS`` and the kernel; elsewhere, no emulating transport allowed."""
        return local_reads_one_sided(self.ucx_tls, self.cma_ok) if local else not self.reads_need_source

    def poll_interval_s(self, readers: str) -> float:
        """Poll mode: how long to sleep between two progress calls while the leases' readers are ``readers``."""
        if readers == "none":
            return self.idle_s
        if readers == "new":  # a reader's first READ: UCX's wire-up waits on us
            return self.emulated_s
        return self.one_sided_s if self.one_sided(readers == "local") else self.emulated_s

    def describe(self, mode: str) -> str:
        """One line for the start-up log: the mode in effect and its paces."""
        if mode == "event":
            return f"event-driven (NIXL's thread, woken by UCX; at most {self.event_timeout_s * 1e3:g} ms asleep)"
        return (f"polled (UCX_TLS={self.ucx_tls or 'unset'}): every {self.poll_interval_s('local') * 1e3:g} ms "
                f"while readers on this host hold leases, every {self.poll_interval_s('remote') * 1e3:g} ms "
                f"while one elsewhere does, every {self.idle_s * 1e3:g} ms otherwise")
