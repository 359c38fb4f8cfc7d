"""CLI: ``train-predictor``, ``evaluate-recall``, ``gather-recall``, ``gather-params``, ``measure-predictor-cost``."""

from __future__ import annotations

import argparse
from pathlib import Path

from specprefetch.io import SpecPrefetchError
from specprefetch.stages.common import add_config_arg, add_model_args, load_args_config


def _cmd_train(args: argparse.Namespace) -> None:
    from specprefetch.predictors.train import train_predictor

    cfg = load_args_config(args)
    meta = train_predictor(cfg, args.model, args.method, args.traces, args.out, model_dir=args.model_dir,
                           corpus_dir=args.corpus, seed_index=args.seed_index, lookahead=args.lookahead)
    loss = meta.get("final_loss")
    ahead = f", look-ahead {args.lookahead}" if args.lookahead != 1 else ""
    print(f"{args.method} (seed {args.seed_index}{ahead}) for {args.model}: {meta['trainable_params']} trainable "
          f"params, final loss {loss if loss is None else f'{loss:.4f}'}, {meta['wall_time_s']:.1f}s -> {args.out}")


def predictor_pairs(values: list[str]) -> list[tuple[str, Path]]:
    """``METHOD=DIR`` pairs in order; a method may repeat (one directory per seed: each meta.json says its seed,
    and evaluate_recall refuses a (method, seed) given twice); a malformed pair is an error naming it."""
    out: list[tuple[str, Path]] = []
    for v in values:
        method, sep, path = v.partition("=")
        method = method.strip()
        if not sep or not method or not path:
            raise SpecPrefetchError(f"invalid --predictor {v!r}: use METHOD=DIR")
        out.append((method, Path(path)))
    return out


def _cmd_evaluate(args: argparse.Namespace) -> None:
    from specprefetch.predictors.evaluate import evaluate_recall

    cfg = load_args_config(args)
    df = evaluate_recall(cfg, args.model, args.workload, args.traces, predictor_pairs(args.predictor),
                         args.out, candidates=args.candidates, by_lookahead=args.by_lookahead)
    print(df.to_string(index=False))


def _cmd_gather_recall(args: argparse.Namespace) -> None:
    from specprefetch.predictors.evaluate import gather_recall

    df = gather_recall(args.inputs, args.out, by_lookahead=args.by_lookahead)
    print(f"{len(df)} rows -> {args.out}")


def _cmd_gather_params(args: argparse.Namespace) -> None:
    from specprefetch.predictors.evaluate import gather_params

    df = gather_params(args.dirs, args.out)
    print(df.to_string(index=False))


def _cmd_cost(args: argparse.Namespace) -> None:
    from specprefetch.predictors.cost import measure_predictor_cost, write_predictor_cost

    rows = measure_predictor_cost(load_args_config(args), args.dirs, args.rounds, args.reps)
    df = write_predictor_cost(rows, args.out)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-predictor", help="train (or fit) one next-layer expert predictor")
    add_model_args(p)
    p.add_argument("--method", required=True, help="specprefetch, fate, single_mlp, promoe, draft_model, "
                                                    "previous_token, frequency or oracle")
    p.add_argument("--traces", type=Path, default=None, help="corpus trace directory")
    p.add_argument("--corpus", type=Path, default=None, help="corpus workload directory (source: online)")
    p.add_argument("--seed-index", type=int, default=0,
                   help="which of the predictors.seeds runs (trains with predictors.training.seed + index)")
    p.add_argument("--lookahead", type=int, default=1,
                   help="predict layer l+d from layer l (the paper's d = 1; more is beyond the paper)")
    p.add_argument("--out", required=True, type=Path, help="output predictor directory")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("evaluate-recall", help="ExpertRecall@M of saved predictors on one workload trace")
    add_model_args(p, model_dir=False)
    p.add_argument("--workload", required=True)
    p.add_argument("--traces", required=True, type=Path, help="the workload's trace directory")
    p.add_argument("--predictor", action="append", required=True, metavar="METHOD=DIR",
                   help="a saved predictor; a learned method once per seed")
    p.add_argument("--candidates", choices=("token", "batch"), default=None,
                   help="override recall.candidates from the config")
    p.add_argument("--by-lookahead", action="store_true",
                   help="predictors of several look-ahead distances: the lookahead contract (no per-layer file)")
    p.add_argument("--out", required=True, type=Path, help="output CSV (a _per_layer.csv is written beside it)")
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser("gather-recall", help="concatenate recall CSVs")
    p.add_argument("--by-lookahead", action="store_true", help="the look-ahead CSVs (evaluate-recall --by-lookahead)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("inputs", nargs="+", type=Path)
    p.set_defaults(func=_cmd_gather_recall)

    p = sub.add_parser("gather-params", help="trainable parameters of saved predictors (Table 3 data)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("dirs", nargs="+", type=Path)
    p.set_defaults(func=_cmd_gather_params)

    p = sub.add_parser("measure-predictor-cost",
                       help="each trained predictor's time per layer pair as a share of one MoE layer (Pareto)")
    add_config_arg(p)
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds (the CI is over them; >= 2)")
    p.add_argument("--reps", type=int, default=20, help="calls per function per round")
    p.add_argument("--out", required=True, type=Path, help="output CSV (contract predictor_cost)")
    p.add_argument("dirs", nargs="+", type=Path, help="trained predictor directories (one per model and method)")
    p.set_defaults(func=_cmd_cost)
