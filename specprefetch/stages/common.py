"""What every stage's commands share: the ``--config`` argument and the ``--predictor METHOD=DIR`` list."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specprefetch.io import SpecPrefetchError


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="profile YAML (e.g. config/config.yaml)")


def add_model_args(parser: argparse.ArgumentParser, model_dir: bool = True) -> None:
    """``--config``, ``--model`` (a key of config.models) and, for commands that load it, ``--model-dir``."""
    add_config_arg(parser)
    parser.add_argument("--model", required=True, help="model name (a key of config.models)")
    if model_dir:
        parser.add_argument("--model-dir", type=Path, default=None,
                            help="stand-in or local checkpoint directory (default: the hub id of the config)")


def load_args_config(args: argparse.Namespace) -> dict[str, Any]:
    from specprefetch.config import load_config

    return load_config(args.config)


def parse_predictor_args(values: list[str]) -> dict[str, Path]:
    """``METHOD=DIR`` pairs -> {method: dir}; a malformed or repeated method is an error naming it."""
    out: dict[str, Path] = {}
    for v in values:
        method, sep, path = v.partition("=")
        method = method.strip()
        if not sep or not method or not path:
            raise SpecPrefetchError(f"invalid --predictor {v!r}: use METHOD=DIR")
        if method in out:
            raise SpecPrefetchError(f"--predictor {method} given twice")
        out[method] = Path(path)
    return out
