"""The options that change K or V, as vLLM 0.32 reads them, are part of the model identity (no vLLM needed).

At 1330aac ``load_options`` took only the text config: a user-level
``quantization_config``, the quantisation files vLLM reads beside
``config.json`` (``quantize_config.json``, ``quant_config.json``,
``hf_quant_config.json``), the file ``hf_overrides.quantization_config_file``
names, a vision tower's config and ``preprocessor_config.json`` could all
differ between two instances that then matched. Each case below gave equal
identities there.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from remote_g2.adapters.vllm import block_identity as bi
from remote_g2.identity.load_snapshot import MARGIN_NS, StartMark
from remote_g2.identity.model_identity import identity_of


def _model(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"\x01" * 4096)
    (d / "config.json").write_text('{"num_hidden_layers": 2}')
    return d


class _Config:
    """A transformers config as vLLM holds it: ``to_dict`` gives every field, nested configs included."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)


def _identity(d: Path, *, hf: dict | None = None, **mc: Any) -> str:
    text = _Config(num_hidden_layers=2)
    full = _Config(**(hf or {"num_hidden_layers": 2, "text_config": {"num_hidden_layers": 2}}))
    model_config = SimpleNamespace(**{"model": str(d), "revision": None, "hf_text_config": text, "hf_config": full,
                                      "dtype": torch.float32, "quantization": None, "model_impl": "auto",
                                      "trust_remote_code": False, **mc})
    got = bi.model_identity(model_config, SimpleNamespace(load_format="auto", download_dir=None,
                                                          model_loader_extra_config={}),
                            SimpleNamespace(calculate_kv_scales=False), digest_cache=None,
                            mark=StartMark(time.time_ns() + 2 * MARGIN_NS, "the test's engine started"))
    assert got.model_id is not None, got.why_not
    return identity_of(got.model_id)


def test_a_user_level_quantization_config_changes_the_identity(tmp_path: Path) -> None:
    d = _model(tmp_path / "m")
    base = _identity(d)
    assert _identity(d, quantization_config={"activation_scheme": "dynamic"}) != base
    assert _identity(d, quantization_config=None) == base


@pytest.mark.parametrize("name", ["quantize_config.json", "quant_config.json", "hf_quant_config.json",
                                  "preprocessor_config.json", "video_preprocessor_config.json"])
def test_the_files_vllm_reads_beside_config_json_are_digested(tmp_path: Path, name: str) -> None:
    d = _model(tmp_path / "m")
    base = _identity(d)
    (d / name).write_text('{"bits": 4}')
    four = _identity(d)
    (d / name).write_text('{"bits": 8}')
    eight = _identity(d)
    assert len({base, four, eight}) == 3
    (d / "tokenizer_config.json").write_text("{}")  # what does not build the model stays out
    assert _identity(d) == eight


def test_the_quantization_config_file_hf_overrides_names_is_digested(tmp_path: Path) -> None:
    d = _model(tmp_path / "m")
    q = tmp_path / "elsewhere" / "q.json"
    q.parent.mkdir()
    q.write_text('{"group_size": 64}')
    overrides = {"quantization_config_file": str(q)}
    one = _identity(d, hf_overrides=overrides)
    q.write_text('{"group_size": 128}')  # the same override, another file's content
    assert _identity(d, hf_overrides=overrides) != one
    assert _identity(d, hf_overrides={"quantization_config_dict_json": '{"a": 1}'}) != \
        _identity(d, hf_overrides={"quantization_config_dict_json": '{"a": 2}'})


def test_a_vision_towers_config_and_processor_kwargs_change_the_identity(tmp_path: Path) -> None:
    d = _model(tmp_path / "m")
    hf = {"num_hidden_layers": 2, "vision_config": {"image_size": 336, "patch_size": 14}}
    base = _identity(d, hf=hf)
    assert _identity(d, hf={**hf, "vision_config": {"image_size": 448, "patch_size": 14}}) != base
    mm = SimpleNamespace(mm_processor_kwargs={"max_pixels": 1_000_000})
    assert _identity(d, hf=hf, multimodal_config=mm) != base
    # another install of the same model: volatile keys at any depth do not count
    same = {**hf, "transformers_version": "9", "vision_config": {**hf["vision_config"], "_name_or_path": "/x"}}
    assert _identity(d, hf=same) == base
