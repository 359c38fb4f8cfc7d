"""Command-line interface: one subcommand per pipeline stage, so any stage runs by hand.

Each library package contributes its subcommands through a ``commands`` module with a
``register(subparsers)`` function; every subcommand takes ``--config`` (a profile YAML, validated)
and writes its outputs atomically.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Any

from specprefetch.io import SpecPrefetchError

COMMAND_MODULES = (
    "specprefetch.data.commands",
    "specprefetch.models.commands",
    "specprefetch.traces.commands",
    "specprefetch.predictors.commands",
    "specprefetch.runtime.commands",
    "specprefetch.render.commands",
)


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="profile YAML (e.g. config/config.yaml)")


def load_args_config(args: argparse.Namespace) -> dict[str, Any]:
    from specprefetch.config import load_config

    return load_config(args.config)


def _cmd_validate_config(args: argparse.Namespace) -> None:
    cfg = load_args_config(args)
    print(f"{args.config}: valid ({cfg['profile']} profile, {len(cfg['models'])} models, "
          f"{len(cfg['workloads'])} workloads)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specprefetch", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("validate-config", help="validate a profile YAML against the schema and semantics")
    add_config_arg(p)
    p.set_defaults(func=_cmd_validate_config)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that stage is not part of this build
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args.func(args)
    except SpecPrefetchError as exc:
        return _fail(args.command, str(exc))
    except OSError as exc:  # a full disk, a read-only or vanished directory: the OS's reason and the file
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(args.command, f"{where}{exc.strerror or exc}")
    except KeyboardInterrupt:
        print(f"specprefetch {args.command}: interrupted (outputs are written atomically: none was left "
              "half-written)", file=sys.stderr)
        return 130
    return 0


def _fail(command: str, message: str) -> int:
    """One line on stderr (a message that spans lines is joined), exit status 2."""
    print(f"specprefetch {command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
