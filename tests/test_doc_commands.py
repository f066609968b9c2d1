"""Every command line README.md and docs/*.md show is one the CLI accepts.

A command is a line of a fenced shell block, or an inline `code span`, that
runs one of the project's programs: the console scripts of pyproject.toml's
``[project.scripts]`` (``remote-g2``), ``python -m remote_g2…``, the
benches (``python -m bench…``) and the checkout's ``*.py`` scripts, also behind ``$ ``, ``VAR=value``,
``mpiexec -n N`` and ``.venv/bin/``, continued with ``\\``, chained with
``&&``. Each is handed to the program's own entry point, which runs until it
calls argparse: the parser it built then parses the doc's arguments (a usage
error fails the test, named by doc and line).

Run for real: ``remote-g2 keygen`` (into a temporary directory: the files it
writes must be the ones the line's comment and the rest of its line name),
``--help``/``--version`` forms, and ``admin``/``ping`` lines aimed at a local
registry (against a live embedded one). ``make T`` must name a Makefile
target; every ``REMOTE_G2_*`` variable a doc names must occur in the code.

Inline spans that only mention a program or an option (``remote-g2 admin``,
``remote-g2 serve --bind``, ``HASH… --all``) are checked by name: each
subcommand and option must exist in the parser.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import re
import runpy
import shlex
import socket
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
#: fenced blocks in these languages hold no shell commands
NOT_SHELL = {"python", "py", "json", "yaml", "yml", "toml", "mermaid", "c", "cpp", "c++", "lua", "ini", "diff"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
#: a token standing for "more arguments, as elsewhere"
ELLIPSES = {"…", "..."}


@dataclass
class DocCommand:
    doc: str  # path relative to the repo
    line: int
    text: str  # the logical line as the doc shows it (continuations joined)
    kind: str  # "script" (console script), "module" (python -m), "path" (a .py file), "make"
    program: str  # the script name, module name, file path, or "make"
    args: list[str]
    inline: bool
    comment: str = ""
    env: dict[str, str] = field(default_factory=dict)
    chain: list[list[str]] = field(default_factory=list)  # every segment's tokens on this line

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}:{' '.join([self.program, *self.args])[:60]}"

    @property
    def name_only(self) -> bool:
        """A mention, not an invocation: an ellipsis, or an option given without its value (checked by name)."""
        return any(a in ELLIPSES for a in self.args) or bool(self.inline and self.args and _wants_value(self.args[-1]))


def _wants_value(token: str) -> bool:
    """An option at the end of a span with no value: ``--bind`` in `remote-g2 serve --bind` (unknown here: guess)."""
    return token.startswith("--") and "=" not in token and token not in {"--json", "--all", "--holders", "--help",
                                                                          "--version", "--mla", "--source", "--target"}


# ---------------------------------------------------------------- extraction


def _tokens(text: str) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def _segments(tokens: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for t in tokens:
        if t in SEPARATORS:
            out.append([])
        else:
            out[-1].append(t)
    return [s for s in out if s]


def _placeholder(token: str) -> str:
    """``HASH…`` (one or more hashes) parses as ``HASH``."""
    return token[:-1] if len(token) > 1 and token.endswith("…") else token


def _classify(tokens: list[str]) -> tuple[str, str, list[str], dict[str, str]] | None:
    """(kind, program, args, env) when ``tokens`` run one of the project's programs, else None."""
    env: dict[str, str] = {}
    toks = list(tokens)
    while toks and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", toks[0]):
        k, v = toks.pop(0).split("=", 1)
        env[k] = v
    if toks and Path(toks[0]).name in {"mpiexec", "mpirun"}:
        toks.pop(0)
        while toks and toks[0].startswith("-"):
            opt = toks.pop(0)
            if opt in {"-n", "-np"} and toks:
                toks.pop(0)
    if not toks:
        return None
    prog, args = Path(toks[0]).name, [_placeholder(a) for a in toks[1:]]
    if prog in SCRIPTS:
        return "script", prog, args, env
    if prog == "make":
        return "make", "make", args, env
    if re.fullmatch(r"python(3(\.\d+)?)?", prog):
        if len(args) >= 2 and args[0] == "-m":
            mod = args[1]
            return ("module", mod, args[2:], env) if mod.split(".")[0] in ("remote_g2", "bench") else None
        if args and args[0].endswith(".py") and (ROOT / args[0]).is_file():
            return "path", args[0], args[1:], env
        return None
    if args and toks[0].endswith(".py") and (ROOT / toks[0]).is_file() \
            and "__main__" in (ROOT / toks[0]).read_text():  # not a mere mention of a source file
        return "path", toks[0], args, env
    return None


