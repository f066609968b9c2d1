"""The remote-g2 command line, called in-process and as the installed script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import remote_g2
from remote_g2.cli import main
from remote_g2.protocol.messages import BlockEvent, LayoutFingerprint
from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer
from remote_g2.rpc.server import RpcServer


@pytest.fixture
def server():
    s = RpcServer("tcp://127.0.0.1:0", {}, name="cli-test")
    yield s.start()
    s.close()


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"remote-g2 {remote_g2.__version__}"


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_ping_table_and_json(server, capsys):
    assert main(["ping", server, "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert "cli-test" in out and "rtt_ms" in out
    assert main(["ping", server, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["server"] == "cli-test" and doc["endpoint"] == server


def test_ping_unreachable_is_one_clear_line(capsys):
    assert main(["ping", "tcp://127.0.0.1:1", "--timeout-ms", "200"]) == 1
    err = capsys.readouterr().err
    assert "RpcTimeout" in err and "calling ping" in err


def test_bad_log_level_is_a_usage_error(server, capsys):
    assert main(["--log-level", "LOUD", "ping", server]) == 2
    assert "unknown log level" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["admin", "--registry", "tcp://127.0.0.1:1,bogus", "workers"],
                                  ["serve", "--redis-url", "redis://127.0.0.1:1/0", "--mirror-lookups",
                                   "--mirror-peers", "tcp://127.0.0.1:1,tcp://h"]])
def test_a_bad_endpoint_in_a_failover_list_is_a_usage_error_before_anything_is_dialled(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tcp://HOST:PORT" in err and "in the list" in err and "Traceback" not in err


def test_keygen_writes_usable_keys(tmp_path, capsys):
    assert main(["keygen", str(tmp_path), "--name", "reg", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["public_key_file"].endswith("reg.key")
    assert (tmp_path / "reg.key_secret").stat().st_mode & 0o077 == 0


OLD, NEW = "w-" + "a" * 32, "w-" + "b" * 32
CHAIN = [i.to_bytes(8, "big") for i in range(1, 65)]


def fingerprint(model_id: str, tp_size: int = 2, dtype: str = "bf16") -> LayoutFingerprint:
    return LayoutFingerprint(model_id=model_id, dtype=dtype, tokens_per_block=16, kv_layout="HND", num_layers=2,
                             num_kv_heads=4, head_dim=32, tp_size=tp_size)


@pytest.fixture
def registry():
    """A registry on a clock the test moves (``now[0]``, seconds); the sweeper stays out of the way."""
    now = [1000.0]
    server = RegistryServer(MemoryStore(lease_ttl_ms=2000, clock=lambda: now[0]), bind="tcp://127.0.0.1:0",
                            sweep_interval_s=3600)
    client = RegistryClient(server.start(), timeout_s=5)
    yield server.endpoint, client, now
    client.close()
    server.close()


def admin(capsys, endpoint: str, *argv: str) -> tuple[int, str]:
    code = main(["admin", "--registry", endpoint, *argv])
    return code, capsys.readouterr().out


def test_admin_models_groups_one_identity_under_several_labels(registry, capsys):
    ep, c, _ = registry
    c.register_worker("w1", "tcp://10.0.0.1:7460", fingerprint(f"/models/llama#{OLD}"), epoch=1)
    c.register_worker("w2", "tcp://10.0.0.2:7460", fingerprint(f"/mnt/copy/llama#{OLD}", tp_size=4), epoch=1)
    c.events("w1", 1, 1, [BlockEvent("stored", CHAIN[:5])])
    c.events("w2", 1, 1, [BlockEvent("stored", CHAIN[:3])])
    code, out = admin(capsys, ep, "models")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["identity", "labels", "live/total", "worker_ids", "tp", "dtype",
                                              "blocks"]
    assert len(lines) == 3  # header, rule, one row; no split-label line: same weights under two paths is fine
    assert lines[2].split() == [OLD, "/mnt/copy/llama,", "/models/llama", "2/2", "w1,", "w2", "2,", "4", "bf16", "8"]
    doc = json.loads(admin(capsys, ep, "models", "--json")[1])
    assert doc["split_labels"] == {} and len(doc["models"]) == 1
    assert doc["models"][0]["labels"] == ["/mnt/copy/llama", "/models/llama"]


def test_admin_models_reports_a_label_split_between_identities(registry, capsys):
    ep, c, _ = registry
    c.register_worker("old-1", "tcp://10.0.0.1:7460", fingerprint(f"/models/llama#{OLD}"), epoch=1)
    c.register_worker("old-2", "tcp://10.0.0.2:7460", fingerprint(f"/models/llama#{OLD}"), epoch=1)
    c.register_worker("new-1", "tcp://10.0.0.3:7460", fingerprint(f"/models/llama#{NEW}"), epoch=1)
    c.register_worker("t1", "tcp://10.0.0.4:7460", fingerprint("tiny"), epoch=1)  # no label: all identity
    c.register_worker("t2", "tcp://10.0.0.5:7460", fingerprint("small"), epoch=1)  # ... and not a split
    c.events("new-1", 1, 1, [BlockEvent("stored", CHAIN[:6])])
    c.events("old-1", 1, 1, [BlockEvent("stored", CHAIN[:4])])
    code, out = admin(capsys, ep, "models")
    rows = [line.split()[:3] for line in out.splitlines()[2:7]]
    assert code == 0 and rows == [[NEW, "/models/llama", "1/1"], [OLD, "/models/llama", "2/2"],
                                  ["small", "-", "1/1"], ["tiny", "-", "1/1"], []]  # blocks desc, then identity
    assert out.splitlines()[7:] == [
        f"label /models/llama: 2 identities (different weights under one name: a rolling update, or diverged "
        f"copies): {OLD}, {NEW}"]
    doc = json.loads(admin(capsys, ep, "models", "--json")[1])
    assert doc["split_labels"] == {"/models/llama": [OLD, NEW]}
    assert [m["identity"] for m in doc["models"]] == [NEW, OLD, "small", "tiny"]


def test_admin_models_json_shape_and_dead_workers(registry, capsys):
    ep, c, now = registry
    c.register_worker("gone", "tcp://10.0.0.9:7460", fingerprint(f"/models/llama#{OLD}", dtype="fp16"), epoch=1)
    c.events("gone", 1, 1, [BlockEvent("stored", CHAIN[:7])])
    now[0] += 3  # its lease (2 s) lapses; the sweeper is asleep
    for i in range(1, 6):
        c.register_worker(f"w{i}", f"tcp://10.0.0.{i}:7460", fingerprint(f"/models/llama#{OLD}"), epoch=1)
    c.events("w1", 1, 1, [BlockEvent("stored", CHAIN[:2])])
    doc = json.loads(admin(capsys, ep, "models", "--json")[1])
    assert set(doc) == {"models", "split_labels"} and len(doc["models"]) == 1
    m = doc["models"][0]
    assert set(m) == {"identity", "no_identity", "labels", "workers", "live_workers", "blocks"}
    assert (m["identity"], m["labels"], m["live_workers"], m["blocks"]) == (OLD, ["/models/llama"], 5, 2)
    assert m["no_identity"] is None
    assert m["workers"][0] == {"worker_id": "w1", "live": True, "tp_size": 2, "blocks": 2, "dtype": "bf16",
                               "label": "/models/llama", "endpoint": "tcp://10.0.0.1:7460"}
    code, out = admin(capsys, ep, "models")
    assert code == 0 and out.splitlines()[2].split()[2:] == ["5/5", "w1,", "w2,", "w3", "+2", "more", "2", "bf16",
                                                            "2"]

    doc = json.loads(admin(capsys, ep, "models", "--all", "--json")[1])
    m = doc["models"][0]
    assert (m["live_workers"], len(m["workers"]), m["blocks"]) == (5, 6, 2)  # a dead worker's blocks don't count
    assert m["workers"][0] == {"worker_id": "gone", "live": False, "tp_size": 2, "blocks": 7, "dtype": "fp16",
                               "label": "/models/llama", "endpoint": "tcp://10.0.0.9:7460"}
    out = admin(capsys, ep, "models", "--all")[1]
    assert out.splitlines()[2].split()[2:] == ["5/6", "gone", "(dead),", "w1,", "w2", "+3", "more", "2", "bf16,",
                                               "fp16", "2"]


def test_admin_models_lists_an_instance_without_an_identity_and_why(registry, capsys):
    """An instance whose weights changed after its start registers under an identity of its own (it shares nothing):
    its own row, its reason, and no label split (it is not other weights under the name)."""
    from remote_g2.identity.model_identity import identity_of, unshared_kind, unshared_model_id

    ep, c, _ = registry
    a, b = unshared_model_id("/models/llama", "changed"), unshared_model_id("/models/llama", "changed")
    assert a != b and identity_of(a) != identity_of(b) and unshared_kind(a) == "changed"  # never one another's match
    assert unshared_kind(f"/models/llama#{OLD}") is None and unshared_kind("tiny") is None
    c.register_worker("ok", "tcp://10.0.0.1:7460", fingerprint(f"/models/llama#{OLD}"), epoch=1)
    c.register_worker("flipped", "unshared://flipped", fingerprint(a), epoch=1)
    c.events("ok", 1, 1, [BlockEvent("stored", CHAIN[:3])])
    code, out = admin(capsys, ep, "models")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 4 and "label" not in out.split("blocks", 1)[1]
    assert lines[2].split()[:3] == [OLD, "/models/llama", "1/1"]
    assert lines[3].split()[:6] == ["none", "(changed):", "shares", "nothing", "/models/llama", "1/1"]
    doc = json.loads(admin(capsys, ep, "models", "--json")[1])
    assert doc["split_labels"] == {}
    assert [(m["identity"], m["no_identity"]) for m in doc["models"]] == [(OLD, None), (identity_of(a), "changed")]
    # its compat key is no one else's: the blocks "ok" holds are not offered to it, nor would its be to anyone
    assert c.lookup(CHAIN[:3], compat_key=fingerprint(f"/models/llama#{OLD}").compat_key()).best.worker_id == "ok"
    assert c.lookup(CHAIN[:3], compat_key=fingerprint(a).compat_key()).best is None


def test_admin_models_empty_registry(registry, capsys):
    ep, _, _ = registry
    assert admin(capsys, ep, "models") == (0, "no workers registered\n")
    code, out = admin(capsys, ep, "models", "--json")
    assert code == 0 and json.loads(out) == {"models": [], "split_labels": {}}


SCRIPT = Path(sys.executable).parent / "remote-g2"


@pytest.mark.skipif(not SCRIPT.exists(), reason="package not installed in this venv (pip install -e .)")
def test_installed_entry_point():
    out = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("remote-g2 ")
