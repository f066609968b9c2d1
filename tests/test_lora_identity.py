"""A LoRA adapter's identity (adapters/vllm/lora_identity.py) on real files: digest, re-check, block keys.

vLLM hashes a LoRA request's blocks by the adapter's name and path only; the
connector binds them to a digest of the files vLLM loads. These tests write
real adapter directories and check that two adapters under one path never
get one key, that the same bytes anywhere do, and that files changed after
the engine started, or after they were digested, leave the adapter with no
identity for good.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from remote_g2.adapters.vllm import lora_identity as li

LATER = 4 * 10**18  # a "scheduler start" long after any file here was written (ns since the epoch: 2096)


def _adapter(d: Path, weights: bytes = b"w" * 1000, config: str = '{"r": 8}', name: str = li.WEIGHT_FILES[0]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / li.CONFIG_FILE).write_text(config)
    (d / name).write_bytes(weights)
    return d


def _sample(name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of prometheus_client's default registry, where the connector counts its adapters (0: absent)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def _changed() -> float:
    return _sample("remote_g2_vllm_lora_no_identity_total", {"reason": "changed"})


def _key(d: Path | str, options: dict | None = None, **kw: object) -> li.LoraIdentity:
    return li.digest_adapter("l1", str(d), options or {}, loaded_after_ns=kw.pop("loaded_after_ns", LATER))


def test_the_key_is_the_bytes_vllm_loads_not_the_path(tmp_path: Path) -> None:
    a = _key(_adapter(tmp_path / "a"))
    assert a.key is not None and len(a.key) == 32 and a.why_not == ""
    assert _key(_adapter(tmp_path / "b")).key == a.key  # the same bytes elsewhere: the same adapter
    assert _key(_adapter(tmp_path / "c", weights=b"w" * 999 + b"x")).key != a.key  # one byte of the weights
    assert _key(_adapter(tmp_path / "d", config='{"r": 4}')).key != a.key  # its config
    assert _key(tmp_path / "a", {"lora_dtype": "bfloat16"}).key != a.key  # the instance's LoRA options
    # vLLM reads the first of safetensors / bin / pt: a stray .bin beside a safetensors file is not read
    (tmp_path / "a" / "adapter_model.bin").write_bytes(b"other")
    assert _key(tmp_path / "a").key == a.key
    bin_only = _adapter(tmp_path / "e", name="adapter_model.bin")
    assert _key(bin_only).key is not None and _key(bin_only).key != a.key  # its name counts


def test_rewritten_under_the_same_path_is_another_adapter(tmp_path: Path) -> None:
    d = _adapter(tmp_path / "l1")
    old = _key(d)
    _adapter(d, weights=b"v" * 1000)  # same size, same config, other weights: what the issue replayed
    assert _key(d).key not in (None, old.key)


def test_what_has_no_identity(tmp_path: Path) -> None:
    hub = li.digest_adapter("l1", "some-org/some-adapter", {}, loaded_after_ns=LATER)
    assert hub.key is None and hub.reason == "unreadable" and "hub id" in hub.why_not
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / li.CONFIG_FILE).write_text("{}")
    assert _key(tmp_path / "empty").reason == "unreadable"
    assert _key(tmp_path / "missing").reason == "unreadable"
    # written after the engine started (the scheduler's start): vLLM may have loaded the files there before
    d = _adapter(tmp_path / "new")
    late = _key(d, loaded_after_ns=time.time_ns())
    assert late.key is None and late.reason == "changed" and str(d) in late.why_not
    # ... or within SETTLE_S before it (coarse timestamps)
    assert _key(d, loaded_after_ns=time.time_ns() + int(li.SETTLE_S * 1e9) // 2).key is None
    assert _key(d, loaded_after_ns=time.time_ns() + int(li.SETTLE_S * 1e9) + 10**8).key is not None


def test_a_symlink_on_the_path_counts_when_it_was_made_and_when_it_moves(tmp_path: Path) -> None:
    v1, v2 = _adapter(tmp_path / "v1"), _adapter(tmp_path / "v2", weights=b"v" * 1000)
    links = tmp_path / "links"
    links.mkdir()
    (links / "current").symlink_to(v1)
    (tmp_path / "alias").symlink_to(links)  # a link above the link: both are met resolving the path
    path = tmp_path / "alias" / "current"
    ident = _key(path)
    assert ident.key == _key(v1).key
    assert {v.path for v in ident.versions if v.link} == {str(tmp_path / "alias"), str(links / "current")}
    # flipped after the engine started: which one vLLM read is unknown
    t = time.time_ns()
    tmp = links / "next"
    tmp.symlink_to(v2)
    os.replace(tmp, links / "current")
    flipped = _key(path, loaded_after_ns=t)
    assert flipped.key is None and str(links / "current") in flipped.why_not
    assert not li.files_unchanged(ident.versions)  # and a re-check of the first identity sees the flip


def test_a_changed_adapter_loses_its_identity_for_good_once_logged_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = _adapter(tmp_path / "l1")
    ids = li.LoraIdentities({}, loaded_after_ns=LATER)
    digested, changed = _sample("remote_g2_vllm_lora_digested_total"), _changed()
    first = ids.identity("l1", str(d))
    assert first.key is not None and _sample("remote_g2_vllm_lora_digested_total") == digested + 1
    assert ids.identity("l1", str(d)) is first  # no digest again
    (d / li.WEIGHT_FILES[0]).write_bytes(b"w" * 1000)  # the same bytes written again: still a change (ctime)
    assert ids.identity("l1", str(d)).key is not None  # checked once a step: not again in this one
    ids.new_step()
    with caplog.at_level(logging.WARNING, logger="remote_g2.adapters.vllm"):
        lost = ids.identity("l1", str(d))
        assert lost.key is None and lost.reason == "changed"
        assert ids.still_valid(first) is None
        for _ in range(3):
            ids.new_step()
            assert ids.identity("l1", str(d)).key is None  # for good, though the bytes are the old ones
    assert len([r for r in caplog.records if "not sharing the KV blocks of LoRA adapter" in r.message]) == 1
    assert _changed() == changed + 1
    # another adapter, and the same files under another name, are their own entries
    other = _adapter(tmp_path / "l2")
    assert ids.identity("l2", str(other)).key is not None
    assert ids.still_valid(ids.identity("l2", str(other))) is not None


def test_the_directory_and_the_files_are_checked_renames_included(tmp_path: Path) -> None:
    d = _adapter(tmp_path / "l1")
    ident = _key(d)
    assert li.files_unchanged(ident.versions)
    (d / "README.md").write_text("x")  # an entry added to the adapter's directory
    assert not li.files_unchanged(ident.versions)
    d2 = _adapter(tmp_path / "m1")
    ident2 = _key(d2)
    staged = _adapter(tmp_path / "staged", weights=b"v" * 1000)
    os.rename(d2, tmp_path / "old")
    os.rename(staged, d2)  # the whole directory replaced by rename
    assert not li.files_unchanged(ident2.versions)


def test_block_keys_and_the_workers_check(tmp_path: Path) -> None:
    hashes = [bytes([i]) * 32 for i in range(4)]
    k1, k2 = _key(_adapter(tmp_path / "a")), _key(_adapter(tmp_path / "b", weights=b"v" * 1000))
    assert k1.key is not None and k2.key is not None
    keys1 = li.lora_block_keys(k1.key, hashes)
    assert keys1 == li.lora_block_keys(k1.key, hashes) and all(len(k) == 32 for k in keys1)
    assert not set(keys1) & set(li.lora_block_keys(k2.key, hashes)) and not set(keys1) & set(hashes)
    files = {k1.key.hex(): k1.versions, k2.key.hex(): k2.versions}
    saves = ["", k1.key.hex(), k2.key.hex(), k2.key.hex()]
    assert li.changed_adapters(saves, files) == set()
    (tmp_path / "b" / li.CONFIG_FILE).write_text('{"r": 8}')
    assert li.changed_adapters(saves, files) == {k2.key.hex()}
    assert li.changed_adapters(["", "ab" * 32], files) == {"ab" * 32}  # named without versions: not saved


def test_lora_options_leave_out_capacities() -> None:
    from dataclasses import dataclass

    @dataclass
    class Cfg:
        max_lora_rank: int = 8
        max_loras: int = 1
        max_cpu_loras: int | None = None
        lora_dtype: str = "auto"

    assert li.lora_options(Cfg()) == li.lora_options(Cfg(max_loras=4, max_cpu_loras=8))
    assert li.lora_options(Cfg()) != li.lora_options(Cfg(lora_dtype="float32"))
    assert li.lora_options(None) == {}


def test_an_adapter_on_an_untrusted_filesystem_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    d = _adapter(tmp_path / "bucket" / "l1")
    assert _key(d).caveat == ""  # this test's temp dir: a local filesystem
    info = f"36 35 0:50 / {tmp_path / 'bucket'} rw,relatime - fuse.gcsfuse my-bucket rw\n"
    from remote_g2.identity import mounts

    real = mounts.untrusted_reason
    monkeypatch.setattr(li, "untrusted_reason", lambda p: real(p, info))  # the mount table of a gcsfuse node
    ident = _key(d)
    assert ident.key is not None and "fuse.gcsfuse" in ident.caveat
    with caplog.at_level(logging.WARNING, logger="remote_g2.adapters.vllm"):
        assert li.LoraIdentities({}, loaded_after_ns=LATER).identity("l1", str(d)).key == ident.key
    assert any("would go unseen" in r.message for r in caplog.records)


def test_a_file_that_is_a_link_counts_too(tmp_path: Path) -> None:
    """A hub cache's snapshot: each file a link to a blob. A link re-pointed at another blob is a change."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "cfg").write_text('{"r": 8}')
    (blobs / "w1").write_bytes(b"w" * 1000)
    (blobs / "w2").write_bytes(b"v" * 1000)
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / li.CONFIG_FILE).symlink_to(blobs / "cfg")
    (snap / li.WEIGHT_FILES[0]).symlink_to(blobs / "w1")
    ident = _key(snap)
    assert ident.key == _key(_adapter(tmp_path / "plain")).key  # the bytes, wherever the links lead
    assert str(snap / li.WEIGHT_FILES[0]) in {v.path for v in ident.versions if v.link}
    t = time.time_ns()
    tmp = snap / "next"
    tmp.symlink_to(blobs / "w2")
    os.replace(tmp, snap / li.WEIGHT_FILES[0])
    assert not li.files_unchanged(ident.versions)
    # re-pointed after the engine started, at a blob written before: no identity (vLLM may have read w1)
    late = _key(snap, loaded_after_ns=t)
    assert late.key is None and str(snap / li.WEIGHT_FILES[0]) in late.why_not
