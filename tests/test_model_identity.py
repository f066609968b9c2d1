"""Model identity from the bytes of the weights: file digests, their on-disk cache, checkpoint files, model ids.

The cache rule under test (``remote_g2/identity/file_digest.py``): an entry is
trusted only for the same path, device, inode, size, mtime and ctime, and
only when it passes its own check; files changed within the racy window are
not cached at all.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from remote_g2.identity import file_digest as fd
from remote_g2.identity import model_identity as mi
from remote_g2.errors import ConfigError
from remote_g2.protocol.messages import LayoutFingerprint


def _safetensors(path: Path, tensors: dict[str, list[float]]) -> Path:
    """A safetensors file written by hand (float32 tensors): header length, JSON header, data."""
    header, data, off = {}, b"", 0
    for name, values in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [off, off + len(raw)]}
        data, off = data + raw, off + len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _age(path: Path, seconds: float = 10.0) -> None:
    """Set the file's mtime back (its ctime moves to now: the cache tests then use a window of 0)."""
    t = time.time() - seconds
    os.utime(path, (t, t))


@pytest.fixture
def cache(tmp_path: Path) -> fd.DigestCache:
    return fd.DigestCache(tmp_path / "cache", racy_window_s=0)


@pytest.fixture(autouse=True)
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> fd.DigestCache:
    """The node-wide fallback cache, in the test's directory (not the box's /dev/shm)."""
    n = fd.DigestCache(tmp_path / "node", racy_window_s=0)
    monkeypatch.setattr(fd, "_node", n)
    monkeypatch.setattr(fd, "_default", None)
    return n


def test_the_digest_covers_every_byte(tmp_path: Path) -> None:
    f = _safetensors(tmp_path / "m.safetensors", {"a": [float(i) for i in range(1000)], "b": [0.5] * 300})
    base = fd.digest_file(f).digest
    raw = bytearray(f.read_bytes())
    for pos in (0, 8, len(raw) // 2, len(raw) - 1):  # header length, header, a weight, the very last byte
        flipped = bytearray(raw)
        flipped[pos] ^= 0x01
        g = tmp_path / f"flip{pos}.safetensors"
        g.write_bytes(bytes(flipped))
        assert fd.digest_file(g).digest != base, pos
    assert fd.digest_file(f).algorithm == fd.ALGORITHM == "blake3"


def test_the_cache_is_hit_on_a_restart(tmp_path: Path, cache: fd.DigestCache) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(3 << 20))
    first = fd.digest_file(f, cache)
    assert not first.cached
    again = fd.digest_file(f, fd.DigestCache(cache.directory, racy_window_s=0))  # a new process: a new cache object
    assert again.cached and again.digest == first.digest


def test_a_file_replaced_with_the_same_size_and_mtime_but_a_new_inode_misses(tmp_path: Path,
                                                                            cache: fd.DigestCache) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"\x01" * 4096)
    _age(f)
    old = fd.digest_file(f, cache)
    st = f.stat()
    new = tmp_path / "w.safetensors.new"
    new.write_bytes(b"\x02" * 4096)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, f)  # a rolling update: written aside, renamed in
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns) and f.stat().st_ino != st.st_ino
    got = fd.digest_file(f, cache)
    assert not got.cached and got.digest != old.digest


def test_a_file_rewritten_in_place_misses_with_a_new_mtime_and_with_its_old_mtime_restored(
        tmp_path: Path, cache: fd.DigestCache) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"\x01" * 4096)
    _age(f)
    old = fd.digest_file(f, cache)
    st = f.stat()
    time.sleep(0.05)
    with open(f, "r+b") as h:  # same inode, same size
        h.write(b"\x03")
    assert f.stat().st_ino == st.st_ino and f.stat().st_mtime_ns != st.st_mtime_ns
    got = fd.digest_file(f, cache)
    assert not got.cached and got.digest != old.digest
    # Now the mtime set back as `cp -p` / `rsync -t` would: only the ctime tells.
    assert fd.digest_file(f, cache).cached
    time.sleep(0.05)  # past the clock tick of the last write (the racy window's job outside tests)
    with open(f, "r+b") as h:
        h.write(b"\x04")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns
    again = fd.digest_file(f, cache)
    assert not again.cached and again.digest not in (old.digest, got.digest)


