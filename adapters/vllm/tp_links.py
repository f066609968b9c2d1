"""A vLLM instance's TP ranks exchanging each step's decisions over local links, not over gloo.

:mod:`.tp_sync` makes the ranks agree, in a step with loads, on which blocks
every rank's G2 holds and on how the leader's fetches ended. Over vLLM's CPU
(gloo) TP group each of those is a ``torch.distributed.all_gather_object``:
a pickle, two collectives and a handful of torch ops, paid on the engine's
thread once or twice in every step with a load (what that costs against a
link: ``bench/rpc/bench_tp_exchange.py``, docs/benchmarks.md). The
ranks of one instance share a host (vLLM runs a TP group's CPU workers on one
machine), so :class:`StepLinks` carries the same exchanges over one Unix
stream socket per rank (:mod:`remote_g2.rpc.local_link`: typed frames, validated
on arrival, in a private directory of mode 0700):

* :meth:`StepLinks.gather_and` — every rank's bit vector, ANDed by the leader
  and sent back to all (two hops);
* :meth:`StepLinks.broadcast` — the leader's fetch outcome to every rank (one
  hop; the other ranks send nothing).

Every exchange carries a sequence number and rank 0's monotonic clock (the
landing slots' clock, :meth:`.tp_sync.TpSync.now`). The ranks call the same
exchanges in the same order (:mod:`.tp_sync`), so a frame out of sequence, of
the wrong kind or of another length is a bug or an intruder:
:class:`~remote_g2.errors.ProtocolError`, as is a link that stays silent past
``timeout_s`` (:class:`~remote_g2.errors.TransportError`) or closes
(:class:`~remote_g2.errors.LinkClosed`, at once: a rank that dies closes its
socket).

:func:`connect_step_links` sets the links up over the gloo group once, at
registration (collective); a rank on another host than the leader's (another
boot id) leaves every rank on gloo.
"""

from __future__ import annotations

import logging
import select
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from remote_g2.errors import ConfigError, LinkClosed, ProtocolError, TransportError
from remote_g2.rpc.ipc_paths import default_ipc_dir, ipc_endpoint, prepare_ipc_dir
from remote_g2.rpc.local_link import LinkListener, MessageLink, boot_id, connect_link
from remote_g2.protocol.messages import message
from remote_g2.protocol.schema import Limits, Packed

__all__ = ["StepLinks", "TpStep", "connect_step_links", "STEP_TIMEOUT_S"]

log = logging.getLogger("remote_g2.adapters.vllm")

#: How long a rank waits for the others in one exchange. The ranks reach it in the same step (vLLM
#: runs every worker's step together), so only a rank that hangs makes this wait; one that dies closes
#: its link and is noticed at once.
STEP_TIMEOUT_S = 300.0

_FetchId = Annotated[str, Limits(min_len=1, max_len=1024)]
_FetchIds = Annotated[list[_FetchId], Limits(max_len=65_536)]


@message("vllm_tp_step", reply=None)
@dataclass(frozen=True, slots=True)
class TpStep:
    """One exchange among a vLLM instance's TP ranks: rank r's bits to the leader, or the leader's answer."""

    seq: Annotated[int, Limits(ge=1)]
    kind: Annotated[str, Limits(min_len=1, max_len=16)]  # "held" or "outcome"
    clock: float = 0.0  # rank 0's time.monotonic() (the leader's frames only)
    held: Annotated[bytes, Limits(max_len=1 << 20)] = b""  # one byte (0/1) per block asked about
    done: _FetchIds = field(default_factory=list)
    failed: _FetchIds = field(default_factory=list)
    invalid: Annotated[list[Annotated[int, Limits(ge=0)]], Limits(max_len=1 << 20), Packed()] = field(
        default_factory=list)
    expired: bool = False


