"""An identity only for the bytes an engine loaded: changes after the start, untrusted filesystems, bounded waits.

What was wrong at 1330aac, each with a test here that failed there:

* a symlink flipped, a file rewritten in place or renamed over, a file added
  to the model directory, a directory above it swapped, or a hub ref moved
  after the engine started: the digest, taken after the load, gave the old
  weights the new weights' identity (``model_identity`` had no such check);
* a file on a FUSE object-store mount (ctime equal to mtime, inodes by path)
  was taken from the digest cache by its version, which proves nothing there;
* a process holding a digest lock without progress (a read hung on a dead NFS
  server) kept every other process of the node waiting for ever;
* with the cache directory unusable, every process read every file.

Real files, real processes, real ``flock``; only the mount table is injected
(no FUSE mount can be made on this box: that is a fault no real part here
can produce).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from remote_g2.identity import file_digest as fd
from remote_g2.identity import load_snapshot as ls
from remote_g2.identity import mounts
from remote_g2.adapters.vllm import block_identity as bi
from remote_g2.identity.model_identity import identity_of

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fd, "_node", fd.DigestCache(tmp_path / "node", racy_window_s=0))
    monkeypatch.delenv(ls.SNAPSHOT_ENV, raising=False)


def _weights(d: Path, fill: bytes = b"\x01") -> Path:
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(fill * 8192)
    (d / "config.json").write_text('{"num_hidden_layers": 2}')
    return d


def _configs(model: Path | str) -> tuple:
    text = SimpleNamespace(to_dict=lambda: {"num_hidden_layers": 2})
    mc = SimpleNamespace(model=str(model), revision=None, hf_text_config=text, dtype=torch.float32,
                         quantization=None, model_impl="auto", trust_remote_code=False)
    return mc, SimpleNamespace(load_format="auto", download_dir=None, model_loader_extra_config={}), \
        SimpleNamespace(calculate_kv_scales=False)


def _started_now() -> ls.StartMark:
    """The engine starts now, past the margin after the test wrote its files."""
    time.sleep(ls.MARGIN_NS / 1e9 + 0.02)
    mark = ls.StartMark(time.time_ns(), "the test's engine started")
    time.sleep(0.02)  # what the test changes next is after the mark by more than a clock tick
    return mark


def _identity(model: Path | str, mark: ls.StartMark) -> bi.ModelIdentity:
    return bi.model_identity(*_configs(model), digest_cache=None, mark=mark)


def _flip(link: Path, to: Path) -> None:
    """``ln -sfn``: a new link made aside and renamed over the old one."""
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(to)
    tmp.replace(link)


def test_nothing_changed_after_the_start_gives_the_identity(tmp_path: Path) -> None:
    v1 = _weights(tmp_path / "v1")
    (tmp_path / "current").symlink_to(v1)
    got = _identity(tmp_path / "current", _started_now())
    assert got.model_id is not None and got.kind == "digest", got.why_not
    assert identity_of(got.model_id) == identity_of(_identity(v1, _started_now()).model_id)


def test_a_symlink_flipped_after_the_start_gives_no_identity(tmp_path: Path) -> None:
    v1, v2 = _weights(tmp_path / "v1"), _weights(tmp_path / "v2", b"\x02")
    (tmp_path / "current").symlink_to(v1)
    mark = _started_now()  # the engine started and loaded v1 through current
    _flip(tmp_path / "current", v2)
    got = _identity(tmp_path / "current", mark)
    assert got.model_id is None and got.kind == "changed", got  # at 1330aac: v2's identity for v1's weights
    assert f"the symlink {tmp_path / 'current'} -> {v2} was made after the test's engine started" in got.why_not


def test_a_symlink_inside_the_model_directory_flipped_after_the_start_gives_no_identity(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    _weights(tmp_path / "blobs")
    (tmp_path / "blobs" / "other.safetensors").write_bytes(b"\x03" * 8192)
    (d / "model.safetensors").symlink_to(tmp_path / "blobs" / "model.safetensors")
    mark = _started_now()
    _flip(d / "model.safetensors", tmp_path / "blobs" / "other.safetensors")
    got = _identity(d, mark)
    # the new link renamed in changes the directory too: either is the reason given
    assert got.model_id is None and got.kind == "changed" and "changed after the test's engine" in got.why_not, got


def test_a_file_rewritten_in_place_or_renamed_over_after_the_start_gives_no_identity(tmp_path: Path) -> None:
    inplace, renamed = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    mark = _started_now()
    with open(inplace / "model.safetensors", "r+b") as f:  # the same size, the same inode: a new ctime
        f.write(b"\x09")
    (renamed / "new").write_bytes(b"\x02" * 8192)
    os.utime(renamed / "new", (mark.ns / 1e9 - 100, mark.ns / 1e9 - 100))  # an mtime kept from before: ctime tells
    (renamed / "new").replace(renamed / "model.safetensors")
    for d in (inplace, renamed):
        got = _identity(d, mark)
        assert got.model_id is None and "changed after the test's engine started" in got.why_not, got


def test_a_file_added_to_the_model_directory_after_the_start_gives_no_identity(tmp_path: Path) -> None:
    d = _weights(tmp_path / "m")
    mark = _started_now()
    (d / "model-00002.safetensors").write_bytes(b"\x04")
    got = _identity(d, mark)
    assert got.model_id is None and f"{d} changed after" in got.why_not, got


def test_a_directory_above_swapped_after_the_start_is_seen_through_the_snapshot(tmp_path: Path) -> None:
    old = _weights(tmp_path / "models" / "m")
    _weights(tmp_path / "staged" / "m", b"\x05")
    time.sleep(ls.MARGIN_NS / 1e9 + 0.02)
    snap = ls.LoadSnapshot.take(str(old))
    mark = ls.start_mark(snap)
    time.sleep(0.02)
    (tmp_path / "models").rename(tmp_path / "models.old")
    (tmp_path / "staged").rename(tmp_path / "models")  # a new inode under the old name, its files all older
    why = ls.changed_after(ls.StartMark(mark.ns, mark.what), [old / "model.safetensors"], old, snap)
    assert why is not None and "names another dir than when" in why, why


def test_a_file_unlike_the_one_the_snapshot_recorded_gives_no_identity(tmp_path: Path) -> None:
    """On a FUSE mount an object's size may change with its mtime (and so its ctime) preserved: the ctime
    checks cannot see it, the snapshot's record of the file can. No FUSE mount can be made here, so the
    snapshot is given a record of another size (a fault no real part of this box can produce)."""
    d = _weights(tmp_path / "m")
    time.sleep(ls.MARGIN_NS / 1e9 + 0.02)
    snap = ls.LoadSnapshot.take(str(d))
    assert snap.files_recorded and [f.name for f in snap.files] == ["config.json", "model.safetensors"]
    mark = ls.start_mark(snap)
    files = [d / "model.safetensors"]
    assert ls.changed_after(mark, files, d, snap) is None
    other = tuple(dataclasses.replace(f, size=f.size + 1) if f.name == "model.safetensors" else f
                  for f in snap.files)
    why = ls.changed_after(mark, files, d, dataclasses.replace(snap, files=other))
    assert why is not None and "is not the file it was when the engine's configuration was made" in why
    fewer = tuple(f for f in snap.files if f.name != "model.safetensors")
    why = ls.changed_after(mark, files, d, dataclasses.replace(snap, files=fewer))
    assert why is not None and "was not there when" in why
    # a directory of too many files to travel in the environment: the files are left out, the rest holds
    many = tmp_path / "many"
    many.mkdir()
    for i in range(1000):
        (many / f"shard-{i:05d}-of-01000.safetensors").write_bytes(b"x")
    big = ls.LoadSnapshot.take(str(many))
    assert not big.files_recorded and len(big.to_json()) < ls.MAX_SNAPSHOT_BYTES
    assert ls.LoadSnapshot.from_json(snap.to_json()) == snap


def _hub(tmp_path: Path, commit: str, fill: bytes) -> Path:
    repo = tmp_path / "hub" / "models--org--tiny"
    _weights(repo / "snapshots" / commit, fill)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return repo


def test_a_hub_ref_moved_after_the_start_gives_no_identity(tmp_path: Path) -> None:
    c1, c2 = "1" * 40, "2" * 40
    repo = _hub(tmp_path, c1, b"\x01")
    _weights(repo / "snapshots" / c2, b"\x02")
    mc, lc, cc = _configs("org/tiny")
    lc.download_dir = str(tmp_path / "hub")
    before = bi.model_identity(mc, lc, cc, digest_cache=None, mark=_started_now())
    assert before.where == str(repo / "snapshots" / c1), before.why_not
    mark = _started_now()
    (repo / "refs" / "main").write_text(c2)  # another process moved main while this engine loaded c1
    moved = bi.model_identity(mc, lc, cc, digest_cache=None, mark=mark)
    assert moved.model_id is None and "the hub ref" in moved.why_not and c2 in moved.why_not, moved


def test_a_hub_revision_is_resolved_once_from_the_snapshot_taken_before_the_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c1, c2 = "1" * 40, "2" * 40
    repo = _hub(tmp_path, c1, b"\x01")
    _weights(repo / "snapshots" / c2, b"\x02")
    time.sleep(0.1)
    snap = ls.LoadSnapshot.take("org/tiny", None, str(tmp_path / "hub"))
    snap.publish()  # as vLLM's plugin does in the process that makes the engine's config
    assert snap.hub_commit == c1
    mc, lc, cc = _configs("org/tiny")
    lc.download_dir = str(tmp_path / "hub")
    got = bi.model_identity(mc, lc, cc, digest_cache=None)
    assert got.where == str(repo / "snapshots" / c1) and got.model_id is not None, got.why_not
    time.sleep(0.02)
    (repo / "refs" / "main").write_text(c2)
    later = bi.model_identity(mc, lc, cc, digest_cache=None)
    assert later.model_id is None and "the hub ref" in later.why_not, later


def test_the_process_start_time_is_floored_and_read_from_proc(tmp_path: Path) -> None:
    before = time.time_ns()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        started = ls.process_start_ns(child.pid)
    finally:
        child.kill()
        child.wait()
    # btime is whole seconds (floored) and start ticks are 10 ms: never later than the real start
    assert before - 1_100_000_000 <= started <= time.time_ns()
    assert ls.start_mark(None).ns == ls.process_start_ns()


def test_a_snapshot_is_taken_only_by_the_process_that_made_it_and_its_descendants(tmp_path: Path) -> None:
    d = _weights(tmp_path / "m")
    snap = ls.LoadSnapshot.take(str(d))
    code = textwrap.dedent(f"""
        from remote_g2.identity.load_snapshot import LoadSnapshot
        got = LoadSnapshot.inherited({str(d)!r}, None)
        print(got.taken_ns if got else None)
    """)
    env = {**os.environ, ls.SNAPSHOT_ENV: snap.to_json()}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(snap.taken_ns)  # a child inherits it
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:  # an environment copied from a process that is not an ancestor: not this engine's
        forged = json.loads(snap.to_json()) | {"pid": sibling.pid, "pid_start": ls.process_start_ticks(sibling.pid)}
        env[ls.SNAPSHOT_ENV] = json.dumps(forged)
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    finally:
        sibling.kill()
        sibling.wait()
    assert child.stdout.strip() == "None"
    assert ls.LoadSnapshot.inherited(str(d), "other-revision") is None


def _fuse_mountinfo(tmp_path: Path, at: Path, fs_type: str = "fuse.gcsfuse", options: str = "rw") -> Path:
    text = ("22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
            f"99 22 0:99 / {str(at).replace(' ', chr(92) + '040')} rw,nosuid - {fs_type} bucket {options}\n")
    f = tmp_path / "mountinfo"
    f.write_text(text)
    return f


def test_a_fuse_mount_is_untrusted_and_nfs_only_with_nocto(tmp_path: Path) -> None:
    info = _fuse_mountinfo(tmp_path, tmp_path / "bucket dir").read_text()
    assert "fuse.gcsfuse" in mounts.untrusted_reason(str(tmp_path / "bucket dir" / "w"), info)
    assert mounts.untrusted_reason(str(tmp_path / "elsewhere"), info) is None
    nfs = _fuse_mountinfo(tmp_path, tmp_path / "n", "nfs4", "rw,vers=4.2,nocto").read_text()
    assert "nocto" in mounts.untrusted_reason(str(tmp_path / "n" / "w"), nfs)
    plain_nfs = _fuse_mountinfo(tmp_path, tmp_path / "n", "nfs4", "rw,vers=4.2").read_text()
    assert mounts.untrusted_reason(str(tmp_path / "n" / "w"), plain_nfs) is None


def test_on_a_fuse_mount_the_digest_cache_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mount table is injected: a FUSE mount cannot be made here (a fault no real part can produce)."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    f = bucket / "w.bin"
    f.write_bytes(b"a" * 4096)
    cache = fd.DigestCache(tmp_path / "cache", racy_window_s=0)
    assert fd.digest_file(f, cache).cached is False and fd.digest_file(f, cache).cached  # trusted: a hit
    monkeypatch.setattr(mounts, "MOUNTINFO", str(_fuse_mountinfo(tmp_path, bucket)))
    again = fd.digest_file(f, cache)
    assert not again.cached  # an entry from before this call proves nothing there: read again
    assert not fd.digest_file(f, cache, fresh_since_ns=time.time_ns()).cached
    d = _weights(bucket / "m")
    got = bi.model_identity(*_configs(d), digest_cache=cache, mark=_started_now())
    assert got.model_id is not None and "fuse.gcsfuse" in got.caveat and "same size and mtime" in got.caveat


def test_on_a_fuse_mount_processes_waiting_together_still_read_once(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    f = bucket / "w.bin"
    f.write_bytes(os.urandom(16 << 20))
    monkeypatch.setattr(mounts, "MOUNTINFO", str(_fuse_mountinfo(tmp_path, bucket)))
    cache = fd.DigestCache(tmp_path / "cache", racy_window_s=0)
    reads, real = [], fd._read_digest

    def slow_read(*a: object) -> str:  # the first reader takes long enough for the others to queue on the lock
        reads.append(1)
        time.sleep(0.3)
        return real(*a)

    monkeypatch.setattr(fd, "_read_digest", slow_read)
    out: list[fd.FileDigest] = []
    started = time.time_ns()  # the engine's start mark: what was read since is as fresh as a read of its own
    threads = [threading.Thread(target=lambda: out.append(fd.digest_file(f, cache, fresh_since_ns=started)))
               for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    assert len(reads) == 1 and len({d.digest for d in out}) == 1 and sum(d.cached for d in out) == 2


_HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    progress = sys.argv[2] == "progress"
    for i in range(400):  # at most 20 s
        if progress:
            os.pwrite(fd, f"{i:020d}".encode(), 0)
        time.sleep(0.05)
""")


