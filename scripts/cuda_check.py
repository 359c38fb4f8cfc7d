"""The offloaded runtime's CUDA path, measured on a GPU machine in one command (< 10 minutes).

    python3 scripts/cuda_check.py --out OUT_DIR [--device cuda] [--repeats 3]

It needs only torch, transformers, numpy, pyyaml, tqdm and jsonschema (no pipeline outputs): a DeepSeek-V2-shaped
MoE (transformers' own class, random weights; 1 dense + 11 MoE layers, 64 routed experts top-6, 2 shared) is
widened to DeepSeek-VL2-Tiny's real expert shape (3 x 1280 x 896, bf16: the CUDA store format, since the int4
packing is aten's CPU layout) into an expert store, and the same library path as the DAG's device rules runs on
it: ``profile_window`` (window, per-storage transfer times and M_max) and ``bench_runtime`` (experiment ``main``:
OFF, PRED0, SpecPrefetch with a random-weight adapter, Naive, FATE and all-resident; every run checked against
the plain model's greedy generate()). On CUDA the expert cache lives in GPU memory, transfers are copies from
pinned host memory on side streams. Outputs in OUT_DIR: ``runs.csv`` (``platform = local-cuda``), ``profile.json``
(the window profile) and ``log.txt``. On this CPU machine ``--device cpu`` runs the same script (a check of the
script itself).

On the ``device`` machine: carry the wheels of jsonschema and its needs (see the device README's wheel notes) and
run e.g. ``python3 scripts/cuda_check.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tiny_deepseek(vocab: int, layers: int, experts: int, seed: int = 0):  # noqa: ANN201 - a transformers model
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=experts, n_shared_experts=2, num_experts_per_tok=6,
                           first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                           qk_nope_head_dim=16, v_head_dim=32,
                           max_position_embeddings=512, topk_method="greedy", n_group=None, topk_group=None)
    model = DeepseekV2ForCausalLM(cfg).eval()
    model.set_experts_implementation("eager")
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--format", default="bf16", choices=["bf16", "fp32", "int4"])
    ap.add_argument("--layers", type=int, default=12, help="decoder layers (the first dense)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        handlers=[logging.FileHandler(args.out / "log.txt"), logging.StreamHandler()])
    import torch

    from specprefetch.config import section_defaults
    from specprefetch.io import write_json_atomic
    from specprefetch.models.routing import discover_routing
    from specprefetch.predictors.base import PredictorDims, build_predictor
    from specprefetch.runtime.core.paper_scale import ExpertScale
    from specprefetch.runtime.core.priority import PredictorPriority, provider_factories
    from specprefetch.runtime.core.store import ExpertStore, build_expert_store
    from specprefetch.runtime.measurement.bench import bench_runtime
    from specprefetch.runtime.measurement.decode import Prompt
    from specprefetch.runtime.measurement.session import Harness
    from specprefetch.runtime.measurement.window import profile_window

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    vocab = 512
    model = tiny_deepseek(vocab, args.layers, args.experts)
    spec = discover_routing(model)
    scale = ExpertScale(1280, 896, shared_intermediate_size=1792, format=args.format)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        store = ExpertStore(build_expert_store(model, Path(tmp) / "store", spec, model_name="cuda-check",
                                               scale=scale))
        logging.info("paper-scale store (%s): %d B per expert, built in %.0f s", args.format,
                     store.layout.payload_bytes, time.perf_counter() - t0)
        settings = section_defaults("device", {
            "n_prompts": 2, "max_new_tokens": args.new_tokens, "repeats": args.repeats, "io_workers": 4,
            "storages": ["nvme_cold", "ram", "nvme", "slow_ufs"], "experiments": ["main"],
            "window": {"n_prompts": 1, "demand_m": [2, 4, 8], "transfer_samples": 32}})
        torch.manual_seed(1)
        prompts = [Prompt(f"p{i}", {"input_ids": torch.randint(0, vocab, (1, 48)),
                                    "attention_mask": torch.ones(1, 48, dtype=torch.long)}) for i in range(2)]
        dims = PredictorDims(n_layers=spec.n_layers, hidden_size=spec.hidden_size, n_experts=spec.n_experts,
                             top_k=spec.top_k, scoring=spec.scoring, arch=spec.arch)
        adapter = build_predictor("specprefetch", {"specprefetch": {"rank": 16}}, dims)
        with torch.no_grad():
            adapter.B.normal_()
        providers = provider_factories({}, spec, args.device)
        adapter = adapter.to(args.device)
        providers["specprefetch"] = lambda: PredictorPriority(adapter)
        harness = Harness(model, spec, store, settings, prompts, providers, args.device)
        platform = f"local-{args.device}"
        try:
            profile = profile_window(harness, "cuda-check", platform, args.out / "window")
            bench_runtime(harness, profile, "cuda-check", platform, args.out / "runs.csv")
        finally:
            harness.close()
        write_json_atomic(args.out / "profile.json", profile)
    logging.info("done in %.0f s", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