class StepLinks:
    """Rank 0: a link to every other rank; rank r > 0: its link to rank 0. One thread (the model runner's)."""

    def __init__(self, rank: int, size: int, links: dict[int, MessageLink], *,
                 timeout_s: float = STEP_TIMEOUT_S) -> None:
        self.rank = rank
        self.size = size
        self._links = links  # rank 0: {r: link}; rank r: {0: link}
        self._seq = 0
        self._timeout_s = timeout_s

    def gather_and(self, held: bytes) -> tuple[float, bytes]:
        """Every rank passes its bits (``held[i]`` 0 or 1); every rank gets their AND and rank 0's clock."""
        seq = self._next()
        if self.rank != 0:
            self._links[0].send(TpStep(seq, "held", held=held))
            got = self._expect(0, seq, "held", len(held))
            return got.clock, got.held
        acc = bytearray(held)
        for r in sorted(self._links):
            theirs = self._expect(r, seq, "held", len(held)).held
            for i, b in enumerate(theirs):
                if not b:
                    acc[i] = 0
        answer = TpStep(seq, "held", clock=time.monotonic(), held=bytes(acc))
        for r in sorted(self._links):
            self._links[r].send(answer)
        return answer.clock, answer.held

    def broadcast(self, outcome: dict[str, Any] | None) -> tuple[float, dict[str, Any]]:
        """Rank 0 passes its fetch outcome (``done``, ``failed``, ``invalid``, ``expired``; the others None);
        every rank gets it, with rank 0's clock."""
        seq = self._next()
        if self.rank != 0:
            got = self._expect(0, seq, "outcome", None)
        else:
            assert outcome is not None
            got = TpStep(seq, "outcome", clock=time.monotonic(), done=list(outcome["done"]),
                         failed=list(outcome["failed"]), invalid=list(outcome["invalid"]),
                         expired=bool(outcome["expired"]))
            for r in sorted(self._links):
                self._links[r].send(got)
        return got.clock, {"done": got.done, "failed": got.failed, "invalid": got.invalid, "expired": got.expired}

    def close(self) -> None:
        for link in self._links.values():
            link.close()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _expect(self, rank: int, seq: int, kind: str, length: int | None) -> TpStep:
        """The next frame from ``rank``, which must be exchange ``seq`` of ``kind`` (``length`` bits, if given)."""
        link = self._links[rank]
        deadline = time.monotonic() + self._timeout_s
        while not link.unread:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"TP rank {rank} sent nothing for exchange {seq} ({kind}) within "
                                     f"{self._timeout_s:g} s")
            poller = select.poll()
            poller.register(link.fileno(), select.POLLIN)
            if poller.poll(left * 1000.0):
                link.unread = link.receive()
        msg, link.unread = link.unread[0], link.unread[1:]
        if not isinstance(msg, TpStep) or msg.seq != seq or msg.kind != kind or (
                length is not None and len(msg.held) != length) or any(b > 1 for b in msg.held):
            link.close()
            raise ProtocolError(f"TP rank {rank} sent {type(msg).__name__} "
                                f"{getattr(msg, 'kind', '?')} #{getattr(msg, 'seq', '?')} where exchange {seq} "
                                f"({kind}{'' if length is None else f', {length} bits'}) was due")
        return msg


def connect_step_links(comm: Any, worker_id: str, ipc_dir: str | None, *,
                       timeout_s: float = 30.0) -> StepLinks | None:
    """Collective over ``comm`` (the gloo TP group): links from rank 0 to every rank, or None on every rank
    when some rank is on another host or a link could not be set up (the exchanges then stay on gloo)."""
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    listener: LinkListener | None = None
    path, error = "", None
    if rank == 0:
        try:
            directory = prepare_ipc_dir(ipc_dir or default_ipc_dir())
            path = ipc_endpoint(directory, f"vllm-{worker_id}", 0)[len("ipc://"):]
            listener = LinkListener(path)
        except ConfigError as e:
            error = str(e)
    hello = comm.allgather((boot_id(), path, error))
    boots = {h[0] for h in hello}
    if len(boots) != 1 or hello[0][2] is not None:
        if listener is not None:
            listener.close()
        why = hello[0][2] or "the TP ranks are on different hosts"
        log.info("worker %s: TP ranks exchange each step over gloo (%s)", worker_id, why)
        return None
    links: dict[int, MessageLink] = {}
    try:
        if rank == 0:
            assert listener is not None
            links = listener.accept_ranks(set(range(1, size)), worker_id, timeout_s=timeout_s)
        else:
            links = {0: connect_link(hello[0][1], rank=rank, worker_id=worker_id, timeout_s=timeout_s)}
        error = None
    except (TransportError, ConfigError, LinkClosed) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        if listener is not None:
            listener.close()  # every rank connected (or never will): the socket file goes
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        for link in links.values():
            link.close()
        log.warning("worker %s: TP step links failed (%s); the ranks exchange each step over gloo", worker_id,
                    errors[0])
        return None
    return StepLinks(rank, size, links)
