#!/usr/bin/env python
"""Per-token prediction latency of every predictor vs. the per-layer compute it must hide behind.

For each model of the profile, builds a tiny transformers MoE with the model's shape (Qwen3-MoE for
qwen-shaped models, DeepSeek-V2 with shared experts for deepseek-shaped ones: hidden size, experts, top-K,
expert width and heads as the stand-ins use them) and times ONE MoE decoder layer forward for one token
(seq len 1, no KV cache) — the window a next-layer prediction has to fit in. Each predictor's cost is one
``priorities`` call on a 1-token batch divided by the L−1 layer pairs it covers (the draft model predicts
every layer in one forward, so it is amortised the same way). Everything is timed interleaved (round-robin
over methods, ``--rounds`` times) in one process and reported as median ratios to the layer time: a paired
measurement, not absolute seconds.

Usage: python scripts/bench_predictors.py [--config config/config.yaml] [--rounds 30] [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from specprefetch import registry
from specprefetch.config import load_config, n_moe_layers
from specprefetch.predictors import PredictorDims, build_predictor

REPO = Path(__file__).resolve().parent.parent
# Every method but those that read the routing they predict (the oracle): plugins included.
METHODS = tuple(m.name for m in registry.methods().values() if not m.sees_future)


def build_layer(mcfg: dict[str, Any]) -> tuple[torch.nn.Module, Any, torch.nn.Module]:
    """(one MoE decoder layer, its rotary embedding, a config) of a tiny HF MoE with the model's shape."""
    from specprefetch.models.standins import _heads, moe_intermediate_size

    d = int(mcfg["hidden_size"])
    heads, kv, head_dim = _heads(d)
    n_layers = int(mcfg.get("first_dense_layers", 0)) + 1
    if mcfg["arch"].startswith("deepseek"):
        from transformers import DeepseekV2ForCausalLM

        from specprefetch.models.standins import deepseek_language_config

        conf = deepseek_language_config({**mcfg, "num_hidden_layers": n_layers},
                                        {"<|pad|>": 0, "<|endoftext|>": 1}, vocab=64)
        model = DeepseekV2ForCausalLM(conf)
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        conf = Qwen3MoeConfig(vocab_size=64, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=n_layers,
                              num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                              moe_intermediate_size=moe_intermediate_size(d), num_experts=int(mcfg["n_experts"]),
                              num_experts_per_tok=int(mcfg["top_k"]), max_position_embeddings=4096)
        model = Qwen3MoeForCausalLM(conf)
    model.eval()
    layer = model.model.layers[n_layers - 1]  # the (first) MoE layer
    return layer, model.model.rotary_emb, model


def one_token_batch(dims: PredictorDims) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": [torch.randn(1, dims.hidden_size, generator=g) for _ in range(dims.n_layers)],
        "logits": [torch.randn(1, dims.n_experts, generator=g) for _ in range(dims.n_layers)],
        "topk": [torch.randperm(dims.n_experts, generator=g)[: dims.top_k].unsqueeze(0)
                 for _ in range(dims.n_layers)],
        "token_ids": torch.tensor([5]),
        "sample_index": torch.tensor([0]),
        "position": torch.tensor([7], dtype=torch.int32),
        "is_image": torch.zeros(1, dtype=torch.uint8),
        "is_prompt": torch.zeros(1, dtype=torch.uint8),
    }


def time_call(fn: Any, reps: int) -> float:
    """Mean seconds of ``fn()`` over ``reps`` calls (after one warm-up call)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def bench_model(cfg: dict[str, Any], name: str, rounds: int, reps: int) -> list[dict[str, Any]]:
    mcfg = cfg["models"][name]
    dims = PredictorDims(n_layers=n_moe_layers(mcfg), hidden_size=int(mcfg["hidden_size"]),
                         n_experts=int(mcfg["n_experts"]), top_k=int(mcfg["top_k"]),
                         vocab_size=int((cfg.get("tokenizer") or {}).get("vocab_size", 4096)))
    torch.manual_seed(0)
    layer, rotary, _ = build_layer(mcfg)
    hidden = torch.randn(1, 1, dims.hidden_size)
    pos = torch.tensor([[7]])
    pe = rotary(hidden, pos)
    batch = one_token_batch(dims)
    preds = {m: build_predictor(m, cfg, dims).eval() for m in METHODS}
    if "frequency" in preds:
        preds["frequency"].counts.fill_(1.0)
    pairs = dims.n_pairs

    def run_layer() -> None:
        layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=pe)

    fns = {"moe_layer": run_layer}
    for m, p in preds.items():
        fns[m] = (lambda p=p: p.priorities(batch, "token"))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        for _ in range(rounds):
            for k, fn in fns.items():  # interleaved: drifts in machine load hit every method alike
                samples[k].append(time_call(fn, reps))
    layer_t = statistics.median(samples["moe_layer"])
    rows = [{"model": name, "method": "moe_layer", "per_layer_us": layer_t * 1e6, "ratio": 1.0,
             "trainable_params": None}]
    for m, p in preds.items():
        per_pair = [s / pairs for s in samples[m]]
        ratios = [s / pairs / lt for s, lt in zip(samples[m], samples["moe_layer"])]
        rows.append({"model": name, "method": m, "per_layer_us": statistics.median(per_pair) * 1e6,
                     "ratio": statistics.median(ratios), "trainable_params": p.trainable_params()})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    rows: list[dict[str, Any]] = []
    for name in cfg["models"]:
        rows += bench_model(cfg, name, args.rounds, args.reps)
    print(f"{'model':<20} {'method':<16} {'us/layer':>10} {'x layer':>8} {'params':>10}")
    for r in rows:
        params = "" if r["trainable_params"] is None else str(r["trainable_params"])
        print(f"{r['model']:<20} {r['method']:<16} {r['per_layer_us']:>10.1f} {r['ratio']:>8.3f} {params:>10}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
