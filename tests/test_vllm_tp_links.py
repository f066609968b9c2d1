"""The vLLM connector's TP ranks agreeing over local links (adapters/vllm/tp_links.py): real sockets, real gloo.

No vLLM needed: the ranks are processes joined by a real ``torch.distributed`` gloo group, as vLLM's CPU TP
group is, and the links are real Unix stream sockets.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from remote_g2.adapters.vllm.tp_links import StepLinks, TpStep, connect_step_links
from remote_g2.adapters.vllm.tp_sync import FetchOutcome, TpSync
from remote_g2.errors import LinkClosed, ProtocolError, TransportError
from remote_g2.rpc.local_link import MessageLink


def _pair(timeout_s: float = 5.0) -> tuple[StepLinks, StepLinks, socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    leader = StepLinks(0, 2, {1: MessageLink(a, "rank 1")}, timeout_s=timeout_s)
    other = StepLinks(1, 2, {0: MessageLink(b, "the leader")}, timeout_s=timeout_s)
    return leader, other, a, b


def _in_thread(fn, *args):
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed back to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_gather_and_ands_every_ranks_bits_and_carries_the_leaders_clock() -> None:
    leader, other, _, _ = _pair()
    t, out = _in_thread(other.gather_and, bytes([1, 1, 0, 1]))
    before = time.monotonic()
    clock, both = leader.gather_and(bytes([1, 0, 0, 1]))
    t.join(5)
    assert both == bytes([1, 0, 0, 1]) and before <= clock <= time.monotonic()
    assert out["value"] == (clock, both)


def test_broadcast_hands_the_leaders_outcome_to_every_rank_in_order() -> None:
    leader, other, _, _ = _pair()
    outcomes = [{"done": ["req-1"], "failed": [], "invalid": [], "expired": False},
                {"done": [], "failed": ["req-2", "req-3"], "invalid": [5, 7, 2**40], "expired": True}]
    got = []
    t, out = _in_thread(lambda: [other.broadcast(None) for _ in outcomes])
    for o in outcomes:
        got.append(leader.broadcast(o))
    t.join(5)
    assert out["value"] == got
    assert [g[1] for g in got] == outcomes


def test_a_frame_out_of_sequence_or_of_the_wrong_shape_is_a_protocol_error() -> None:
    for bad in (TpStep(2, "held", held=b"\x01\x01"),  # seq 2 where 1 is due
                TpStep(1, "outcome"),  # the wrong kind
                TpStep(1, "held", held=b"\x01"),  # the wrong length
                TpStep(1, "held", held=b"\x01\x02")):  # not a bit
        leader, _, a, b = _pair()
        MessageLink(b, "x").send(bad)
        with pytest.raises(ProtocolError):
            leader.gather_and(b"\x01\x01")


def test_garbage_on_the_socket_is_a_protocol_error_and_closes_the_link() -> None:
    leader, _, _, b = _pair()
    b.sendall(b"\x00\x00\x00\x08notmsgpk")
    with pytest.raises(ProtocolError):
        leader.gather_and(b"\x01")


def test_a_rank_that_closes_its_end_is_noticed_at_once_and_a_silent_one_after_the_timeout() -> None:
    leader, _, _, b = _pair()
    b.close()
    t0 = time.monotonic()
    with pytest.raises(LinkClosed):
        leader.gather_and(b"\x01")
    assert time.monotonic() - t0 < 1.0
    leader, _, _, _ = _pair(timeout_s=0.2)
    with pytest.raises(TransportError, match="sent nothing"):
        leader.gather_and(b"\x01")


# -- real processes, a real gloo group -------------------------------------------------------------------


def _rank_main(rank: int, size: int, port: int, ipc_dir: str, other_host: bool, q) -> None:
    import torch.distributed as dist

    from remote_g2.adapters.vllm import tp_links
    from remote_g2.tp.torch_group import TorchGroupComm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        if other_host and rank == size - 1:
            tp_links.boot_id = lambda: "another-host"  # this rank stands for one on another machine
        comm = TorchGroupComm()
        links = connect_step_links(comm, "w-links", ipc_dir)
        via_links, via_gloo = TpSync(comm, links), TpSync(comm)
        rng = random.Random(rank)
        results = []
        for step in range(20):
            held = [rng.random() < 0.8 for _ in range(64)]
            outcome = FetchOutcome({f"r{step}"}, {f"f{step}"} if step % 3 == 0 else set(), {step, 2 * step},
                                   expired=step == 7) if rank == 0 else None
            a, b = via_links.held_everywhere(held), via_gloo.held_everywhere(held)
            c, d = via_links.leader_outcome(outcome), via_gloo.leader_outcome(outcome)
            results.append((a == b, c == d, via_links.now(), a.count(True)))
        sock_left = os.listdir(ipc_dir) if os.path.isdir(ipc_dir) else []
        q.put((rank, links is not None, results, sock_left))
        via_links.close()
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path: Path, size: int, other_host: bool) -> dict[int, tuple]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ipc_dir = str(tmp_path / "ipc")
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, ipc_dir, other_host, q)) for r in range(size)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(size):
            rank, *rest = q.get(timeout=120)
            got[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return got


def test_three_ranks_agree_over_links_exactly_as_over_gloo(tmp_path: Path) -> None:
    got = _run_ranks(tmp_path, 3, other_host=False)
    for rank, (linked, results, sock_left) in got.items():
        assert linked, f"rank {rank} fell back to gloo"
        assert all(same_held and same_outcome for same_held, same_outcome, _, _ in results)
        assert sock_left == []  # the listener's socket file goes once every rank connected
    # every rank saw the same clock (rank 0's) and the same agreed counts, step by step
    for step in range(20):
        assert len({got[r][1][step][2:] for r in got}) == 1
    assert any(results[3] < 64 for results in got[0][1])  # some bits were ANDed away


def test_a_rank_on_another_host_leaves_every_rank_on_gloo(tmp_path: Path) -> None:
    got = _run_ranks(tmp_path, 2, other_host=True)
    assert [got[r][0] for r in sorted(got)] == [False, False]
    assert all(a and b for _, (linked, results, _) in got.items() for a, b, _, _ in results)
