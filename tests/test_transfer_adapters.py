"""The transfer adapters: ``memcpy`` within one process, ``nixl`` with real NIXL agents in two processes.

The NIXL cases start ``source_procs/nixl_source_peer.py`` (its own agent, a
buffer of known pseudo-random bytes) and READ from it with
:class:`NixlTransfer`; every wait has a deadline and every peer is stopped
by its PID. Teardown releases handles and closes the adapter before the peer
is stopped, the order NIXL survives.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from source_procs.nixl_source_peer import PeerProcess, pattern_bytes

from remote_g2.adapters.memcpy_transfer import MemcpyTransfer
from remote_g2.plugins import load_adapter
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.transfer import TransferAdapter
from remote_g2.errors import TransferError

U64 = np.uint64


def extents(rows: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local, remote, nbytes) uint64 arrays from (local, remote, nbytes) rows."""
    a = np.array(rows, dtype=U64).reshape(-1, 3)
    return a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy()


def expected(dst_len: int, src: np.ndarray, rows: list[tuple[int, int, int]]) -> np.ndarray:
    """What a zeroed destination holds after copying ``rows`` (offsets) out of ``src``."""
    out = np.zeros(dst_len, dtype=np.uint8)
    for lo, ro, n in rows:
        out[lo:lo + n] = src[ro:ro + n]
    return out


# Offsets (local, remote, nbytes): coalesced multi-block runs, odd offsets and lengths, a lone byte.
BLOCK = 4096
ROWS = [
    (0, 8 * BLOCK, 4 * BLOCK),                 # four 4 KiB blocks coalesced
    (4 * BLOCK, 0, BLOCK),                     # one block, from the start of the source
    (5 * BLOCK + 3, 3, 17),                    # odd offsets on both sides
    (6 * BLOCK + 1, 20 * BLOCK + 4095, 1),     # a single byte at a block's last offset
    (7 * BLOCK, 40 * BLOCK, 16 * BLOCK + 5),   # 16 blocks and a bit
    (30 * BLOCK + 7, 13 * BLOCK + 1, 3 * BLOCK - 9),
]


# --- memcpy -----------------------------------------------------------------


@pytest.fixture
def memcpy_pair() -> Iterator[tuple[MemcpyTransfer, np.ndarray, np.ndarray]]:
    """A target adapter with a zeroed destination, and a source ``src-tp0`` exposing known bytes."""
    src = pattern_bytes(11, 64 * BLOCK)
    dst = np.zeros(40 * BLOCK, dtype=np.uint8)
    MemcpyTransfer.expose("src-tp0", [MemoryRegion(src.ctypes.data, src.nbytes)])
    t = MemcpyTransfer("target-tp0")
    t.register_local([MemoryRegion(dst.ctypes.data, dst.nbytes)])
    t.add_peer("src-tp0", b"ignored")
    try:
        yield t, src, dst
    finally:
        t.close()
        MemcpyTransfer.unexpose("src-tp0")


def test_memcpy_is_a_registered_transfer_adapter() -> None:
    assert load_adapter("transfer", "memcpy") is MemcpyTransfer
    assert isinstance(MemcpyTransfer("x"), TransferAdapter)


def test_memcpy_copies_every_extent_byte_exact(memcpy_pair) -> None:
    t, src, dst = memcpy_pair
    local, remote, nbytes = extents([(dst.ctypes.data + lo, src.ctypes.data + ro, n) for lo, ro, n in ROWS])
    h = t.start_read("src-tp0", local, remote, nbytes)
    assert t.poll(h) == "done"
    np.testing.assert_array_equal(dst, expected(dst.nbytes, src, ROWS))
    t.release(h)
    t.release(h)  # idempotent
    assert t.poll(h) == "done"


@pytest.mark.parametrize("bad", [
    "remote_past_end", "remote_before_start", "remote_wraps", "local_past_end", "local_before_start",
    "local_across_regions",
])
def test_memcpy_out_of_range_raises_and_writes_nothing(memcpy_pair, bad: str) -> None:
    t, src, dst = memcpy_pair
    other = np.zeros(BLOCK, dtype=np.uint8)  # a second local region, right after nothing in particular
    t.register_local([MemoryRegion(other.ctypes.data, other.nbytes)])
    d, s = dst.ctypes.data, src.ctypes.data
    rows = [(d + lo, s + ro, n) for lo, ro, n in ROWS]  # all valid ...
    rows.append({                                        # ... and one that is not
        "remote_past_end": (d, s + src.nbytes - 10, 11),
        "remote_before_start": (d, s - 1, 2),
        "remote_wraps": (d, s + 5, 2**64 - 3),
        "local_past_end": (d + dst.nbytes - 1, s, 2),
        "local_before_start": (d - 4, s, 8),
        "local_across_regions": (other.ctypes.data + BLOCK - 8, s, 16),
    }[bad])
    with pytest.raises(TransferError, match="outside registered memory"):
        t.start_read("src-tp0", *extents(rows))
    assert not dst.any() and not other.any()


