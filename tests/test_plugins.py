"""remote_g2/plugins.py: the adapter table — adapters by kind and name, imported only when loaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest

from remote_g2 import plugins
from remote_g2.errors import ConfigError
from remote_g2.plugins import available_adapters, load_adapter, register_adapter


@pytest.fixture(autouse=True)
def private_registry(monkeypatch):
    """Each test registers into a copy, so the shipped table is never polluted."""
    monkeypatch.setattr(plugins, "_entries", dict(plugins._entries))


@pytest.fixture
def thirdparty(tmp_path, monkeypatch) -> str:
    """The name of a fresh importable module defining ``MyPool``, not imported yet."""
    name = f"rg2_thirdparty_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text("class MyPool:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_shipped_adapters_are_listed():
    assert "host" in available_adapters("pool")
    everything = available_adapters()
    assert set(everything) == {"pool", "engine", "transfer"}
    assert everything["pool"] == available_adapters("pool")


def test_host_pool_loads_lazily():
    # A fresh interpreter: importing the adapter table must not import the adapter or torch.
    code = textwrap.dedent("""
        import sys
        from remote_g2.plugins import load_adapter
        assert "remote_g2.adapters.host_pool" not in sys.modules
        assert "torch" not in sys.modules
        cls = load_adapter("pool", "host")
        from remote_g2.adapters.host_pool import HostPool
        assert cls is HostPool
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_registration_imports_nothing_until_load(thirdparty):
    register_adapter("engine", "mine", thirdparty, "MyPool")
    assert thirdparty not in sys.modules
    assert "mine" in available_adapters("engine")
    cls = load_adapter("engine", "mine")
    assert cls.__name__ == "MyPool" and cls.__module__ == thirdparty
    assert load_adapter("engine", "mine") is cls


def test_unknown_name_lists_known_names():
    register_adapter("pool", "other", "remote_g2.adapters.host_pool", "HostPool")
    with pytest.raises(ConfigError) as err:
        load_adapter("pool", "nope")
    message = str(err.value)
    assert "'nope'" in message and "host" in message and "other" in message


def test_unknown_kind():
    with pytest.raises(ConfigError, match="kinds are pool, engine, transfer"):
        load_adapter("storage", "host")
    with pytest.raises(ConfigError, match="kinds are pool, engine, transfer"):
        register_adapter("storage", "x", "m", "A")
    with pytest.raises(ConfigError, match="kinds are pool, engine, transfer"):
        available_adapters("storage")


def test_duplicate_registration_is_an_error():
    with pytest.raises(ConfigError, match="already registered"):
        register_adapter("pool", "host", "somewhere.else", "Other")
    # The same name under another kind is a different adapter.
    register_adapter("transfer", "host", "remote_g2.adapters.host_pool", "HostPool")
    assert load_adapter("pool", "host") is load_adapter("transfer", "host")


@pytest.mark.parametrize("bad", [("", "m", "A"), ("a:b", "m", "A"), ("x", "", "A"), ("x", "m", "")])
def test_malformed_registration(bad):
    with pytest.raises(ConfigError, match="bad adapter registration"):
        register_adapter("pool", *bad)


def test_module_path_override_for_unknown_names(thirdparty):
    # vLLM's rule: a plain module path loads the attribute named like the adapter.
    cls = load_adapter("pool", "MyPool", module_path=thirdparty)
    assert cls.__module__ == thirdparty
    # "module:Attr" as module_path names the attribute itself.
    assert load_adapter("pool", "whatever", module_path=f"{thirdparty}:MyPool") is cls
    # The settings string form needs no module_path.
    assert load_adapter("pool", f"{thirdparty}:MyPool") is cls
    # A registered name wins over module_path.
    from remote_g2.adapters.host_pool import HostPool
    assert load_adapter("pool", "host", module_path=thirdparty) is HostPool


def test_import_and_attribute_failures_are_config_errors(thirdparty):
    register_adapter("transfer", "broken", "rg2_no_such_module_anywhere", "X")
    with pytest.raises(ConfigError, match="cannot import") as err:
        load_adapter("transfer", "broken")
    assert isinstance(err.value.__cause__, ModuleNotFoundError)
    assert "broken" in str(err.value)

    with pytest.raises(ConfigError, match="no attribute 'Missing'") as err:
        load_adapter("pool", f"{thirdparty}:Missing")
    assert isinstance(err.value.__cause__, AttributeError)
    assert "host" in str(err.value)  # still lists the known names

    with pytest.raises(ConfigError, match="no attribute 'Nope'"):
        load_adapter("pool", "Nope", module_path=thirdparty)


@pytest.mark.parametrize("spec", [":MyPool", "mod:", "a:b:c"])
def test_malformed_spec(spec):
    with pytest.raises(ConfigError, match="expected 'package.module:ClassName'"):
        load_adapter("pool", spec)
