"""CLI: ``extract-traces``, ``verify-traces``, ``trace-stats``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specprefetch.cli import add_config_arg, load_args_config


def _cmd_extract(args: argparse.Namespace) -> None:
    from specprefetch.traces.extract import extract_traces

    cfg = load_args_config(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    extract_traces(cfg, args.model, args.model_dir, args.workload_dir, args.out, device=args.device)


def _cmd_verify(args: argparse.Namespace) -> None:
    from specprefetch.traces.store import TraceReader

    summary = TraceReader(args.dir, verify=True).verify_all()
    print(f"{args.dir}: OK ({summary['shards']} shards, {summary['n_tokens']} tokens, "
          f"{summary['n_samples']} samples)")


def _cmd_stats(args: argparse.Namespace) -> None:
    from specprefetch.traces.store import trace_stats

    print(json.dumps(trace_stats(args.dir), indent=2, sort_keys=True))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract-traces", help="run a model over a workload and store its routing traces")
    add_config_arg(p)
    p.add_argument("--model", required=True, help="model name (a key of config.models)")
    p.add_argument("--model-dir", type=Path, default=None, help="local model directory (stand-ins; else the hub)")
    p.add_argument("--workload-dir", required=True, type=Path, help="workload directory (samples.jsonl)")
    p.add_argument("--out", required=True, type=Path, help="trace directory to write (atomically)")
    p.add_argument("--device", default="cpu", help="torch device for the forward passes")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (pass the rule's {threads}: on an oversubscribed CPU more threads "
                        "than free cores makes every op wait for a time slice)")
    p.set_defaults(func=_cmd_extract)

    p = sub.add_parser("verify-traces", help="check every file of a trace against its manifest (sha256)")
    p.add_argument("dir", type=Path)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("trace-stats", help="tokens, bytes per token and per layer, image-token share")
    p.add_argument("dir", type=Path)
    p.set_defaults(func=_cmd_stats)
