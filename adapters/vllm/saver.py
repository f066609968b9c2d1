"""Copying a vLLM worker's full prompt blocks into its G2 pool beside the engine, not on its thread.

vLLM calls ``wait_for_save`` once per step, on the model runner's thread,
after the step's forward. :class:`BlockSaver` only *queues* there: the step's
new blocks become one :class:`SaveJob`, and one copy thread per worker runs
the jobs in order:

* **CPU**: the copies are torch indexing ops, which release the GIL, so the
  engine's next step runs while a job copies.
* **CUDA**: ``submit`` records an event on the engine's current stream; the
  copy thread makes a side stream wait for it, gathers the blocks into a
  pinned host buffer there (``non_blocking``), and waits for that stream
  alone. The step's compute is ordered before the copy and nothing on the
  engine's stream waits for the copy. Written as vLLM's CPU offloading
  writes it; run only where a GPU exists.

The contracts the connector builds on:

* **Published only once copied.** A job ends with ``HostPool.store``, which
  writes the bytes before the hashes enter the pool's index; the source
  service's pool listener publishes them to the registry after that. No
  reader can find, resolve or READ a block whose copy has not ended.
* **Never copied twice.** A hash G2 already holds, or one a queued job
  already copies, is left out of a new job.
* **vLLM's blocks outlive the copies reading them.** The saver tracks which
  requests each job reads; :meth:`BlockSaver.pending` says whether a request
  still has one queued or running, :meth:`BlockSaver.wait_for` blocks until
  it has none. The connector keeps a finished request's blocks (vLLM's
  delayed free) until ``pending`` says no, and waits for a preempted
  request's jobs before the step that may reuse its blocks runs.
* **A failed copy loses sharing, never correctness.** It is logged; its
  blocks are simply not in G2.

Not thread-safe for submitters: the worker's model-runner thread owns
``submit``; ``pending``/``wait_for`` may be called from it at any time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from remote_g2.errors import RemoteG2Error
from remote_g2.memory.host_memory import huge_page_buffer, populate

from .kv_blocks import VllmKvLayout

__all__ = ["BlockSaver", "SaveJob"]

log = logging.getLogger("remote_g2.adapters.vllm")


@dataclass(eq=False)
class SaveJob:
    """One step's blocks to copy: vLLM block ``block_ids[i]`` holds ``hashes[i]`` for request ``request_ids[i]``;
    or, with ``from_slots``, G2 landing slot ``from_slots[i]`` holds ``hashes[i]`` (a remote load's blocks)."""

    job_id: int
    hashes: list[bytes]
    block_ids: list[int]
    request_ids: list[str]
    from_slots: list[int] | None = None
    ready: Any = None  # CUDA: the event recorded after the step's compute
    dropped: bool = False  # its blocks may have been overwritten while it copied: store nothing
    queued_at: float = field(default_factory=time.perf_counter)


class BlockSaver:
    """One worker's copy thread: vLLM blocks → G2, a job per step, in order.

    ``copy_hook`` (tests only) runs in the copy thread between the gather
    and the store of each job, e.g. to slow a copy on purpose.
    """

    def __init__(self, kv: VllmKvLayout, pool: Any, *, copy_hook: Callable[[SaveJob], None] | None = None) -> None:
        self._kv = kv
        self._pool = pool
        self._copy_hook = copy_hook
        self._pool_bytes = pool.tensor.numpy() if pool.tensor.device.type == "cpu" else None
        # One gather buffer, kept and grown: a fresh one per job would be faulted in page by page inside
        # every copy (host_memory: a first touch costs more than the copy on some machines).
        self._scratch: np.ndarray | None = None
        self._device = kv.views[0].device
        self._cuda = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self._device) if self._cuda else None
        self._jobs: queue.SimpleQueue[SaveJob | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: Counter[str] = Counter()  # request id -> jobs of it queued or running
        self._in_flight: set[bytes] = set()  # hashes a queued or running job copies
        self._queued: list[SaveJob] = []  # jobs queued or running, oldest first
        self._next_id = 0
        self.jobs_done = 0
        self.blocks_saved = 0
        self.copy_s = 0.0  # time the copy thread spent copying (gather + store)
        self._thread = threading.Thread(target=self._run, name="remote-g2-saver", daemon=True)
        self._thread.start()

    # -- the model runner's thread ------------------------------------------

    def submit(self, request_ids: Sequence[str], hashes: Sequence[bytes], block_ids: Sequence[int]) -> SaveJob | None:
        """Queue this step's blocks (``hashes[i]`` in vLLM block ``block_ids[i]``, of ``request_ids[i]``).

        Hashes G2 holds, or a queued job copies, are left out; None when nothing is left.
        Returns at once: the copy runs in the saver's thread.
        """
        with self._cond:
            new = self._new(hashes)
            if not new:
                return None
            job = self._enqueue(SaveJob(0, [hashes[i] for i in new], [block_ids[i] for i in new],
                                        [request_ids[i] for i in new]))
        if self._cuda:  # the copy may start only after the step's compute wrote these blocks
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(self._device))
        self._jobs.put(job)
        return job

    def submit_landed(self, hashes: Sequence[bytes], slots: Sequence[int]) -> SaveJob | None:
        """Queue keeping blocks a remote load landed (``hashes[i]`` in landing slot ``slots[i]``) in G2.

        The caller keeps the slots until :meth:`wait_job` says the job ended. Hashes G2 holds, or a
        queued job copies, are left out; None when nothing is left.
        """
        with self._cond:
            new = self._new(hashes)
            if not new:
                return None
            job = self._enqueue(SaveJob(0, [hashes[i] for i in new], [], [], from_slots=[slots[i] for i in new]))
        self._jobs.put(job)
        return job

    def _new(self, hashes: Sequence[bytes]) -> list[int]:
        """Under the lock: positions of the hashes a new job copies (first of each; not in G2 or in flight)."""
        seen: set[bytes] = set()
        out = []
        for i, h in enumerate(hashes):
            if h not in seen and h not in self._in_flight and self._pool.lookup(h) is None:
                seen.add(h)
                out.append(i)
        return out

    def _enqueue(self, job: SaveJob) -> SaveJob:
        """Under the lock: number ``job`` and count it as queued (the caller puts it on the queue)."""
        self._next_id += 1
        job.job_id = self._next_id
        self._in_flight.update(job.hashes)
        self._pending.update(set(job.request_ids))
        self._queued.append(job)
        return job

    def _wait(self, busy: Callable[[], bool], timeout_s: float) -> bool:
        """Block while ``busy()`` (checked under the lock); False if ``timeout_s`` passed or the thread died first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while busy():
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def wait_job(self, job: SaveJob, timeout_s: float = 30.0) -> bool:
        """Block until ``job`` ended (stored, dropped or failed); False if ``timeout_s`` passed first."""
        return self._wait(lambda: job in self._queued, timeout_s)

    def pending(self, request_id: str) -> bool:
        """Whether a job reading ``request_id``'s blocks is queued or running."""
        with self._cond:
            return self._pending[request_id] > 0

    def wait_for(self, request_ids: Collection[str], timeout_s: float = 30.0) -> bool:
        """Block until no job reads any of ``request_ids``' blocks; False if ``timeout_s`` passed first."""
        return self._wait(lambda: any(self._pending[r] > 0 for r in request_ids), timeout_s)

    def drop(self, request_ids: Collection[str]) -> None:
        """Store nothing of the jobs reading ``request_ids``' blocks that have not stored yet.

        For blocks vLLM is about to reuse while a copy of them may still run: what that copy
        gathered may be half old, half new bytes.
        """
        with self._cond:
            for job in self._queued:
                if not job.dropped and not set(job.request_ids).isdisjoint(request_ids):
                    job.dropped = True

    def idle(self) -> bool:
        """No job queued or running."""
        with self._cond:
            return not self._in_flight

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued jobs (up to ``timeout_s``) and stop the thread."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    # -- the copy thread ------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                self._copy(job)
            except RemoteG2Error as e:  # every G2 block pinned by readers: these blocks just are not shared
                log.warning("saving %d blocks to G2 failed: %s", len(job.hashes), e)
            except Exception:
                log.exception("saving %d blocks to G2 failed", len(job.hashes))
            finally:
                self.copy_s += time.perf_counter() - t0
                with self._cond:
                    self._queued.remove(job)
                    self._in_flight.difference_update(job.hashes)
                    self._pending.subtract(set(job.request_ids))
                    for rid in set(job.request_ids):
                        if self._pending[rid] <= 0:
                            del self._pending[rid]
                    self.jobs_done += 1
                    self._cond.notify_all()

    def _scratch_bytes(self, nbytes: int) -> np.ndarray:
        """The copy thread's gather buffer, at least ``nbytes`` (grown to twice what it was, faulted in)."""
        if self._scratch is None or self._scratch.size < nbytes:
            grown = max(nbytes, 2 * (0 if self._scratch is None else self._scratch.size))
            self._scratch = huge_page_buffer(grown)
            populate(self._scratch.ctypes.data, grown)
        return self._scratch[:nbytes]

    def _copy(self, job: SaveJob) -> None:
        # No torch op on host tensors in this thread: each would start an OpenMP team whose spinning
        # threads take the cores from vLLM's forward. numpy copies and C++ extent copies instead.
        size = self._kv.block_bytes
        if job.from_slots is not None:  # host to host, within the pool: the landing slots are the source
            assert self._pool_bytes is not None
            self._pool.store(job.hashes, [self._pool_bytes[b * size:(b + 1) * size] for b in job.from_slots])
            self.blocks_saved += len(job.hashes)
            return
        data: Any
        if self._cuda:
            assert self._stream is not None
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(job.ready)
                data = list(self._kv.gather(job.block_ids, pin_memory=True))
            self._stream.synchronize()  # this thread waits; the engine's stream never does
        else:
            scratch = self._scratch_bytes(len(job.block_ids) * size)
            if self._kv.gather_into(job.block_ids, scratch):
                data = [scratch[i * size:(i + 1) * size] for i in range(len(job.block_ids))]
            else:
                data = list(self._kv.gather(job.block_ids))
        if self._copy_hook is not None:
            self._copy_hook(job)
        with self._cond:  # drop() sets it before vLLM reuses the blocks: a gather done before that is whole
            if job.dropped:
                log.warning("not saving %d blocks: vLLM reused them while they were copied", len(job.hashes))
                return
        self._pool.store(job.hashes, data)
        self.blocks_saved += len(job.hashes)