def test_memcpy_unknown_or_unexposed_peer(memcpy_pair) -> None:
    t, src, dst = memcpy_pair
    one = extents([(dst.ctypes.data, src.ctypes.data, 1)])
    with pytest.raises(TransferError, match="no metadata loaded"):
        t.start_read("nobody", *one)
    t.add_peer("ghost", b"")
    assert t.has_peer("ghost")
    with pytest.raises(TransferError, match="exposes no memory"):
        t.start_read("ghost", *one)
    t.remove_peer("src-tp0")
    t.remove_peer("src-tp0")  # unknown names are ignored
    assert not t.has_peer("src-tp0")
    with pytest.raises(TransferError):
        t.start_read("src-tp0", *one)
    assert not dst.any()


# --- NIXL, two processes ----------------------------------------------------

_names = itertools.count()
PEER_BYTES = 64 * BLOCK


def _wait(t, h, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := t.poll(h)) == "pending" and time.monotonic() < deadline:
        time.sleep(0.0002)
    return state


@pytest.fixture
def nixl_peer(tmp_path: Path) -> Iterator[Callable[[], PeerProcess]]:
    """``nixl_peer()`` → a ready peer process holding ``pattern_bytes(seed=5, PEER_BYTES)``; stopped after the test."""
    peers: list[PeerProcess] = []

    def start() -> PeerProcess:
        n = next(_names)
        peers.append(PeerProcess(tmp_path / f"peer{n}", f"test-peer-{os.getpid()}-{n}", PEER_BYTES, seed=5))
        return peers[-1]

    yield start
    for p in peers:
        p.stop()


@pytest.fixture
def nixl_reader() -> Iterator[tuple[object, np.ndarray]]:
    """A NixlTransfer with a zeroed, registered 40-block destination; closed after the test (before peers stop)."""
    pytest.importorskip("nixl")
    from remote_g2.adapters.nixl_transfer import NixlTransfer

    t = NixlTransfer(f"test-target-{os.getpid()}-{next(_names)}")
    dst = np.zeros(40 * BLOCK, dtype=np.uint8)
    try:
        t.register_local([MemoryRegion(dst.ctypes.data, dst.nbytes)])
        yield t, dst
    finally:
        t.close()
        t.close()  # idempotent


@pytest.mark.nixl
def test_nixl_reads_every_extent_byte_exact(nixl_peer, nixl_reader) -> None:
    from remote_g2.adapters.nixl_transfer import NixlTransfer

    assert load_adapter("transfer", "nixl") is NixlTransfer
    t, dst = nixl_reader
    assert isinstance(t, TransferAdapter)
    peer = nixl_peer()
    src = pattern_bytes(5, PEER_BYTES)
    with pytest.raises(TransferError, match="no metadata loaded"):
        t.start_read(peer.name, *extents([(dst.ctypes.data, peer.info["base"], 1)]))
    t.add_peer(peer.name, peer.metadata)
    assert t.has_peer(peer.name)
    rows = [(dst.ctypes.data + lo, peer.info["base"] + ro, n) for lo, ro, n in ROWS]
    for attempt in range(2):
        dst[:] = 0
        h = t.start_read(peer.name, *extents(rows))
        try:
            assert _wait(t, h, 10.0) == "done", f"attempt {attempt}"
        finally:
            t.release(h)
        t.release(h)  # idempotent
        assert t.poll(h) == "done"
        np.testing.assert_array_equal(dst, expected(dst.nbytes, src, ROWS))
        t.add_peer(peer.name, peer.metadata)  # a reload (as after an epoch change) replaces the first load

    empty = t.start_read(peer.name, *extents([]))
    assert t.poll(empty) == "done"
    t.release(empty)


@pytest.mark.nixl
def test_nixl_reads_prepared_lists_by_index_byte_exact(nixl_peer, nixl_reader) -> None:
    """Extents prepared once on both sides, READ by index (any subset, any pairing); a removed peer's lists go."""
    t, dst = nixl_reader
    peer = nixl_peer()
    src = pattern_bytes(5, PEER_BYTES)
    with pytest.raises(TransferError, match="no metadata loaded"):
        t.prepare(peer.name, np.asarray([peer.info["base"]], np.uint64), np.asarray([BLOCK], np.uint64))
    t.add_peer(peer.name, peer.metadata)
    remote = t.prepare(peer.name, peer.info["base"] + np.arange(8, dtype=np.uint64) * BLOCK,
                       np.full(8, BLOCK, np.uint64))
    local = t.prepare(None, dst.ctypes.data + np.arange(8, dtype=np.uint64) * BLOCK, np.full(8, BLOCK, np.uint64))
    for local_idx, remote_idx in (([0, 1, 2], [5, 0, 7]), ([3], [3])):
        dst[:] = 0
        h = t.start_read_prepared(local, np.asarray(local_idx), remote, np.asarray(remote_idx))
        try:
            assert _wait(t, h, 10.0) == "done"
        finally:
            t.release(h)
        for li, ri in zip(local_idx, remote_idx):
            np.testing.assert_array_equal(dst[li * BLOCK:(li + 1) * BLOCK], src[ri * BLOCK:(ri + 1) * BLOCK])
        assert not dst[max(local_idx) * BLOCK + BLOCK:].any()  # nothing else written
    with pytest.raises(TransferError, match="not a live pair"):
        t.start_read_prepared(remote, np.asarray([0]), local, np.asarray([0]))  # (sides swapped)
    with pytest.raises(TransferError, match="differ in length"):
        t.start_read_prepared(local, np.asarray([0, 1]), remote, np.asarray([0]))
    t.remove_peer(peer.name)  # its prepared list goes with it
    with pytest.raises(TransferError, match="not a live pair"):
        t.start_read_prepared(local, np.asarray([0]), remote, np.asarray([0]))
    t.unprepare(local)
    t.unprepare(local)  # idempotent