def _commands_in(text: str, doc: str, line: int, inline: bool) -> Iterator[DocCommand]:
    text = re.sub(r"^\$\s+", "", text.strip())
    comment = text.split(" #", 1)[1] if " #" in text else ""
    try:
        tokens = _tokens(text)
    except ValueError:  # unbalanced quotes: prose, not a command
        return
    chain = _segments(tokens)
    for seg in chain:
        found = _classify(seg)
        if found is None:
            continue
        kind, program, args, env = found
        # `python -m bench.plot {pool,holder,…} …`: one command per alternative
        alternatives = [re.fullmatch(r"\{([^{}]+)\}", a).group(1).split(",") if re.fullmatch(r"\{[^{}]+\}", a)
                        else [a] for a in args]
        for expanded in itertools.product(*alternatives):
            yield DocCommand(doc, line, text, kind, program, list(expanded), inline, comment, env, chain)


def doc_commands(path: Path) -> list[DocCommand]:
    doc = str(path.relative_to(ROOT))
    out: list[DocCommand] = []
    fence: str | None = None  # the open fence's language, None outside one
    pending, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"\s*```\s*([\w+-]*)", raw)
        if m:
            fence = None if fence is not None else m.group(1).lower()
            continue
        if fence is not None:
            if fence in NOT_SHELL:
                continue
            if not pending:
                start = n
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            out.extend(_commands_in(pending + raw, doc, start, inline=False))
            pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", raw):
                out.extend(_commands_in(span, doc, n, inline=True))
    return out


ALL = [c for d in DOCS for c in doc_commands(d)]
PROGRAMS = [c for c in ALL if c.kind != "make"]
MAKES = [c for c in ALL if c.kind == "make"]


def test_the_docs_show_commands_of_every_kind():
    """The extraction finds what the docs are known to show (a broken extractor would pass everything)."""
    kinds = {(c.kind, c.program) for c in ALL}
    assert {("script", "remote-g2"), ("module", "remote_g2.adapters.reference.server"), ("make", "make")} <= kinds
    assert any(kind == "module" and program.startswith("bench.") for kind, program in kinds)  # (the benches)
    assert any(c.kind == "path" for c in ALL)
    keygen = [c for c in ALL if c.kind == "script" and c.args[:1] == ["keygen"]]
    assert any(c.doc == "docs/security.md" for c in keygen) and any(c.doc == "README.md" for c in keygen)
    assert len([c for c in PROGRAMS if not c.inline]) >= 25


# ---------------------------------------------------------------- parsing with the program's own parser


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser, args: Any) -> None:
        self.parser, self.argv = parser, args