def test_a_corrupt_or_forged_cache_entry_is_ignored_not_trusted(tmp_path: Path, cache: fd.DigestCache) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 16))
    _age(f)
    true = fd.digest_file(f, cache).digest
    (entry,) = cache.directory.glob("*.json")
    doc = json.loads(entry.read_text())
    for bad in ("{not json", json.dumps([1, 2]), json.dumps({**doc, "extra": 1}),
                json.dumps({**doc, "digest": "0" * 64}),  # a forged digest: its check no longer matches
                json.dumps({**doc, "digest": 7})):
        entry.write_text(bad)
        got = fd.digest_file(f, cache)
        assert not got.cached and got.digest == true, bad
        assert fd.digest_file(f, cache).cached  # the miss rewrote a good entry
    entry.write_bytes(b"\xff\xfe\x00")
    assert fd.digest_file(f, cache).digest == true


def test_a_recently_changed_file_is_digested_but_not_cached(tmp_path: Path) -> None:
    racy = fd.DigestCache(tmp_path / "c", racy_window_s=fd.RACY_WINDOW_S)
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 100)
    assert not fd.digest_file(f, racy).cached
    assert not fd.digest_file(f, racy).cached and not list(racy.directory.glob("*.json"))


def test_a_cache_directory_others_can_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       node: fd.DigestCache) -> None:
    d = tmp_path / "shared"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError, match="not this user's alone"):
        fd.DigestCache(d)
    monkeypatch.setenv(fd.CACHE_DIR_ENV, str(d))
    assert fd.default_cache() is node  # the node's memory takes its place (with a warning): read once per node
    monkeypatch.setenv(fd.CACHE_DIR_ENV, "")
    assert fd.default_cache() is None
    monkeypatch.setenv(fd.CACHE_DIR_ENV, str(tmp_path / "mine"))
    own = fd.default_cache()
    assert own is not None and (os.stat(own.directory).st_mode & 0o777) == 0o700


