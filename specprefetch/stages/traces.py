"""CLI: ``extract-traces``, ``gather-traces``, ``verify-traces``, ``trace-stats``, ``measure-realism``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specprefetch.stages.common import add_config_arg, add_model_args, load_args_config


def _cmd_extract(args: argparse.Namespace) -> None:
    from specprefetch.traces.extract import extract_traces

    cfg = load_args_config(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    extract_traces(cfg, args.model, args.model_dir, args.workload_dir, args.out, device=args.device,
                   shard=args.shard)


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need 0 <= I < N")
    return i, n


def _cmd_gather(args: argparse.Namespace) -> None:
    from specprefetch.traces.store import gather_traces

    stats = gather_traces(args.shards, args.out)
    print(f"{args.out}: {len(args.shards)} scatter shard(s), {stats['n_tokens']} tokens")


def _cmd_verify(args: argparse.Namespace) -> None:
    from specprefetch.traces.store import TraceReader

    summary = TraceReader(args.dir, verify=True).verify_all()
    print(f"{args.dir}: OK ({summary['shards']} shards, {summary['n_tokens']} tokens, "
          f"{summary['n_samples']} samples)")


def _cmd_stats(args: argparse.Namespace) -> None:
    from specprefetch.traces.store import trace_stats

    print(json.dumps(trace_stats(args.dir), indent=2, sort_keys=True))
    # stdout stays the JSON; the caveat goes to stderr so that a flipped byte is not read as "checked"
    print(f"{args.dir}: file sizes match the manifest; contents not hashed (verify-traces checks every sha256)",
          file=sys.stderr)


def _cmd_estimate(args: argparse.Namespace) -> None:
    from specprefetch.traces.sizing import estimate, render_estimate, trace_sets

    cfg = load_args_config(args)
    samples = {}
    for item in args.samples or []:
        name, _, n = item.partition("=")
        if not n.isdigit():
            raise SystemExit(f"--samples {item!r}: expected WORKLOAD=N")
        samples[name] = int(n)
    sets = trace_sets(cfg, args.results, samples)
    rows = estimate(cfg, args.results, samples, args.extract_tokens_per_s, args.read_gb_per_s * 1e9, sets=sets)
    print(render_estimate(cfg, rows, sets))


def _cmd_realism(args: argparse.Namespace) -> None:
    from specprefetch.traces.realism import measure_realism, write_realism

    cfg = load_args_config(args)
    df = write_realism(measure_realism(args.traces, models=list(cfg["models"])), args.out)
    print(df.to_string(index=False))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract-traces", help="run a model over a workload and store its routing traces")
    add_model_args(p)
    p.add_argument("--workload-dir", required=True, type=Path, help="workload directory (samples.jsonl)")
    p.add_argument("--out", required=True, type=Path, help="trace directory to write (atomically)")
    p.add_argument("--device", default="cpu", help="torch device for the forward passes")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (pass the rule's {threads}: on an oversubscribed CPU more threads "
                        "than free cores makes every op wait for a time slice)")
    p.add_argument("--shard", type=_parse_shard, default=None, metavar="I/N",
                   help="extract only scatter shard I of N (a contiguous range of samples); join with gather-traces")
    p.set_defaults(func=_cmd_extract)

    p = sub.add_parser("gather-traces", help="join the scatter shards of one trace set (extract-traces --shard) "
                                             "into the trace one job would have written (verified)")
    p.add_argument("shards", nargs="+", type=Path, help="the shard trace directories, shards 0..N-1")
    p.add_argument("--out", required=True, type=Path, help="trace directory to write (atomically)")
    p.set_defaults(func=_cmd_gather)

    p = sub.add_parser("estimate-resources", help="size a run before launching it: per trace set and rule, the "
                                                  "tokens, storage and GPU-hours a profile needs")
    add_config_arg(p)
    p.add_argument("--results", type=Path, default=Path("results"),
                   help="measure tokens from the traces already here (default results/)")
    p.add_argument("--samples", action="append", metavar="WORKLOAD=N", help="override a workload's sample count")
    p.add_argument("--extract-tokens-per-s", type=float, default=2000.0,
                   help="trace-extraction throughput per GPU (default 2000, an assumption: measure it)")
    p.add_argument("--read-gb-per-s", type=float, default=1.5, help="trace read bandwidth (default 1.5 GB/s)")
    p.set_defaults(func=_cmd_estimate)

    p = sub.add_parser("measure-realism", help="how real the models' routing is, from their traces: FATE R@K, "
                                                "adjacent router-input cosine, expert-load entropy, by token type")
    add_config_arg(p)
    p.add_argument("--out", required=True, type=Path, help="the realism CSV to write (atomically)")
    p.add_argument("traces", nargs="+", type=Path, help="trace directories (the scatter shards of one set are joined)")
    p.set_defaults(func=_cmd_realism)

    p = sub.add_parser("verify-traces", help="check every file of a trace against its manifest (sha256)")
    p.add_argument("dir", type=Path)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("trace-stats", help="tokens, bytes per token and per layer, image-token share (checks "
                       "sizes only; verify-traces checks the sha256 of every file)")
    p.add_argument("dir", type=Path)
    p.set_defaults(func=_cmd_stats)