def _holder(lock: Path, mode: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock), mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_lock_holder_that_makes_no_progress_is_waited_on_for_a_bounded_time(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"b" * 4096)
    cache = fd.DigestCache(tmp_path / "cache", racy_window_s=0, lock_stall_s=0.5)
    hung = _holder(cache._entry_path(os.path.realpath(f)).with_suffix(".lock"), "hung")  # a read hung on NFS
    try:
        t0 = time.monotonic()
        done: list[fd.FileDigest] = []
        t = threading.Thread(target=lambda: done.append(fd.digest_file(f, cache)), daemon=True)
        t.start()
        t.join(10)  # at 1330aac: blocked in flock until the holder ends
        assert done and not done[0].cached and time.monotonic() - t0 < 5
        assert done[0].digest == fd.digest_file(f).digest
    finally:
        hung.kill()
        hung.wait()


def test_a_lock_holder_that_progresses_is_waited_on_past_the_stall_bound(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"c" * 4096)
    cache = fd.DigestCache(tmp_path / "cache", racy_window_s=0, lock_stall_s=0.3)
    busy = _holder(cache._entry_path(os.path.realpath(f)).with_suffix(".lock"), "progress")
    done: list[fd.FileDigest] = []
    t = threading.Thread(target=lambda: done.append(fd.digest_file(f, cache)), daemon=True)
    t.start()
    t.join(1.5)
    assert not done  # still waiting: the reader before it is moving
    busy.kill()
    busy.wait()
    t.join(10)
    assert done


