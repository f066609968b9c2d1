"""The vLLM connector's ``kv_connector_extra_config`` settings, without vLLM: checked, and layered over the
target's own ``REMOTE_G2_TARGET_*`` settings rather than hiding them."""

from __future__ import annotations

import pytest
from remote_g2.adapters.vllm.settings import ConnectorSettings

from remote_g2.errors import ConfigError
from remote_g2.target import TargetConfig


def _target(extra: dict, env: dict[str, str]) -> TargetConfig:
    """The target config the connector's workers start with (``register_kv_caches`` calls the same method)."""
    s = ConnectorSettings.from_extra({"registry": "tcp://127.0.0.1:1", **extra}, default_worker_id="w")
    return s.target_config(env=env)


def test_unset_transfer_settings_keep_the_targets_environment() -> None:
    env = {"REMOTE_G2_TARGET_TIMEOUT_MS": "60000", "REMOTE_G2_TARGET_TRANSFER": "memcpy",
           "REMOTE_G2_TARGET_RPC_TIMEOUT_MS": "15000"}
    cfg = _target({}, env)
    assert (cfg.transfer_timeout_ms, cfg.transfer, cfg.rpc_timeout_ms) == (60000, "memcpy", 15000)
    default = _target({}, {})
    assert (default.transfer_timeout_ms, default.transfer) == (TargetConfig().transfer_timeout_ms, "nixl")


def test_extra_config_wins_over_the_environment() -> None:
    cfg = _target({"transfer_timeout_ms": 2500, "transfer": "nixl"},
                  {"REMOTE_G2_TARGET_TIMEOUT_MS": "60000", "REMOTE_G2_TARGET_TRANSFER": "memcpy"})
    assert (cfg.transfer_timeout_ms, cfg.transfer) == (2500, "nixl")


@pytest.mark.parametrize("extra,match", [({"transfer_timout_ms": 1}, "unknown remote-g2 settings"),
                                         ({"load": "eager"}, "load must be"),
                                         ({"tp_exchange": "mpi"}, "tp_exchange must be"),
                                         ({"g2_prefault": "yes"}, "g2_prefault must be"),
                                         ({"g2_blocks": 0}, "g2_blocks"),
                                         ({"failed_source_cooldown_s": -1}, "failed_source_cooldown_s")])
def test_bad_settings_are_refused_with_what_is_wrong(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorSettings.from_extra(extra, default_worker_id="w")


def test_a_nonpositive_timeout_is_refused_by_the_target() -> None:
    with pytest.raises(ConfigError, match="transfer_timeout_ms"):
        _target({"transfer_timeout_ms": 0}, {})
