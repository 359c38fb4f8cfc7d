"""CLI subcommands of the data stage (the Snakemake rules in workflow/rules/data.smk call exactly these)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specprefetch.stages.common import add_config_arg, load_args_config

log = logging.getLogger(__name__)


def _cmd_prepare_workload(args: argparse.Namespace) -> None:
    from specprefetch.data.workloads import prepare_workload

    prepare_workload(load_args_config(args), args.workload, args.out)


def _cmd_prepare_corpus(args: argparse.Namespace) -> None:
    from specprefetch.data.corpus import prepare_train_corpus

    prepare_train_corpus(load_args_config(args), args.out)


def _cmd_train_tokenizer(args: argparse.Namespace) -> None:
    from specprefetch.data.tokenizer import train_tokenizer

    train_tokenizer(load_args_config(args), args.corpus, args.out)


def _cmd_check_disjoint(args: argparse.Namespace) -> None:
    from specprefetch.data.corpus import check_disjoint
    from specprefetch.io import write_json_atomic

    report = check_disjoint(args.corpus, args.workloads)
    n = sum(w["n_samples"] for w in report["workloads"].values())
    print(f"disjoint: {report['corpus']['n_samples']} corpus samples share no prompt, reference or image with "
          f"{n} samples of {len(report['workloads'])} workload(s)")
    if args.out is not None:
        write_json_atomic(args.out, report)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare-workload", help="build one evaluation workload directory")
    add_config_arg(p)
    p.add_argument("--workload", required=True, help="workload name (a key of workloads: in the config)")
    p.add_argument("--out", required=True, type=Path, help="output directory (written atomically)")
    p.set_defaults(func=_cmd_prepare_workload)

    p = sub.add_parser("prepare-corpus", help="build the predictors' training corpus")
    add_config_arg(p)
    p.add_argument("--out", required=True, type=Path, help="output directory (written atomically)")
    p.set_defaults(func=_cmd_prepare_corpus)

    p = sub.add_parser("train-tokenizer", help="train the stand-ins' byte-level BPE tokenizer on the corpus")
    add_config_arg(p)
    p.add_argument("--corpus", required=True, type=Path, help="corpus directory (prepare-corpus output)")
    p.add_argument("--out", required=True, type=Path, help="output directory (written atomically)")
    p.set_defaults(func=_cmd_train_tokenizer)

    p = sub.add_parser("check-disjoint", help="prove the corpus shares no sample with the evaluation workloads")
    p.add_argument("--corpus", required=True, type=Path, help="corpus directory")
    p.add_argument("--workloads", required=True, type=Path, nargs="+", help="workload directories")
    p.add_argument("--out", type=Path, default=None, help="optional JSON report (written atomically)")
    p.set_defaults(func=_cmd_check_disjoint)