def test_concurrent_digests_of_one_file_read_it_once(tmp_path: Path, cache: fd.DigestCache,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(8 << 20))
    _age(f)
    reads = []
    real = fd._read_digest
    monkeypatch.setattr(fd, "_read_digest", lambda fdn, algo, *a: reads.append(1) or real(fdn, algo, *a))
    out: list[fd.FileDigest] = []
    threads = [threading.Thread(target=lambda: out.append(fd.digest_file(f, cache))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(reads) == 1 and len({d.digest for d in out}) == 1 and sum(not d.cached for d in out) == 1


def test_checkpoint_files_take_the_form_engines_load(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "pytorch_model.bin", "config.json", "tokenizer.json"):
        (d / name).write_bytes(name.encode())
    (d / "original").mkdir()
    (d / "original" / "consolidated.pth").write_bytes(b"x")
    assert [p.name for p in mi.checkpoint_files(d)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert [p.name for p in mi.checkpoint_files(d, order=("bin",))] == ["pytorch_model.bin"]
    assert "config.json" in [p.name for p in mi.checkpoint_files(d, also=("config.json",))]
    gguf = tmp_path / "m.Q4_K.gguf"
    gguf.write_bytes(b"GGUF")
    assert mi.checkpoint_files(gguf) == [gguf]
    empty = tmp_path / "e"
    empty.mkdir()
    (empty / "model.safetensors.index.json").write_text("{}")  # an index alone is no checkpoint
    with pytest.raises(ConfigError, match="no checkpoint files"):
        mi.checkpoint_files(empty)


def test_one_element_changed_in_one_tensor_changes_the_model_id(tmp_path: Path) -> None:
    opts = {"dtype": "float32"}

    def model(d: Path, bump: int | None = None) -> str:
        d.mkdir()
        for shard in range(2):
            values = [float(i % 97) for i in range(4096)]
            if bump is not None and shard == 1:
                # one element of one tensor, by one float32 ulp
                bits = struct.unpack("<I", struct.pack("<f", values[bump]))[0] + 1
                values[bump] = struct.unpack("<f", struct.pack("<I", bits))[0]
            _safetensors(d / f"model-0000{shard + 1}-of-00002.safetensors", {"w": values, "b": values[:64]})
        return mi.model_id_for(str(d), mi.weights_digest(mi.checkpoint_files(d), d, cache=None).digest, opts)

    base = model(tmp_path / "a")
    assert mi.identity_of(model(tmp_path / "same-bytes-elsewhere")) == mi.identity_of(base)
    for i, pos in enumerate((0, 1234, 4095)):
        assert mi.identity_of(model(tmp_path / f"b{i}", pos)) != mi.identity_of(base)


def test_model_ids_label_for_people_and_match_by_identity() -> None:
    a = mi.model_id_for("/models/llama", "ab" * 32, {"dtype": "bfloat16"})
    b = mi.model_id_for("/mnt/cache/llama", "ab" * 32, {"dtype": "bfloat16"})
    assert a.startswith("/models/llama#w-") and a != b and mi.identity_of(a) == mi.identity_of(b)
    assert mi.identity_of(mi.model_id_for("/models/llama", "ab" * 32, {"dtype": "float16"})) != mi.identity_of(a)
    assert mi.identity_of(mi.model_id_for("x", "cd" * 32, {"dtype": "bfloat16"})) != mi.identity_of(a)
    long = mi.model_id_for("/" + "d" * 400, "ab" * 32, {})
    assert len(long) <= 256 and mi.identity_of(long) == mi.identity_of(mi.model_id_for("short", "ab" * 32, {}))
    o = mi.override_model_id("llama-3.1-8b@r2", {"dtype": "bfloat16"})
    assert o.startswith("llama-3.1-8b@r2#o-") and mi.identity_of(o) != mi.identity_of(
        mi.override_model_id("llama-3.1-8b@r3", {"dtype": "bfloat16"}))
    with pytest.raises(ConfigError):
        mi.override_model_id("  ", {})
    fp = dict(dtype="float16", tokens_per_block=32, kv_layout="HND", num_layers=2, num_kv_heads=2, head_dim=64,
              tp_size=1)
    fa, fb = LayoutFingerprint(model_id=a, **fp), LayoutFingerprint(model_id=b, **fp)
    assert fa.model_identity == mi.identity_of(a) and fa.compat_key() == fb.compat_key()
    from remote_g2.target.layout_compat import check_fingerprints

    assert check_fingerprints(fa, fb) is None  # labels differ, the weights do not
    fc = LayoutFingerprint(model_id=mi.model_id_for("/models/llama", "cd" * 32, {"dtype": "bfloat16"}), **fp)
    assert fc.compat_key() != fa.compat_key() and "model differs" in str(check_fingerprints(fc, fa))


def test_a_file_that_keeps_changing_has_no_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    real = fd._read_digest

    def write_while_reading(fdn: int, algo: str, *a: object) -> str:
        with open(f, "ab") as h:
            h.write(b"b")
        return real(fdn, algo, *a)

    monkeypatch.setattr(fd, "_read_digest", write_while_reading)
    with pytest.raises(ConfigError, match="kept changing while it was read"):
        fd.digest_file(f)


def test_a_cache_that_cannot_be_written_costs_the_cache_not_the_digest(tmp_path: Path) -> None:
    cache = fd.DigestCache(tmp_path / "c", racy_window_s=0)
    f = tmp_path / "w.bin"
    f.write_bytes(b"z" * 5000)
    _age(f)
    want = fd.digest_file(f).digest
    # The entry's lock path taken by a directory: opening it fails (EISDIR) for any user, root included.
    cache._entry_path(os.path.realpath(f)).with_suffix(".lock").mkdir()
    got = fd.digest_file(f, cache)
    assert got.digest == want and not got.cached
    assert not list(cache.directory.glob("*.json"))
    assert fd.digest_file(f, cache).cached  # the node's fallback cache took the entry: the next process reads nothing


def test_a_full_cache_volume_costs_the_cache_not_the_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for a full disk (no real volume fills on demand here): every write of the cache fails."""
    cache = fd.DigestCache(tmp_path / "c", racy_window_s=0)
    f = tmp_path / "w.bin"
    f.write_bytes(b"y" * 5000)
    _age(f)

    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fd.DigestCache, "put", full)
    got = fd.digest_file(f, cache)
    assert got.digest == fd.digest_file(f).digest and not got.cached
