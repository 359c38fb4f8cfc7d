"""CLI: ``pretrain-stand-in`` (train a stand-in from scratch) and ``inspect-model`` (print its routing)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from specprefetch.stages.common import add_model_args, load_args_config

log = logging.getLogger(__name__)


def _cmd_pretrain(args: argparse.Namespace) -> None:
    from specprefetch.models.pretrain import pretrain_stand_in

    cfg = load_args_config(args)
    result = pretrain_stand_in(cfg, args.model, args.corpus, args.tokenizer, args.out)
    r, q = result["routing"], result["quality"]
    print(f"{args.model}: trained in {result['train_wall_s']:.0f} s -> {args.out}\n"
          f"  held-out LM loss {result['heldout_lm_loss']:.3f} nats/token (unigram baseline "
          f"{result['unigram']['unigram_heldout_xent_nats']:.3f}, corpus unigram entropy "
          f"{result['unigram']['unigram_entropy_nats']:.3f})\n"
          f"  max expert load share {q['max_load_share']:.3f} (uniform {r['uniform_load_share']:.3f}); "
          f"FATE recall@K {r['fate_recall_at_k']:.3f} (chance {r['chance_recall_at_k']:.3f})")


def _cmd_inspect(args: argparse.Namespace) -> None:
    from specprefetch.models.loading import load_bundle

    cfg = load_args_config(args)
    bundle = load_bundle(cfg, args.model, args.model_dir)
    info = {"model": args.model, "kind": bundle.kind, "model_class": type(bundle.model).__name__,
            "n_parameters": sum(p.numel() for p in bundle.model.parameters()), **bundle.routing.describe()}
    print(json.dumps(info, indent=2))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pretrain-stand-in", help="train a tiny MoE stand-in from scratch on the corpus")
    add_model_args(p, model_dir=False)
    p.add_argument("--corpus", required=True, type=Path, help="corpus directory (workload format)")
    p.add_argument("--tokenizer", required=True, type=Path, help="tokenizer directory (save_pretrained)")
    p.add_argument("--out", required=True, type=Path, help="output model directory (written atomically)")
    p.set_defaults(func=_cmd_pretrain)

    p = sub.add_parser("inspect-model", help="load a model and print its discovered MoE routing")
    add_model_args(p)
    p.set_defaults(func=_cmd_inspect)
