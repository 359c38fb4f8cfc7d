"""Command-line interface: one subcommand per pipeline stage, so any stage runs by hand.

Each stage (:mod:`specprefetch.stages`, one per ``workflow/rules/*.smk``) contributes its subcommands through
``register(subparsers)``; every subcommand takes ``--config`` (a profile YAML, validated) where it needs one
and writes its outputs atomically. The CLI imports the stages; nothing below it imports the CLI.
"""

from __future__ import annotations

import argparse
import logging
import sys

from specprefetch.io import SpecPrefetchError
from specprefetch.stages import data, device, models, predictors, render, traces
from specprefetch.stages.common import add_config_arg, load_args_config


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
    for stage in (data, models, traces, predictors, device, render):
        stage.register(sub)
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
