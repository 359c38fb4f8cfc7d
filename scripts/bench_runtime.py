#!/usr/bin/env python
"""Exercise the offloaded runtime end to end on one device (CPU or CUDA) and print a throughput table.

Two modes:

- default: a tiny random transformers MoE (DeepSeek-V2 or Qwen3-MoE, sizes from the flags) built here, so it
  runs anywhere without pipeline outputs;
- ``--config C --model M --model-dir D --workload-dir W [--predictor specprefetch=P]``: a pipeline stand-in.

On CUDA the expert cache lives in GPU memory and transfers run on side streams from pinned host memory (``ram``)
or disk (the other profiles). Every policy's tokens are checked against the plain model's greedy tokens on the
same device (the router must decide) and against OFF. Exit status 1 if any check fails.

    python scripts/bench_runtime.py --device cuda --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def tiny_model(arch: str, hidden: int, layers: int, experts: int, top_k: int, vocab: int) -> Any:
    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    if arch == "qwen":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, num_experts=experts,
                             num_experts_per_tok=top_k, max_position_embeddings=1024)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        hd = hidden // heads
        cfg = DeepseekV2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                               moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=heads,
                               num_key_value_heads=heads, n_routed_experts=experts, n_shared_experts=2,
                               num_experts_per_tok=top_k, first_k_dense_replace=1, kv_lora_rank=max(8, hidden // 4),
                               q_lora_rank=None, qk_rope_head_dim=hd // 2, qk_nope_head_dim=hd - hd // 2,
                               v_head_dim=hd, max_position_embeddings=1024, topk_method="greedy", n_group=None,
                               topk_group=None)
        model = DeepseekV2ForCausalLM(cfg)
    # random weights with a real spread (std 0.02 init leaves routing nearly token-independent)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "gate.weight" in n:
                p.normal_(0, 1.0 / hidden ** 0.5)
    model.eval()
    model.set_experts_implementation("eager")
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--config", type=Path)
    ap.add_argument("--model")
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--workload-dir", type=Path)
    ap.add_argument("--predictor", action="append", default=[])
    ap.add_argument("--arch", default="deepseek", choices=["deepseek", "qwen"])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--m-max", type=int, default=8)
    ap.add_argument("--capacity-fraction", type=float, default=0.125)
    ap.add_argument("--policies", default="off,pred0,fate,naive,specprefetch,resident")
    ap.add_argument("--storages", default="ram,nvme_cold,nvme,slow_ufs")
    ap.add_argument("--charge", default="paper", choices=["real", "paper"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compute-opt", action="store_true", help="transformers' per-expert loop (bit-identical)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA requested but not available", file=sys.stderr)
        return 2

    from specprefetch.config import section_defaults
    from specprefetch.runtime.core.priority import provider_factories
    from specprefetch.runtime.core.store import ExpertStore, build_expert_store
    from specprefetch.runtime.measurement.decode import Prompt, greedy_generate, prompts_from_workload
    from specprefetch.runtime.measurement.session import Harness
    from specprefetch.stages.common import parse_predictor_args

    out = args.out or Path(tempfile.mkdtemp(prefix="bench_runtime_"))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if args.config:
        from specprefetch.config import load_config
        from specprefetch.models import load_bundle

        cfg = load_config(args.config)
        bundle = load_bundle(cfg, args.model, args.model_dir)
        model, spec, tokenizer = bundle.model, bundle.routing, bundle.tokenizer
        prompts = prompts_from_workload(bundle, args.workload_dir, args.prompts, args.prompt_tokens)
        label = args.model
    else:
        from specprefetch.models.routing import discover_routing

        model = tiny_model(args.arch, args.hidden, args.layers, args.experts, args.top_k, vocab=1024)
        spec = discover_routing(model)
        g = torch.Generator().manual_seed(1)
        prompts = [Prompt(f"random-{i}", {"input_ids": torch.randint(0, 1024, (1, args.prompt_tokens), generator=g),
                                          "attention_mask": torch.ones(1, args.prompt_tokens, dtype=torch.long)})
                   for i in range(args.prompts)]
        label = f"random-{args.arch}-h{args.hidden}-L{args.layers}-n{args.experts}-k{args.top_k}"
    t0 = time.perf_counter()
    store = ExpertStore(build_expert_store(model, out / "store", spec, model_name=label))
    print(f"expert store: {store.total_experts} experts x {store.record_bytes} B in {time.perf_counter() - t0:.1f}s")

    # the plain model's tokens on this device (reference), then back to the CPU before offloading
    model.to(args.device)
    ref = [greedy_generate(model, p.to(args.device), args.tokens, tokenizer=tokenizer).new_ids for p in prompts]
    model.to("cpu")
    if args.device == "cuda":
        torch.cuda.empty_cache()

    settings = section_defaults("device", {"charge": args.charge, "io_workers": 4, "max_new_tokens": args.tokens,
                                        "cache": {"capacity_fraction": args.capacity_fraction}})
    providers = provider_factories(parse_predictor_args(args.predictor), spec, args.device)
    policies = [p for p in args.policies.split(",") if p != "specprefetch" or "specprefetch" in providers]
    if "pred0" in policies and "specprefetch" not in providers:
        providers["specprefetch"] = providers["fate"]  # PRED0 then runs FATE's prediction path
    h = Harness(model, spec, store, settings, prompts, providers, args.device, tokenizer=tokenizer)
    rows: list[dict[str, Any]] = []
    ok = plain_ok = True
    try:
        h.run("resident", "ram", max_new_tokens=4, prompts=h.prompts[:1])  # warm-up
        for storage in args.storages.split(","):
            for r in range(args.repeats):
                base = off_tokens = None
                for pol in ["off", *[p for p in policies if p != "off"]]:
                    res = h.run(pol, storage, args.m_max, compute_opt=not args.no_compute_opt)
                    off_tokens = off_tokens or res.tokens()
                    same_ref = res.tokens() == ref
                    same_off = res.tokens() == off_tokens
                    ok &= same_off
                    plain_ok &= same_ref
                    base = base or res.tokens_per_s
                    rows.append({"device": args.device, "model": label, "storage": storage, "policy": pol,
                                 "repeat": r, "m_max": res.m_max, "tokens_per_s": res.tokens_per_s,
                                 "gain_vs_off": res.tokens_per_s / base - 1, "ready_recall": res.stats.ready_recall,
                                 "hits": res.stats.hits, "misses": res.stats.misses,
                                 "prefetched": res.stats.prefetched, "wasted": res.stats.wasted,
                                 "stall_ms": res.stats.stall_ms, "peak_cache_experts": res.stats.peak_cache_experts,
                                 "capacity_experts": res.capacity, "tokens_equal_plain_model": same_ref,
                                 "tokens_equal_off": same_off})
    finally:
        h.close()
    print(f"\n{'storage':10s} {'policy':13s} {'rep':>3s} {'tok/s':>8s} {'gain':>7s} {'ReadyR':>7s} {'stall ms':>9s} "
          f"{'peak/cap':>9s} =plain =off")
    for r in rows:
        print(f"{r['storage']:10s} {r['policy']:13s} {r['repeat']:3d} {r['tokens_per_s']:8.2f} "
              f"{r['gain_vs_off']:+7.1%} {r['ready_recall']:7.3f} {r['stall_ms']:9.1f} "
              f"{r['peak_cache_experts']:4d}/{r['capacity_experts']:<4d} {r['tokens_equal_plain_model']!s:6s} "
              f"{r['tokens_equal_off']}")
    info = {"device": args.device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "model": label,
            "record_bytes": store.record_bytes, "all_tokens_equal_off": ok, "all_tokens_equal_plain_model": plain_ok,
            "compute_opt": not args.no_compute_opt, "rows": rows}
    (out / "bench_runtime.json").write_text(json.dumps(info, indent=2))
    print(f"\nevery policy decodes OFF's tokens: {ok}; the plain model's (eager experts): {plain_ok} "
          f"(compute_opt uses batched matmuls, which may differ from the eager loop in the last bits)\n"
          f"results in {out / 'bench_runtime.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
