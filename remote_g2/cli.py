"""The ``remote-g2`` command line.

``main(argv) -> int`` so tests call it without a subprocess. Every command that
prints data takes ``--json`` (one JSON document on stdout, for scripts) and
otherwise prints a table for people. Errors print one line on stderr and exit
non-zero: 2 for usage/config errors, 1 for everything else.

Subcommands come from a table, not from this module: the entry points of
group ``remote_g2.commands`` in ``pyproject.toml`` (name → module), so the
core names none of the parts that provide commands (the registry's
``serve``/``admin``, the reference engine's ``demo``) and another package can
add its own. A command's module provides ``add_arguments(parser)`` and
``run(args) -> int`` and is imported only when its command runs, so
``remote-g2 --version`` stays instant. :data:`HELP` holds the one-line help
of the commands this package ships, so ``--help`` imports nothing either.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

import remote_g2
from remote_g2.errors import ConfigError, RemoteG2Error

__all__ = ["main", "commands", "COMMAND_GROUP", "HELP", "print_table", "print_json"]

#: The entry-point group that lists the commands (pyproject.toml, ``[project.entry-points."remote_g2.commands"]``).
COMMAND_GROUP = "remote_g2.commands"

#: command → one-line help, in the order ``--help`` lists them (commands of other packages follow, sorted)
HELP: dict[str, str] = {
    "serve": "run the block registry server",
    "admin": "query and manage the registry (workers, who-has, prefix, ...)",
    "ping": "check that a remote-g2 server answers, and who it is",
    "keygen": "write a CURVE key pair for authenticated TCP endpoints",
    "demo": "two reference engines on one box: remote KV reuse, checked bit for bit",
}


def commands() -> dict[str, str]:
    """Every command: name → the module that implements it, from the installed entry-point table."""
    found = {ep.name: ep.value for ep in entry_points(group=COMMAND_GROUP)}
    if not found:
        raise ConfigError(f"no {COMMAND_GROUP!r} entry points: remote-g2 is not installed (pip install -e .)")
    order = [n for n in HELP if n in found] + sorted(n for n in found if n not in HELP)
    return {name: found[name] for name in order}


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned table; numbers right-aligned, everything else left."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) and bool(rows) for i in range(len(headers))]
    for n, r in enumerate(cells):
        line = "  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        print(line.rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, bytes):
        return v.hex()
    return "-" if v is None else str(v)


def build_parser(modules: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remote-g2",
        description="Cross-worker reuse of host-pinned (G2) KV-cache blocks.",
    )
    parser.add_argument("--version", action="version", version=f"remote-g2 {remote_g2.__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR (env: REMOTE_G2_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands():
        help_text = HELP.get(name, "")
        p = sub.add_parser(name, help=help_text, description=help_text or None)
        if modules is not None and name in modules:
            modules[name].add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Only the chosen command's module is imported (its imports may be heavy).
    try:
        table = commands()
    except ConfigError as e:
        print(f"remote-g2: {e}", file=sys.stderr)
        return 2
    chosen = next((a for a in args_list if a in table), None)
    modules = {chosen: importlib.import_module(table[chosen])} if chosen else {}
    parser = build_parser(modules)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    from remote_g2.log import configure_logging

    try:
        configure_logging(args.log_level)
        return int(modules[args.command].run(args))
    except ConfigError as e:
        print(f"remote-g2 {args.command}: {e}", file=sys.stderr)
        return 2
    except RemoteG2Error as e:
        print(f"remote-g2 {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
