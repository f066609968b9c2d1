"""What each engine holds in its own cache tiers, from its KV events: for scoring, never for reads.

The registry's store keeps what remote-g2 can read: blocks a worker's source
published into its G2. A router also wants what an engine can reuse itself:
its device cache (G1), and the host tier of a vLLM without the connector.
vLLM's KV events say so (``serve --vllm-kv-events``), and
:class:`EngineCaches` keeps them, per worker id and tier, in this server's
memory:

* **Tiers.** ``g1`` is the medium ``GPU`` (vLLM's CPU backend reports its
  cache as ``GPU`` too), ``g2`` the host medium ``CPU``. Any other medium is
  its name in lower case (``disk``).
* **Hashes in either form.** vLLM's default event hash is its 64-bit int:
  the low 64 bits of its block hash, kept here as 8 big-endian bytes. A
  prompt's 32-byte hashes are compared by their last 8 bytes against such an
  engine. Two different prefixes collide there with odds of about
  ``n / 2**64`` per block compared (n blocks the engine holds): at a million
  blocks, under one in 10^13. That is good enough to route by. It would not
  be good enough to read by, and nothing read ever comes from here.
* **The hash space is learned, never guessed.** Events do not name the
  engine's algorithm or seed. A BlockStored that starts a chain (no parent,
  no LoRA) carries its token ids. Its first block is hashed here with each
  algorithm and each configured seed (vLLM's default among them), and the
  one that gives the engine's own hash is that engine's. Until one matches,
  the engine cannot be scored by token ids, and the answer says why.
* **One unit per block, one group.** vLLM with several KV-cache groups
  (hybrid models) publishes each group's blocks, of their own sizes, some
  hashed finer than the block. Their prefix hits do not follow one chain of
  blocks, so an engine whose events name more than one group or block size
  is listed as unscored (:meth:`EngineCaches.unscorable`), never matched.
* **One bad event costs itself.** An event that cannot be applied is
  refused on its own (counted: :meth:`EngineCaches.apply` answers how many),
  and the rest of its batch is applied.
* **What is dropped.** A publisher that restarted (its sequence went back)
  or whose events cleared everything starts empty. So does one the
  subscriber stopped following (``clear``). At most ``max_blocks`` hashes
  are kept per engine, a million by default: about 100 MB at most, while a
  GPU's cache holds tens of thousands of blocks. Past that, new ones are
  counted in ``dropped`` and not kept, which can only shorten a match.

Thread-safe: the subscriber's thread writes, the scoring thread reads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from remote_g2.identity.vllm_hashing import ALGORITHMS, DEFAULT_SEED, MAX_BLOCK_SIZE, VllmBlockHasher

from .vllm_event_decode import EngineEvent

__all__ = ["EngineCaches", "tier_of"]

log = logging.getLogger("remote_g2.registry.scoring.engine_caches")

_MEDIUM_TIERS = {"GPU": "g1", "DEVICE": "g1", "CPU": "g2", "CPU_PINNED": "g2", "CPU_TIER1": "g2"}
_LEARN_TRIES = 256  # chain-starting events tried before an engine's hash space is given up on (salts, seeds)


def tier_of(medium: str | None) -> str:
    """The tier a vLLM event medium names (None: the device, as vLLM's default medium)."""
    if medium is None:
        return "g1"
    return _MEDIUM_TIERS.get(medium.upper(), medium.lower()[:16])


@dataclass(eq=False)
class _Engine:
    tiers: dict[str, set[bytes]] = field(default_factory=dict)
    short: bool | None = None        # its hashes are vLLM's 64-bit int form (8 bytes)
    block_size: int | None = None
    sizes: set[int] = field(default_factory=set)  # block sizes its BlockStored events stated
    groups: set[int] = field(default_factory=set)  # KV-cache groups its events named
    hasher: VllmBlockHasher | None = None
    tries: int = 0
    held: int = 0
    dropped: int = 0


class EngineCaches:
    """Per worker id, the hashes each engine tier holds (see the module docstring)."""

    def __init__(self, seeds: Iterable[str] = (DEFAULT_SEED,), *, max_blocks: int = 1_000_000) -> None:
        self.seeds = tuple(dict.fromkeys([DEFAULT_SEED, *seeds]))
        self.max_blocks = max_blocks
        self._engines: dict[str, _Engine] = {}
        self._lock = threading.Lock()
        self._hashers: dict[tuple[str, str, int], VllmBlockHasher] = {}

    def apply(self, worker_id: str, events: Sequence[EngineEvent]) -> int:
        """Apply one batch of ``worker_id``'s events, in order; answers how many were refused (each on its own:
        one that cannot be applied leaves the others applied, and is logged)."""
        refused = 0
        with self._lock:
            e = self._engines.setdefault(worker_id, _Engine())
            for ev in events:
                try:
                    self._apply_one(e, ev)
                except Exception:  # a bug or an event nobody foresaw: it alone is lost, not the batch
                    refused += 1
                    log.exception("KV event of %s refused: %.200r", worker_id, ev)
        return refused

    def _apply_one(self, e: _Engine, ev: EngineEvent) -> None:
        if ev.kind == "cleared":
            e.tiers.clear()
            e.held = 0
            return
        if ev.group is not None and len(e.groups) < 64:
            e.groups.add(ev.group)
        if ev.hashes:
            e.short = len(ev.hashes[0]) == 8
        tier = e.tiers.setdefault(tier_of(ev.medium), set())
        if ev.kind == "removed":
            before = len(tier)
            tier.difference_update(ev.hashes)
            e.held -= before - len(tier)
            return
        if ev.block_size:
            e.block_size = ev.block_size
            if len(e.sizes) < 64:
                e.sizes.add(ev.block_size)
        room = self.max_blocks - e.held
        new = ev.hashes if len(ev.hashes) <= room else ev.hashes[:max(room, 0)]
        e.dropped += len(ev.hashes) - len(new)
        before = len(tier)
        tier.update(new)
        e.held += len(tier) - before
        if e.hasher is None and e.tries < _LEARN_TRIES:
            self._learn(e, ev)

    def _learn(self, e: _Engine, ev: EngineEvent) -> None:
        """Try ``ev`` (a chain's first blocks, no LoRA) against every algorithm and seed."""
        bs = ev.block_size or e.block_size
        if ev.parent is not None or ev.lora_id is not None or not ev.token_ids or not bs or not ev.hashes \
                or len(ev.token_ids) < bs or bs > MAX_BLOCK_SIZE:
            return
        e.tries += 1
        theirs = ev.hashes[0]
        for algo in ALGORITHMS:
            for seed in self.seeds:
                key = (algo, seed, bs)
                hasher = self._hashers.get(key)
                if hasher is None:
                    hasher = self._hashers[key] = VllmBlockHasher(algo, seed, bs)
                first = hasher.hashes(ev.token_ids[:bs])[0]
                if first == theirs or (len(theirs) == 8 and first[-8:] == theirs):
                    e.hasher = hasher
                    return

    def clear(self, worker_id: str) -> None:
        """Forget ``worker_id`` (its stream is gone)."""
        with self._lock:
            self._engines.pop(worker_id, None)

    def hasher(self, worker_id: str) -> tuple[VllmBlockHasher | None, str]:
        """The hash space learned from ``worker_id``'s events, or None and why not."""
        with self._lock:
            e = self._engines.get(worker_id)
            if e is None:
                return None, "this server follows no KV events of it"
            if e.hasher is not None:
                return e.hasher, ""
            if e.tries >= _LEARN_TRIES:
                return None, (f"none of its {e.tries} chain-starting KV events matched vLLM's sha256 or sha256_cbor "
                              "with a configured seed (give its PYTHONHASHSEED to --score-hash-seed)")
            return None, "its KV events have not yet shown a chain's first block to learn its hash space from"

    def unscorable(self, worker_id: str) -> tuple[str, str] | None:
        """``(reason, message)``: why ``worker_id``'s cache cannot be matched against one chain of blocks (None: it
        can, or is unknown). Reasons: ``kv_cache_groups``, ``block_too_large``.

        Several KV-cache groups, or blocks of several sizes (vLLM publishes
        each group's blocks, and partial ones where hits land inside a block):
        which prefix it would reuse is not one chain's match. Blocks over
        :data:`~remote_g2.identity.vllm_hashing.MAX_BLOCK_SIZE` tokens are not hashed here.
        """
        with self._lock:
            e = self._engines.get(worker_id)
            if e is None:
                return None
            if len(e.groups) > 1 or len(e.sizes) > 1:
                return "kv_cache_groups", (f"its KV events name KV-cache groups {sorted(e.groups)[:8]} and block "
                        f"sizes {sorted(e.sizes)[:8]}: its prefix hits do not follow one chain of blocks, which is what is "
                        "scored here")
            if e.block_size is not None and e.block_size > MAX_BLOCK_SIZE:
                return "block_too_large", f"its blocks of {e.block_size} tokens are over the {MAX_BLOCK_SIZE} " \
                                          "hashed here"
            return None

    def block_size(self, worker_id: str) -> int | None:
        """The block size ``worker_id``'s events stated (None: none yet)."""
        with self._lock:
            e = self._engines.get(worker_id)
            return None if e is None else e.block_size

    def matched(self, worker_id: str, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per tier, how many of ``hashes`` (32-byte, from block 0) the engine holds without a gap."""
        with self._lock:
            e = self._engines.get(worker_id)
            if e is None:
                return {}
            short, out = e.short, {}
            for name, held in e.tiers.items():
                n = 0
                for h in hashes:  # (an int-form engine's key is the hash's last 8 bytes: sliced only as far as held)
                    if (h[-8:] if short else h) not in held:
                        break
                    n += 1
                out[name] = n
            return out

    def stats(self, worker_id: str) -> dict[str, int] | None:
        """Blocks held per tier, and dropped (None: unknown worker)."""
        with self._lock:
            e = self._engines.get(worker_id)
            if e is None:
                return None
            return {**{t: len(h) for t, h in e.tiers.items()}, "dropped": e.dropped}
