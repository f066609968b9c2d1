"""Rank 0 of the transfer benchmark's target worker: the sequence of requests and commands it measures.

:class:`Driver` runs the first contact, the ``full`` and ``one`` series (rounds of an end-to-end request, a raw
READ and a memcpy, order alternating) and the sustained streams, checking the bytes where ``target_rank``'s
docstring says; each measurement is a dict of ``time.monotonic()`` instants and seconds, gathered by
``target_rank.main`` into ``result.json``. Commands reach every rank through :meth:`Driver.broadcast` (command
files and doorbells, ``target_commands``); ``--raw-window`` measurements run inside :meth:`Driver.raw_window`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.transfer.transfer_procs.common import hash_of, read_json, record, write_json
from bench.transfer.transfer_procs.target_commands import Abort, Bell, Rank, bell_path

CMD_TIMEOUT_S = 60.0


class Driver:
    """Rank 0: the sequence of requests and commands; everything it measures goes to ``result``."""

    def __init__(self, r: Rank, d: Path) -> None:
        self.r, self.d, self.seq, self.req = r, d, 0, 0
        self.windows = 0
        self.bell = Bell(bell_path(d, 0))
        self.kib = r.args.block_kib
        self.poll_s = r.args.poll_us / 1e6
        self.stream_poll_s = r.args.stream_poll_us / 1e6

    def broadcast(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        """Run ``cmd`` on every rank (this one included); every rank's answer, by rank."""
        write_json(self.d / f"cmd-{self.seq}.json", cmd)
        for rank in range(1, self.r.tp):
            Bell.ring(bell_path(self.d, rank))
        try:
            mine = {"ok": True, **self.r.execute(cmd)}
        except Abort as e:
            mine = {"ok": False, "error": str(e)}
        out = [mine]
        deadline = time.monotonic() + CMD_TIMEOUT_S
        for rank in range(1, self.r.tp):
            path = self.d / f"ack-{self.seq}-{rank}.json"
            while not path.exists():
                if time.monotonic() > deadline:
                    raise Abort(f"rank {rank} did not answer {cmd['op']} in {CMD_TIMEOUT_S} s")
                self.bell.wait(0.05)
            out.append(read_json(path))
        self.seq += 1
        bad = [f"rank {i}: {a.get('error') or a}" for i, a in enumerate(out) if not a.get("ok", True)]
        if bad:
            raise Abort(f"{cmd['op']} failed: " + "; ".join(bad))
        return out

    def e2e(self, n: int, kind: str, rep: int) -> dict[str, Any]:
        client = self.r.client
        hashes = [hash_of(self.kib, i) for i in range(n)]
        self.req += 1
        req = f"req-{self.req}"
        t0 = time.monotonic()
        m = client.lookup(hashes)
        t_lookup = time.monotonic()
        if m.matched != n:
            raise Abort(f"lookup of {n} hashes matched {m.matched} ({m.reason})")
        client.start_load(req, hashes, list(range(n)))
        t_started = time.monotonic()
        while True:
            done, failed = client.get_finished()
            if req in done:
                break
            if req in failed:
                bad = sorted(client.invalid_block_ids())[:8]
                raise Abort(f"{req} failed (see the rank logs); invalid blocks {bad}")
            if time.monotonic() - t0 > 30:
                raise Abort(f"{req} did not finish in 30 s")
            if self.poll_s > 0:
                time.sleep(self.poll_s)
            else:  # block until an outcome is posted: no polling thread taking the CPUs the READs copy with
                client.wait_finished(0.1)
        t_end = time.monotonic()
        invalid = client.invalid_block_ids()
        if invalid:
            raise Abort(f"{req} done but blocks {sorted(invalid)[:8]} are invalid")
        record("e2e", t0, t_end, [kind, rep])
        return {"t0": t0, "t_lookup": t_lookup, "t_started": t_started, "t_end": t_end, "s": t_end - t0}

    def stream(self, n: int, count: int, depth: int) -> dict[str, Any]:
        """``count`` requests of ``n`` blocks, at most ``depth`` in flight; request i lands in copy ``i % depth``.

        Each request is ``lookup -> start_load`` as soon as a slot is free; the
        loop polls ``get_finished`` every ``--stream-poll-us``, like an engine
        calling it once per step (a fast one: real steps take several ms).
        """
        client = self.r.client
        hashes = [hash_of(self.kib, i) for i in range(n)]
        free = list(range(depth))
        open_: dict[str, int] = {}  # request id -> destination copy
        issued = 0
        t0 = time.monotonic()
        while issued < count or open_:
            while issued < count and free:
                copy = free.pop(0)
                self.req += 1
                req = f"req-{self.req}"
                m = client.lookup(hashes)
                if m.matched != n:
                    raise Abort(f"stream: lookup of {n} hashes matched {m.matched} ({m.reason})")
                client.start_load(req, hashes, list(range(copy * n, (copy + 1) * n)))
                open_[req] = copy
                issued += 1
            done, failed = client.get_finished()
            if failed & open_.keys():
                bad = sorted(client.invalid_block_ids())[:8]
                raise Abort(f"stream: {sorted(failed & open_.keys())} failed; invalid blocks {bad}")
            for req in done & open_.keys():
                free.append(open_.pop(req))
            if time.monotonic() - t0 > 60:
                raise Abort(f"stream of {count} requests did not finish in 60 s")
            if open_ and not (done & open_.keys()):
                time.sleep(self.stream_poll_s)
        t_end = time.monotonic()
        invalid = client.invalid_block_ids()
        if invalid:
            raise Abort(f"stream done but blocks {sorted(invalid)[:8]} are invalid")
        record("stream", t0, t_end, [count, depth])
        return {"t0": t0, "t_end": t_end, "s": t_end - t0}

    def stream_series(self, n: int, count: int, depth: int, rounds: int) -> dict[str, Any]:
        """Alternating rounds of an e2e stream and a raw stream of the same requests; the last is checked."""
        per_rank = n * self.r.bb
        out: dict[str, Any] = {"blocks": n, "bytes": per_rank * self.r.tp * count, "requests": count,
                               "depth": depth, "e2e": [], "raw": []}
        for rnd in range(rounds):
            last = rnd == rounds - 1
            for step in (["e2e", "raw"] if rnd % 2 == 0 else ["raw", "e2e"]):
                if step == "e2e":
                    if last:
                        self.broadcast({"op": "zero", "n": n, "copies": depth})
                    out["e2e"].append(self.stream(n, count, depth))
                    if last:
                        self.check_copies(n, depth, f"the last stream of {count} requests")
                else:
                    with self.raw_window():
                        t0 = time.monotonic() + 0.02
                        acks = self.broadcast({"op": "raw_stream", "nbytes": per_rank, "t0": t0, "count": count,
                                               "depth": depth})
                    out["raw"].append({"t0": t0, "s": max(a["t_end"] for a in acks) - t0})
        return out

    @contextlib.contextmanager
    def raw_window(self) -> Iterator[None]:
        """With ``--raw-window``: the source ranks drive their bare agents fast until the block ends (each rank
        acknowledges both ends, so no end-to-end request ever runs beside a fast-driven agent)."""
        if not self.r.args.raw_window:
            yield
            return
        src = self.r.args.source_dir
        self.windows += 1
        flag = src / "raw-progress"

        def acked(text: str) -> None:
            deadline = time.monotonic() + 10
            for rank in range(self.r.tp):
                path = src / f"raw-progress-ack-{rank}"
                while True:
                    try:
                        if read_json(path) == text:
                            break
                    except (OSError, ValueError):
                        pass
                    if time.monotonic() > deadline:
                        raise Abort(f"source rank {rank} did not acknowledge raw window {text!r} in 10 s")
                    time.sleep(0.001)

        tmp = src / "raw-progress.tmp"
        tmp.write_text(str(self.windows))
        os.replace(tmp, flag)
        try:
            acked(f"on {self.windows}")
            yield
        finally:
            flag.unlink()
        acked(f"off {self.windows}")

    def check_copies(self, n: int, copies: int, what: str) -> None:
        acks = self.broadcast({"op": "check", "n": n, "copies": copies})
        bad = {rank: a for rank, a in enumerate(acks) if not a["bytes_ok"]}
        if bad:
            raise Abort(f"WRONG BYTES after {what}: " + "; ".join(
                f"rank {rank}: {a['num_bad']} bad block(s) (copy * n + block), first {a['bad_blocks']}"
                for rank, a in bad.items()))

    def synced(self, op: str, nbytes: int) -> dict[str, Any]:
        t0 = time.monotonic() + 0.02
        acks = self.broadcast({"op": op, "nbytes": nbytes, "t0": t0})
        return {"t0": t0, "s": max(a["t_end"] for a in acks) - t0,
                "rank_s": [a["t_end"] - a["t_start"] for a in acks],
                "start_late_s": [a["t_start"] - t0 for a in acks],
                "post_s": [a["t_post"] - a["t_start"] for a in acks if "t_post" in a],
                "descriptors": [a["descriptors"] for a in acks if "descriptors" in a]}

    def raw(self, per_rank: int) -> dict[str, Any]:
        with self.raw_window():
            return self.synced("raw", per_rank)

    def check(self, n: int, what: str) -> None:
        self.check_copies(n, 1, what)

    def first_contact(self) -> dict[str, Any]:
        """The target's first request: 1 block from a source it never talked to (metadata, connections), checked."""
        self.broadcast({"op": "zero", "n": 1})
        out = self.e2e(1, "first", -1)
        self.check(1, "the first contact")
        return out

    def series(self, n: int, kind: str, reps: int, with_memcpy: bool) -> dict[str, Any]:
        bb = self.r.bb
        per_rank = n * bb
        out: dict[str, Any] = {"blocks": n, "bytes": per_rank * self.r.tp, "e2e": [], "raw": [], "memcpy": []}
        # warm-up: the first request of this size (checked), the raw agent's first READ (zeroed, checked)
        self.broadcast({"op": "zero", "n": n})
        out["warmup_e2e"] = self.e2e(n, kind, -1)
        self.check(n, f"the first {kind} request")
        self.broadcast({"op": "zero", "n": n})
        out["warmup_raw"] = self.raw(per_rank)
        self.check(n, f"the first raw {kind} READ")
        if with_memcpy:
            self.synced("memcpy", per_rank)
        for rep in range(reps):
            last = rep == reps - 1
            steps = ["e2e", "raw", "memcpy"] if rep % 2 == 0 else ["raw", "memcpy", "e2e"]
            for step in steps:
                if step == "e2e":
                    if last:
                        self.broadcast({"op": "zero", "n": n})
                    out["e2e"].append(self.e2e(n, kind, rep))
                    if last:
                        self.check(n, f"the last {kind} request")
                elif step == "raw":
                    out["raw"].append(self.raw(per_rank))
                elif with_memcpy:
                    out["memcpy"].append(self.synced("memcpy", per_rank))
        return out
