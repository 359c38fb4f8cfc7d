#!/usr/bin/env python
"""Benchmark what trace extraction adds to a forward pass, as a paired ratio in one run.

For each embedded-default stand-in shape (Qwen3-VL-MoE: 128 experts top-8; DeepSeek-VL2: 64 routed + 2 shared,
top-6; hidden 128), randomly initialised with the stand-ins' own config builders, the same batch is run as

- plain:  ``model(**batch)`` under ``torch.inference_mode``;
- traced: the same forward under ``RouterCapture`` + the gates' returned indices + logits recompute +
  best-first reorder of the executed top-K + cast to the trace dtypes + copy to CPU
  (:func:`specprefetch.traces.extract.traced_forward`), i.e. everything extraction adds per forward except the
  disk write (and except the one-time RoutingSpec check of the first sample);

interleaved (alternating which goes first) for ``--repeats`` pairs. Reported: the median of the paired ratios
traced/plain (target <= 1.10), its interquartile range, the same ratio in process CPU time (robust to other
processes on a shared machine when run with ``--threads 1``), the cost of the post-forward work alone (and what
it would be if the top-K were recomputed instead of taken from the gates), and the trace's bytes per token and
per layer (analytic from the dtypes, and measured on disk by writing the batch once with ``TraceWriter``).

    python scripts/bench_capture.py [--config config/config.yaml] [--batch 4 --seq 256 --repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from specprefetch.config import REPO_ROOT, load_config
from specprefetch.models import discover_routing
from specprefetch.models.capture import RouterCapture
from specprefetch.models.standins import SPECIAL_TOKENS
from specprefetch.traces.extract import GateOutputs, route_captured, traced_forward
from specprefetch.traces.store import INPUT_DTYPES, LOGITS_DTYPES, TraceReader, TraceWriter, dtype_from_name


def build_model(cfg: dict[str, Any], name: str) -> torch.nn.Module:
    """A randomly initialised stand-in of ``cfg.models[name]`` (same classes and configs as pretrain builds)."""
    from specprefetch.models import standins as st

    mcfg, image_cfg = cfg["models"][name], cfg["image"]
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab = int(cfg.get("tokenizer", {}).get("vocab_size", 4096))
    if mcfg["arch"] == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeForConditionalGeneration

        model = Qwen3VLMoeForConditionalGeneration(st.qwen3_vl_moe_config(mcfg, image_cfg, ids, vocab))
    elif mcfg["arch"] == "deepseek_vl2_standin":
        from transformers import DeepseekV2ForCausalLM, SiglipVisionConfig, SiglipVisionModel

        d = int(mcfg["hidden_size"])
        vcfg = SiglipVisionConfig(hidden_size=st.VISION_HIDDEN, intermediate_size=2 * st.VISION_HIDDEN,
                                  num_hidden_layers=st.VISION_DEPTH, num_attention_heads=2,
                                  image_size=int(image_cfg["size"]), patch_size=int(image_cfg["patch_size"]))
        model = st.DeepseekVL2StandIn(SiglipVisionModel(vcfg), st.Projector(st.VISION_HIDDEN, d),
                                      DeepseekV2ForCausalLM(st.deepseek_language_config(mcfg, ids, vocab)),
                                      ids["<image>"])
    else:
        raise SystemExit(f"no stand-in builder for arch {mcfg['arch']!r} (model {name})")
    return model.eval()


def make_batch(model: torch.nn.Module, arch: str, batch: int, seq: int, vocab: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(len(SPECIAL_TOKENS), vocab, (batch, seq), generator=g)
    kw: dict[str, Any] = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "use_cache": False}
    if arch == "qwen3_vl_moe":
        kw["mm_token_type_ids"] = torch.zeros_like(input_ids, dtype=torch.int32)
    return kw


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _times(fn: Any) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call. On a shared machine with one intra-op thread the CPU time
    is not inflated by waiting for other processes, so its ratio is the contention-robust one."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def bench_model(cfg: dict[str, Any], name: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = build_model(cfg, name)
    spec = discover_routing(model)
    vocab = int(cfg.get("tokenizer", {}).get("vocab_size", 4096))
    kw = make_batch(model, cfg["models"][name]["arch"], args.batch, args.seq, vocab, args.seed)
    in_dt = dtype_from_name(cfg["traces"]["input_dtype"], INPUT_DTYPES, "traces.input_dtype")
    lg_dt = dtype_from_name(cfg["traces"]["logits_dtype"], LOGITS_DTYPES, "traces.logits_dtype")

    fwd_kw = {k: v for k, v in kw.items() if k != "use_cache"}

    def plain() -> None:
        model(**kw)

    def hooked() -> None:  # capture hooks only: separates hook cost from the recompute
        with RouterCapture(model, spec) as cap:
            model(**kw)
            cap.inputs()

    def traced() -> None:
        traced_forward(model, spec, fwd_kw, None, in_dt, lg_dt)

    ratios, hook_ratios, cpu_ratios, t_plain, t_traced = [], [], [], [], []
    with torch.inference_mode():
        for _ in range(args.warmup):
            plain()
            hooked()
            traced()
        for r in range(args.repeats):
            fns = [plain, hooked, traced] if r % 2 == 0 else [traced, hooked, plain]
            both = dict(zip((f.__name__ for f in fns), (_times(f) for f in fns)))
            times = {k: v[0] for k, v in both.items()}
            t_plain.append(times["plain"])
            t_traced.append(times["traced"])
            ratios.append(times["traced"] / times["plain"])
            hook_ratios.append(times["hooked"] / times["plain"])
            cpu_ratios.append(both["traced"][1] / max(both["plain"][1], 1e-9))
        x, logits, topk = traced_forward(model, spec, fwd_kw, None, in_dt, lg_dt)
        with RouterCapture(model, spec) as cap, GateOutputs(spec) as gates:
            model(**kw)
        xs, executed = cap.inputs(), gates.indices()
        t_route = statistics.median(_times(lambda: route_captured(spec, xs, None, in_dt, lg_dt, executed=executed))[1]
                                    for _ in range(args.repeats))
        t_recompute = statistics.median(_times(lambda: route_captured(spec, xs, None, in_dt, lg_dt))[1]
                                        for _ in range(args.repeats))
        t_plain_cpu = statistics.median(_times(plain)[1] for _ in range(max(3, args.repeats // 3)))
    q = statistics.quantiles(ratios, n=4)
    tokens = args.batch * args.seq
    n_layers = len(spec.moe_layers)
    per_layer = (spec.hidden_size * x[0].element_size() + spec.n_experts * logits[0].element_size()
                 + spec.top_k * topk[0].element_size())
    disk = _bytes_on_disk(spec, name, x, logits, topk, kw["input_ids"], in_dt, lg_dt)
    return {
        "model": name, "arch": spec.arch, "n_moe_layers": n_layers, "n_experts": spec.n_experts,
        "top_k": spec.top_k, "hidden_size": spec.hidden_size, "tokens_per_forward": tokens,
        "repeats": args.repeats, "threads": torch.get_num_threads(),
        "median_plain_s": statistics.median(t_plain), "median_traced_s": statistics.median(t_traced),
        "ratio_median": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
        "ratio_hooks_only_median": statistics.median(hook_ratios),
        "ratio_cpu_time_median": statistics.median(cpu_ratios),
        "route_cpu_s_median": t_route, "route_share_of_plain": t_route / t_plain_cpu,
        "route_recompute_topk_share_of_plain": t_recompute / t_plain_cpu,
        "bytes_per_token_per_layer": per_layer, "bytes_per_token_analytic": n_layers * per_layer + 22,
        "bytes_per_token_on_disk": disk / tokens,
    }


def _bytes_on_disk(spec: Any, name: str, x: list, logits: list, topk: list, input_ids: torch.Tensor,
                   in_dt: torch.dtype, lg_dt: torch.dtype) -> int:
    """Write the batch once as a trace (one shard) and return the shard's size."""
    meta = {"model": name, "workload": "bench", "arch": spec.arch, "n_experts": spec.n_experts,
            "top_k": spec.top_k, "hidden_size": spec.hidden_size, "moe_layers": spec.moe_layers,
            "scoring": spec.scoring, "routers": spec.router_tensors()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace"
        ids = input_ids.reshape(-1)
        with TraceWriter(out, meta, shard_tokens=ids.numel(), input_dtype=in_dt, logits_dtype=lg_dt) as w:
            t = ids.numel()
            w.add_sample(x, logits, topk, ids, torch.arange(t), torch.zeros(t, dtype=torch.bool),
                         torch.ones(t, dtype=torch.bool))
        return sum(s["bytes"] for s in TraceReader(out).manifest["shards"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO_ROOT / "config" / "config.yaml")
    p.add_argument("--models", nargs="*", default=None, help="model names (default: every stand-in of the config)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    names = args.models or [n for n, m in cfg["models"].items() if m["source"] == "stand_in"]
    results = []
    for name in names:
        res = bench_model(cfg, name, args)
        results.append(res)
        print(f"{name:>20}: traced/plain = {res['ratio_median']:.3f} (IQR {res['ratio_q1']:.3f}-{res['ratio_q3']:.3f}, "
              f"{res['repeats']} pairs, plain {res['median_plain_s'] * 1e3:.1f} ms for {res['tokens_per_forward']} "
              f"tokens; CPU-time ratio {res['ratio_cpu_time_median']:.3f}; "
              f"hooks only {res['ratio_hooks_only_median']:.3f}, recompute+cast "
              f"{100 * res['route_share_of_plain']:.1f}% of plain CPU time, "
              f"{100 * res['route_recompute_topk_share_of_plain']:.1f}% "
              f"if the top-K were recomputed); bytes/token/layer {res['bytes_per_token_per_layer']}, bytes/token "
              f"{res['bytes_per_token_analytic']} analytic, {res['bytes_per_token_on_disk']:.1f} on disk "
              f"({res['n_moe_layers']} MoE layers)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    worst = max(r["ratio_median"] for r in results)
    print(f"overhead target <= 10%: {'met' if worst <= 1.10 else 'NOT met'} (worst {100 * (worst - 1):.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