@pytest.mark.nixl
def test_nixl_rejects_what_it_cannot_start(nixl_peer, nixl_reader) -> None:
    t, dst = nixl_reader
    peer = nixl_peer()
    with pytest.raises(TransferError, match="belongs to"):
        t.add_peer("someone-else", peer.metadata)
    assert not t.has_peer("someone-else")
    t.add_peer(peer.name, peer.metadata)
    with pytest.raises(TransferError, match="1 descriptor"):  # the destination is not registered memory
        t.start_read(peer.name, *extents([(dst.ctypes.data + dst.nbytes + (1 << 20), peer.info["base"], 8)]))
    with pytest.raises(TransferError, match="1 descriptor"):  # nor is the source's
        t.start_read(peer.name, *extents([(dst.ctypes.data, peer.info["base"] + PEER_BYTES, 8)]))
    t.remove_peer(peer.name)
    t.remove_peer(peer.name)
    assert not t.has_peer(peer.name)
    t.close()
    with pytest.raises(TransferError, match="closed"):
        t.add_peer(peer.name, peer.metadata)


@pytest.mark.nixl
@pytest.mark.parametrize("connected", [True, False], ids=["after-a-read", "before-any-read"])
def test_nixl_read_from_a_killed_peer_never_reports_done(nixl_peer, nixl_reader, connected: bool) -> None:
    t, dst = nixl_reader
    peer = nixl_peer()
    t.add_peer(peer.name, peer.metadata)
    rows = [(dst.ctypes.data + lo, peer.info["base"] + ro, n) for lo, ro, n in ROWS]
    if connected:
        h = t.start_read(peer.name, *extents(rows))
        assert _wait(t, h, 10.0) == "done"
        t.release(h)
    peer.kill()
    try:
        h = t.start_read(peer.name, *extents(rows))
    except TransferError as e:
        assert peer.name in str(e) and f"{len(ROWS)} descriptor" in str(e)
        return
    try:
        state = _wait(t, h, 5.0)
        assert state in ("error", "pending")  # never "done"
        if state == "error":  # a failed READ says why, naming its peer and where UCX's reason goes
            assert peer.name in t.failure(h) and "UCX_LOG_LEVEL" in t.failure(h)
    finally:
        releaser = threading.Thread(target=t.release, args=(h,), daemon=True)
        releaser.start()
        releaser.join(10)
        assert not releaser.is_alive(), "release() of a READ from a dead peer hung"
    assert t.poll(h) == "error" and t.failure(h).startswith(f"NIXL READ from {peer.name} failed: ")


_EXIT_CHECK = ("from remote_g2.adapters.nixl_transfer import NixlTransfer\n"
               "t = NixlTransfer('exit-check')\n"
               "t.close()\n"
               "print('closed', flush=True)\n")


def _run_exit_check(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    return subprocess.run([sys.executable, "-c", _EXIT_CHECK], capture_output=True, text=True, timeout=120,
                          env={**base, **env})


def test_a_process_that_made_a_nixl_agent_exits_cleanly() -> None:
    """A process that made and closed a UCX agent exits 0 and nothing else, on a host with rdma-core as on one
    without (``make test`` installs it): the agent keeps UCX's module that loads the host's verbs stack out
    (remote_g2.ucx_modules), whose second copy of libnl crashed every such process at exit."""
    proc = _run_exit_check()
    assert (proc.returncode, proc.stdout.splitlines()[-1:]) == (0, ["closed"]), proc.stderr[-3000:]  # (NIXL logs
    # to stdout too)


@pytest.mark.skipif(not Path("/usr/lib/x86_64-linux-gnu/libefa.so.1").exists(),
                    reason="the host has no rdma-core (libefa): the crash this guards against cannot happen here")
def test_with_every_ucx_module_the_host_verbs_stack_crashes_the_exit_negative_control() -> None:
    """What remote_g2.ucx_modules keeps out: with every UCX module loaded (``UCX_MODULES=all``, UCX's own default)
    on a host with rdma-core, the same process does its work and then dies at exit (SIGSEGV)."""
    proc = _run_exit_check(UCX_MODULES="all")
    assert proc.stdout.splitlines()[-1:] == ["closed"] and proc.returncode == -11, (proc.returncode,
                                                                                    proc.stderr[-3000:])
