"""Remote reads in flight, by block hash, so requests that need the same blocks share one READ of them.

vLLM may schedule several requests sharing a prefix in one step, each asking
the connector for the same remote blocks (vLLM's own prefix cache learns of
them only once a load ends). :class:`FetchTable` makes each block travel
once:

* a :class:`Fetch` is one target-client load: some hashes read into landing
  slots;
* a :class:`RequestLoad` is what one request waits for: per block, the fetch
  bringing it (``None`` for a block already copied in from this worker's own
  G2);
* a request is *ready* when every fetch it waits on has ended; its usable
  blocks are the leading ones that arrived (vLLM recomputes from the first
  one that did not);
* a fetch's landing slots go back only when the last request waiting on it
  has copied its blocks out.

Aborted requests (vLLM finished them while their load ran) stay in the table
until their fetches end, flagged so nothing is copied into their blocks:
vLLM keeps those blocks allocated until the connector reports the request
as received, and that report comes only after the fetch ended.

Not thread-safe: the worker's model-runner thread owns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Fetch", "RequestLoad", "FetchTable"]


@dataclass(eq=False)
class Fetch:
    """One read of ``hashes`` into landing ``slots``; ``good`` = leading blocks that arrived, once it ended."""

    fetch_id: str
    hashes: list[bytes]
    slots: list[int]
    waiters: int = 0
    good: int | None = None
    failed: bool = False
    keep: Any = None  # the saver's job keeping its good blocks in G2 (None: none, or G2 held them all already)
    kept_step: int | None = None  # the worker's step that handed ``keep`` to the saver (None: not yet)

    @property
    def ended(self) -> bool:
        return self.good is not None


@dataclass(eq=False)
class RequestLoad:
    """One request's remote blocks: vLLM block ``block_ids[i]`` gets ``hashes[i]`` from ``parts[i]``."""

    request_id: str
    hashes: list[bytes]
    block_ids: list[int]
    parts: list[tuple[Fetch | None, int]] = field(default_factory=list)
    aborted: bool = False

    def ready(self) -> bool:
        return all(f is None or f.ended for f, _ in self.parts)

    def good_blocks(self) -> int:
        """Leading blocks whose data is here (call once :meth:`ready`)."""
        n = 0
        for f, i in self.parts:
            if f is not None and (f.good is None or i >= f.good):
                break
            n += 1
        return n

    def fetches(self) -> list[Fetch]:
        """The distinct fetches this request waits on."""
        return list({id(f): f for f, _ in self.parts if f is not None}.values())


class FetchTable:
    """The worker's fetches and the requests waiting on them."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, tuple[Fetch, int]] = {}
        self._fetches: dict[str, Fetch] = {}
        self._loads: dict[str, RequestLoad] = {}

    def in_flight(self, h: bytes) -> bool:
        return h in self._by_hash

    def add(self, request_id: str, hashes: Sequence[bytes], block_ids: Sequence[int], *, local: Sequence[bool],
            new_slots: Sequence[int]) -> tuple[RequestLoad, Fetch | None]:
        """Register a request's load; ``local[i]``: block i is already here. Returns it and its new fetch, if any.

        Every block that is neither local nor in flight goes into one new
        fetch (id ``request_id``) reading into ``new_slots``, in order; the
        caller counts them first with :meth:`to_fetch` and starts that fetch.
        """
        if request_id in self._fetches or request_id in self._loads:
            raise ValueError(f"a load for {request_id!r} is already in flight")
        load = RequestLoad(request_id, list(hashes), list(block_ids))
        fetch = Fetch(request_id, [], [])
        for h, here in zip(hashes, local):
            if here:
                load.parts.append((None, 0))
                continue
            if h not in self._by_hash:
                self._by_hash[h] = (fetch, len(fetch.hashes))
                fetch.hashes.append(h)
            load.parts.append(self._by_hash[h])
        if len(fetch.hashes) != len(new_slots):
            for h in fetch.hashes:
                del self._by_hash[h]
            raise ValueError(f"{request_id}: {len(fetch.hashes)} blocks to fetch, {len(new_slots)} slots given")
        fetch.slots = list(new_slots)
        if fetch.hashes:
            self._fetches[request_id] = fetch
        for f in load.fetches():
            f.waiters += 1
        self._loads[request_id] = load
        return load, (fetch if fetch.hashes else None)

    def to_fetch(self, hashes: Sequence[bytes], local: Sequence[bool]) -> int:
        """How many of ``hashes`` a new load would read (neither local nor in flight): the slots it needs."""
        return len({h for h, here in zip(hashes, local) if not here and h not in self._by_hash})

    def fetch(self, fetch_id: str) -> Fetch | None:
        return self._fetches.get(fetch_id)

    def load(self, request_id: str) -> RequestLoad | None:
        return self._loads.get(request_id)

    def abort(self, request_id: str) -> bool:
        """Flag a waiting request as finished by vLLM: nothing will be copied into its blocks."""
        load = self._loads.get(request_id)
        if load is None:
            return False
        load.aborted = True
        return True

    def ended(self, fetch_id: str, good: int, failed: bool) -> list[RequestLoad]:
        """Fetch ``fetch_id`` ended with ``good`` leading blocks; the requests that are now ready."""
        fetch = self._fetches.pop(fetch_id)
        fetch.good, fetch.failed = good, failed
        for h in fetch.hashes:
            if self._by_hash.get(h, (None, 0))[0] is fetch:
                del self._by_hash[h]
        return [ld for ld in self._loads.values() if fetch in ld.fetches() and ld.ready()]

    def ready_now(self) -> list[RequestLoad]:
        """Requests waiting on no fetch at all (every block was local)."""
        return [ld for ld in self._loads.values() if not ld.fetches()]

    def done(self, load: RequestLoad) -> list[Fetch]:
        """``load``'s blocks were copied out (or dropped): forget it; the fetches no request waits on any more."""
        del self._loads[load.request_id]
        freed = []
        for f in load.fetches():
            f.waiters -= 1
            if f.waiters == 0:
                freed.append(f)
        return freed

    def __len__(self) -> int:
        return len(self._loads)