_DIGEST = textwrap.dedent("""
    import json, sys, time
    from remote_g2.identity import file_digest as fd
    fd.NODE_CACHE_BASES = (sys.argv[2],)
    real = fd._read_digest
    def slow(*a):
        time.sleep(0.5)
        return real(*a)
    fd._read_digest = slow
    while time.time() < float(sys.argv[3]):
        time.sleep(0.005)
    d = fd.digest_file(sys.argv[1], fd.default_cache())
    print(json.dumps([d.digest, d.cached]))
""")


def test_with_the_cache_directory_unusable_the_node_reads_each_file_once(tmp_path: Path) -> None:
    """Three processes (a scheduler and two TP ranks) start together with a cache directory others can write."""
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(4 << 20))
    os.utime(f, (time.time() - 60, time.time() - 60))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # refused: its entries could be forged
    node = tmp_path / "shm"
    node.mkdir()
    go = str(time.time() + 2.0)
    env = {**os.environ, fd.CACHE_DIR_ENV: str(shared)}
    procs = [subprocess.Popen([sys.executable, "-c", _DIGEST, str(f), str(node), go], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert len({r[0] for r in results}) == 1
    assert sorted(r[1] for r in results) == [False, True, True]  # at 1330aac: [False, False, False]
    assert (node / f"remote-g2-{os.geteuid()}").is_dir()


def test_a_long_digest_logs_its_progress(caplog: pytest.LogCaptureFixture) -> None:
    p = fd.Progress("2 checkpoint files in /m", 3_000_000_000, every_s=0.0)
    with caplog.at_level(logging.INFO, logger="remote_g2.identity.file_digest"):
        p.add(1_500_000_000)
    assert "digesting 2 checkpoint files in /m: 1.50 of 3.00 GB read" in caplog.text and "MB/s" in caplog.text
