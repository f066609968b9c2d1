"""The remote-g2 command line, called in-process and as the installed script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import remote_g2
from remote_g2.cli import main
from remote_g2.rpc_server import RpcServer


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


SCRIPT = Path(sys.executable).parent / "remote-g2"


@pytest.mark.skipif(not SCRIPT.exists(), reason="package not installed in this venv (pip install -e .)")
def test_installed_entry_point():
    out = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("remote-g2 ")
