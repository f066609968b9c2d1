"""The vLLM connector's TP agreement (adapters/vllm/tp_sync.py) between two real processes in a gloo group.

No vLLM needed: :class:`TpSync` only uses the TP group's communicator, here
:class:`~remote_g2.tp.torch_group.TorchGroupComm` over a real ``torch.distributed``
gloo group of two spawned processes, as vLLM's CPU TP group would be.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

torch_dist = pytest.importorskip("torch.distributed")


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from remote_g2.adapters.landing_slots import LandingSlots
    from remote_g2.adapters.vllm.tp_sync import FetchOutcome, TpSync
    from remote_g2.tp.torch_group import TorchGroupComm

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    sync = TpSync(TorchGroupComm())
    res: dict = {"rank": sync.rank, "size": sync.size}
    # Rank 0 holds blocks 0, 1, 3; rank 1 holds 0, 3 (it evicted 1): only 0 and 3 are held everywhere.
    res["held"] = sync.held_everywhere([True, True, False, True] if rank == 0 else [True, False, False, True])
    mine = FetchOutcome({"r1"}, {"r2"}, {5, 6}) if rank == 0 else FetchOutcome({"ignored"})
    got = sync.leader_outcome(mine)
    res["outcome"] = got.to_wire()
    # The landing slots' clock is rank 0's: rank 1 sleeps first, so its own clock would run ahead.
    if rank == 1:
        time.sleep(0.3)
    slots = LandingSlots(range(4), quarantine_s=0.0, clock=sync.now)
    sync.held_everywhere([])
    res["now"] = sync.now()
    slots.quarantine(slots.take(2))
    res["available"] = slots.available()
    try:
        sync.held_everywhere([True] * (2 if rank == 0 else 1))
        res["mismatch"] = None
    except RuntimeError as e:
        res["mismatch"] = str(e)
    Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def test_two_ranks_agree_on_held_blocks_fetch_outcomes_and_the_clock(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, init, str(tmp_path / f"r{r}.json"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2))
    assert (r0["rank"], r1["rank"], r0["size"]) == (0, 1, 2)
    assert r0["held"] == r1["held"] == [True, False, False, True]
    assert r0["outcome"] == r1["outcome"] == {"done": ["r1"], "failed": ["r2"], "invalid": [5, 6],
                                                 "expired": False}
    assert r0["now"] == r1["now"]  # one clock for both ranks' landing slots
    assert r0["available"] == r1["available"]
    assert "different block counts" in r0["mismatch"] and "different block counts" in r1["mismatch"]


def test_a_group_of_one_exchanges_nothing() -> None:
    from remote_g2.adapters.vllm.tp_sync import FetchOutcome, TpSync

    sync = TpSync()
    assert (sync.rank, sync.size) == (0, 1)
    assert sync.held_everywhere([True, False]) == [True, False]
    out = FetchOutcome({"a"}, set(), {1})
    assert sync.leader_outcome(out) is out
    before = time.monotonic()
    assert sync.now() >= before  # the local clock, live
