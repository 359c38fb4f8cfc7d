"""Per-token prediction cost of every trained predictor against the MoE layer compute it has to hide behind.

The Pareto figure (``fig_pareto``, beyond the paper) sets each method's recall against its trainable parameters
and against this cost. For each model one MoE decoder layer of the model's shape is built from transformers' own
classes (Qwen3-MoE for Qwen-shaped models, DeepSeek-V2 with its shared experts for DeepSeek-shaped ones; the
stand-ins' head and expert widths, :mod:`specprefetch.models.standins`, randomly initialised: the cost is the
shape's) and one forward of one token through it (no KV cache) is timed: the compute a next-layer prediction
overlaps. Each predictor is the pipeline's trained one (seed 0 of its method, loaded from its directory, so its
architecture and parameter count are Table 3's); its cost is one ``priorities`` call on a one-token batch divided
by the L-1 layer pairs it covers (the draft model predicts every layer in one forward, so it is amortised the same
way).

Everything is timed interleaved (a round calls the layer and every method ``reps`` times each, in turn; ``rounds``
rounds) in one process with one thread, so a drift in the machine's load hits every method alike; the reported
``ratio`` is the mean over rounds of (prediction time per layer pair) / (layer time of the same round), with its
percentile-bootstrap 95 % CI over rounds: a paired measurement, not absolute seconds (``predict_us`` and
``layer_us`` are the medians, for scale).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm import tqdm

from specprefetch import registry
from specprefetch.contracts import COST_COLUMNS, check_csv
from specprefetch.io import SpecPrefetchError, atomic_path
from specprefetch.metrics import bootstrap_ci
from specprefetch.predictors.base import Predictor, PredictorDims, load_predictor, read_meta

log = logging.getLogger(__name__)

ROUNDS = 20  # interleaved rounds (the CI is over them)
REPS = 20  # calls per function per round (their mean is one sample)


def build_layer(mcfg: Mapping[str, Any]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(one MoE decoder layer, its rotary embedding) of a transformers MoE with the model's shape."""
    from specprefetch.models.standins import _heads, moe_intermediate_size

    d = int(mcfg["hidden_size"])
    heads, kv, head_dim = _heads(d)
    n_layers = int(mcfg.get("first_dense_layers", 0)) + 1
    if str(mcfg["arch"]).startswith("deepseek"):
        from transformers import DeepseekV2ForCausalLM

        from specprefetch.models.standins import deepseek_language_config

        # a hub model's config has no stand-in pretraining section: its positions are max_length's
        conf = deepseek_language_config({"pretrain": {"seq_len": 1}, **mcfg, "num_hidden_layers": n_layers},
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
    return model.model.layers[n_layers - 1], model.model.rotary_emb  # the (first) MoE layer


def one_token_batch(dims: PredictorDims) -> dict[str, Any]:
    """A decode step's predictor inputs for one token (random values of the right shapes; seeded)."""
    g = torch.Generator().manual_seed(0)
    return {
        "x": [torch.randn(1, dims.hidden_size, generator=g) for _ in range(dims.n_layers)],
        "logits": [torch.randn(1, dims.n_experts, generator=g) for _ in range(dims.n_layers)],
        "topk": [torch.randperm(dims.n_experts, generator=g)[: dims.top_k].unsqueeze(0)
                 for _ in range(dims.n_layers)],
        "pre": [torch.randn(1, dims.hidden_size, generator=g) for _ in range(dims.n_layers)],  # pre-attention
        "token_ids": torch.tensor([5]),
        "sample_index": torch.tensor([0]),
        "position": torch.tensor([7], dtype=torch.int32),
        "is_image": torch.zeros(1, dtype=torch.uint8),
        "is_prompt": torch.zeros(1, dtype=torch.uint8),
    }


def time_call(fn: Callable[[], Any], reps: int) -> float:
    """Mean seconds of ``fn()`` over ``reps`` calls (after one warm-up call)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def load_live_predictors(cfg: Mapping[str, Any], predictor_dirs: Sequence[str | Path]
                         ) -> dict[str, dict[str, tuple[Predictor, int]]]:
    """{model: {method: (predictor, trainable params from its meta.json)}} of the given trained predictors, in the
    config's model order; the oracle (it reads the routing it predicts) is skipped. A model outside the config, an
    unknown method or a (model, method) given twice is an error naming the directory."""
    known = registry.methods()
    out: dict[str, dict[str, tuple[Predictor, int]]] = {}
    for d in map(Path, predictor_dirs):
        meta = read_meta(d)
        model, method = meta.get("model"), meta["method"]
        if model not in cfg["models"]:
            raise SpecPrefetchError(f"{d / 'meta.json'}: model {model!r} is not in the config "
                                    f"({', '.join(cfg['models'])})")
        if method not in known:
            raise SpecPrefetchError(f"{d / 'meta.json'}: unknown method {method!r}")
        if known[method].sees_future:
            continue
        if method in out.setdefault(model, {}):
            raise SpecPrefetchError(f"{d}: a second {method} predictor for {model} (give one seed per method)")
        out[model][method] = (load_predictor(d), int(meta.get("trainable_params", 0)))
    if not any(out.values()):
        raise SpecPrefetchError("predictor cost: no live predictor among the given directories")
    return {m: out[m] for m in cfg["models"] if m in out}


def measure_model(cfg: Mapping[str, Any], name: str, preds: Mapping[str, tuple[Predictor, int]],
                  rounds: int = ROUNDS, reps: int = REPS) -> list[dict[str, Any]]:
    """One model's rows (one per method): the interleaved timing described in the module docstring."""
    dims = next(iter(preds.values()))[0].dims
    torch.manual_seed(int(cfg.get("seed", 0)))
    layer, rotary = build_layer(cfg["models"][name])
    hidden = torch.randn(1, 1, int(cfg["models"][name]["hidden_size"]))
    pos = torch.tensor([[7]])
    pe = rotary(hidden, pos)
    batch = one_token_batch(dims)

    def run_layer() -> None:
        layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=pe)

    fns: dict[str, Callable[[], Any]] = {"moe_layer": run_layer}
    for m, (p, _) in preds.items():
        fns[m] = (lambda p=p: p.priorities(batch, "token"))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        for _ in tqdm(range(rounds), desc=f"predictor cost {name}", unit="round", disable=None):
            for k, fn in fns.items():  # interleaved: drifts in machine load hit every method alike
                samples[k].append(time_call(fn, reps))
    layer_s = samples["moe_layer"]
    rows = []
    for m, (_, n_params) in preds.items():
        per_pair = [s / dims.n_pairs for s in samples[m]]
        ratios = [s / lt for s, lt in zip(per_pair, layer_s, strict=True)]
        ci = bootstrap_ci(ratios)
        rows.append({"model": name, "method": m, "trainable_params": n_params,
                     "layer_us": statistics.median(layer_s) * 1e6, "predict_us": statistics.median(per_pair) * 1e6,
                     "ratio": ci.mean, "ratio_lo": ci.lo, "ratio_hi": ci.hi, "rounds": rounds})
    return rows


def measure_predictor_cost(cfg: Mapping[str, Any], predictor_dirs: Sequence[str | Path], rounds: int = ROUNDS,
                           reps: int = REPS) -> list[dict[str, Any]]:
    """Every model's rows, one thread (the least noisy: no intra-op scheduling)."""
    if rounds < 2 or reps < 1:
        raise SpecPrefetchError(f"predictor cost: rounds {rounds} must be >= 2 (the CI is over rounds), "
                                f"reps {reps} >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        by_model = load_live_predictors(cfg, predictor_dirs)
        return [r for name, preds in by_model.items() for r in measure_model(cfg, name, preds, rounds, reps)]
    finally:
        torch.set_num_threads(threads)


def write_predictor_cost(rows: Sequence[Mapping[str, Any]], out: str | Path) -> pd.DataFrame:
    """Write the rows (contract ``predictor_cost``, atomically, checked before the rename) and return them."""
    df = pd.DataFrame(list(rows), columns=COST_COLUMNS)
    with atomic_path(Path(out)) as tmp:
        df.to_csv(tmp, index=False, float_format="%.6g")
        check_csv(tmp, "predictor_cost")
    return df