@contextmanager
def _stop_at_first_parse() -> Iterator[None]:
    """The program's first ``parse_known_args`` (``parse_args`` calls it) raises the parser it was called on."""
    def capture(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Captured(self, args)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        yield


def program_parser(cmd: DocCommand) -> argparse.ArgumentParser:
    """Run the program's real entry point with ``cmd.args`` until it builds its parser; return that parser."""
    argv = [cmd.program, *cmd.args]
    saved_path = list(sys.path)
    try:
        with _stop_at_first_parse(), mock.patch.object(sys, "argv", argv), \
                redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            if cmd.kind == "script":
                module, func = SCRIPTS[cmd.program].split(":")
                getattr(__import__(module, fromlist=[func]), func)()
            elif cmd.kind == "module":
                runpy.run_module(cmd.program, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, str((ROOT / cmd.program).parent))
                runpy.run_path(str(ROOT / cmd.program), run_name="__main__")
    except _Captured as c:
        # The parser must be the one that parses these arguments (not some inner helper's).
        assert c.argv is None or list(c.argv) == cmd.args, f"{cmd.program} parsed {c.argv}, not {cmd.args}"
        return c.parser
    except SystemExit as e:
        pytest.fail(f"{cmd.program} exited {e.code} before parsing its arguments")
    finally:
        sys.path[:] = saved_path
    pytest.fail(f"{cmd.program} returned without parsing any arguments")


def parse(parser: argparse.ArgumentParser, args: list[str]) -> tuple[int, str]:
    """(0, "") when ``parser`` accepts ``args`` (``--help``/``--version`` included), else (exit code, message)."""
    err = io.StringIO()
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            parser.parse_args(args)
    except SystemExit as e:
        return int(e.code or 0), err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else ""
    return 0, ""


def check_names(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """Every option of ``args`` exists where it stands, and every subcommand: for mentions, not invocations."""
    problems = []
    chose_command = False
    i = 0
    while i < len(args):
        t = args[i]
        i += 1
        if t in ELLIPSES:
            continue
        if t.startswith("-") and t != "-":
            action = parser._option_string_actions.get(t.split("=", 1)[0])
            if action is None:
                problems.append(f"{parser.prog} has no option {t.split('=', 1)[0]}")
            elif action.nargs != 0 and "=" not in t:
                i += 1
            continue
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None and not chose_command:
            if t not in sub.choices:
                problems.append(f"{parser.prog} has no command {t!r}")
                break
            parser, chose_command = sub.choices[t], False
    return problems


@pytest.mark.parametrize("cmd", PROGRAMS, ids=lambda c: c.id)
def test_doc_command_parses(cmd: DocCommand):
    parser = program_parser(cmd)
    if cmd.name_only or (cmd.inline and _only_commands(parser, cmd.args)):
        assert check_names(parser, cmd.args) == [], f"{cmd.doc}:{cmd.line}: `{cmd.text}`"
        return
    code, message = parse(parser, cmd.args)
    assert code == 0, f"{cmd.doc}:{cmd.line}: `{cmd.text}` is refused by {cmd.program}: {message}"


def _only_commands(parser: argparse.ArgumentParser, args: list[str]) -> bool:
    """`remote-g2 admin` in prose names a command; it is not a command line missing its subcommand."""
    for t in args:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or t not in sub.choices:
            return False
        parser = sub.choices[t]
    return True


# ---------------------------------------------------------------- run for real


def _script(name: str) -> list[str]:
    exe = Path(sys.executable).parent / name
    return [str(exe)] if exe.exists() else [sys.executable, "-m", SCRIPTS[name].split(":")[0]]


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=60)


KEYGEN = [c for c in PROGRAMS if c.kind == "script" and c.args[:1] == ["keygen"] and len(c.args) > 1]


@pytest.mark.parametrize("cmd", KEYGEN, ids=lambda c: c.id)
def test_doc_keygen_runs_and_writes_the_files_the_doc_names(cmd: DocCommand, tmp_path: Path):
    """Absolute directories land under tmp_path; the line's comment and later commands name files it wrote."""
    def local(p: str) -> str:
        return str(tmp_path / p.lstrip("/")) if p.startswith("/") else p

    parser = program_parser(cmd)
    code, message = parse(parser, cmd.args)
    assert code == 0, f"{cmd.doc}:{cmd.line}: `{cmd.text}` is refused: {message}"
    ns = parser.parse_args(cmd.args)
    args = [local(a) if a == ns.directory else a for a in cmd.args]
    r = _run([*_script(cmd.program), *args], tmp_path)
    assert r.returncode == 0, f"{cmd.doc}:{cmd.line}: `{cmd.text}` exited {r.returncode}: {r.stderr}"
    keydir = tmp_path / local(ns.directory)
    secret = keydir / f"{ns.name}.key_secret"
    assert (keydir / f"{ns.name}.key").is_file() and secret.is_file(), r.stdout
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    for named in re.findall(r"[\w.-]+\.key(?:_secret)?\b", cmd.comment):
        assert (keydir / named).is_file(), f"{cmd.doc}:{cmd.line}: the comment names {named}; keygen wrote " \
                                           f"{sorted(p.name for p in keydir.iterdir())}"
    for token in itertools.chain.from_iterable(cmd.chain):
        if token.startswith(ns.directory.rstrip("/") + "/"):
            assert (tmp_path / local(token)).exists(), f"{cmd.doc}:{cmd.line}: `{cmd.text}` uses {token}, " \
                                                       f"which keygen did not write"


HELP = [c for c in PROGRAMS if c.kind == "script" and not c.name_only
        and {"--help", "-h", "--version"} & set(c.args)]


@pytest.mark.parametrize("cmd", HELP, ids=lambda c: c.id)
def test_doc_help_and_version_forms_run(cmd: DocCommand, tmp_path: Path):
    r = _run([*_script(cmd.program), *cmd.args], tmp_path)
    assert r.returncode == 0 and r.stdout.strip(), f"{cmd.doc}:{cmd.line}: `{cmd.text}`: {r.returncode} {r.stderr}"


LOCAL = "tcp://127.0.0.1:7450"


def _runs_against_a_local_registry(c: DocCommand) -> bool:
    if c.kind != "script" or c.name_only or c.args[:1] not in (["admin"], ["ping"]):
        return False
    if c.args[0] == "admin" and not [a for a in c.args[1:] if not a.startswith("-") and a != LOCAL]:
        return False  # `remote-g2 admin` in prose: the command's name
    if c.args[:2] == ["admin", "score"]:
        return False  # asks the scoring API over HTTP, not the registry: run in tests/test_score_api.py
    no_placeholders = not any(re.fullmatch(r"[A-Z][A-Z0-9_]*", a) for a in c.args)
    return no_placeholders and all(a == LOCAL for a in c.args if a.startswith("tcp://"))


LIVE = [c for c in PROGRAMS if _runs_against_a_local_registry(c)]


@pytest.fixture(scope="module")
def live_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen([*_script("remote-g2"), "serve", "--bind", endpoint, "--feed-bind", "none"],
                            cwd=tmp_path_factory.mktemp("serve"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while _run([*_script("remote-g2"), "ping", endpoint, "--timeout-ms", "500"], ROOT).returncode != 0:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "remote-g2 serve did not answer ping"
            time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("cmd", LIVE, ids=lambda c: c.id)
def test_doc_admin_and_ping_lines_run_against_a_registry(cmd: DocCommand, live_registry: str, tmp_path: Path):
    """Exit 0, or 1 for an unknown worker (the docs' examples name workers this registry never saw)."""
    args = [live_registry if a == LOCAL else a for a in cmd.args]
    r = _run([*_script(cmd.program), *args], tmp_path, {"REMOTE_G2_REGISTRY": live_registry})
    unknown_worker = r.returncode == 1 and "unknown worker" in r.stdout + r.stderr
    assert r.returncode == 0 or unknown_worker, \
        f"{cmd.doc}:{cmd.line}: `{cmd.text}` exited {r.returncode}: {r.stdout[-300:]} {r.stderr[-500:]}"


# ---------------------------------------------------------------- make targets and environment variables


def _make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


@pytest.mark.parametrize("cmd", MAKES, ids=lambda c: c.id)
def test_doc_make_targets_exist(cmd: DocCommand):
    named = [a for a in cmd.args if not a.startswith("-") and "=" not in a and a not in ELLIPSES]
    assert named, f"{cmd.doc}:{cmd.line}: `{cmd.text}` names no target"
    missing = sorted(set(named) - _make_targets())
    assert not missing, f"{cmd.doc}:{cmd.line}: `{cmd.text}`: no Makefile target {missing}"


def _doc_env_vars() -> dict[str, str]:
    """``REMOTE_G2_*`` name → first doc:line naming it (``REMOTE_G2_SOURCE_*`` is a prefix)."""
    found: dict[str, str] = {}
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"\bREMOTE_G2_[A-Z0-9_]*[A-Z0-9]\b", line):
                found.setdefault(name, f"{path.relative_to(ROOT)}:{n}")
    return found


def _code_text() -> str:
    this = Path(__file__).resolve()
    files = [p for d in ("remote_g2", "registry", "source", "target", "adapters", "bench", "tools", "tests")
             for p in (ROOT / d).rglob("*.py") if p.resolve() != this]
    return "\n".join(p.read_text(errors="replace") for p in files)


DOC_ENV = _doc_env_vars()


@pytest.fixture(scope="module")
def code_text() -> str:
    return _code_text()


@pytest.mark.parametrize("name", sorted(DOC_ENV), ids=lambda n: f"{DOC_ENV[n]}:{n}")
def test_doc_env_vars_exist_in_the_code(name: str, code_text: str):
    assert re.search(rf"\b{name}\b", code_text), f"{DOC_ENV[name]}: {name} occurs nowhere in the code"
