"""Size a run before launching it: per rule, the jobs, tokens, storage and GPU-hours a profile needs.

``specprefetch estimate-resources --config config/paper.yaml`` prints the table docs/cluster.md's sizing section
shows. Storage is exact arithmetic on the trace contract (bytes per token per MoE layer from the config's hidden
size, expert count, top-K and dtypes) times a token count; the token count is measured where a trace of the
profile already exists under ``results/traces`` and estimated otherwise (samples x tokens per sample, both
printed, both overridable). GPU-hours divide tokens by a throughput: the defaults are stated assumptions, to be
replaced by the figures of a first small run (``benchmarks/extract_traces/...tsv`` holds them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specprefetch.config import LEARNED_METHODS, n_moe_layers, trains_online
from specprefetch.contracts import read_doc, require
from specprefetch.io import SpecPrefetchError
from specprefetch.traces.store import INPUT_DTYPES, LOGITS_DTYPES, TOKEN_KEYS, TOPK_DTYPE, dtype_from_name

# Test-set sizes of the paper's hub benchmarks (the split config/paper.yaml names; HallusionBench approximate), used
# for configs without n_samples.
HUB_SAMPLES = {"openai/gsm8k": 1319, "openai/openai_humaneval": 164, "echo840/OCRBench": 1000,
               "HuggingFaceM4/ChartQA": 2500, "lmms-lab/HallusionBench": 951}
TOKEN_META_BYTES = sum(d.itemsize for d in TOKEN_KEYS.values())  # the trace contract's per-token tensors
IMAGE_GENERATORS = ("ocr_synth", "chartqa_synth", "hallusion_synth")  # the synthetic corpus sources with images
TEXT_TOKENS = {"LLM": 384, "VLM": 128}  # assumed prompt + reference tokens per sample (VLM: plus the image)
# Assumed forward throughput of trace extraction, tokens/s per GPU (batch-1 teacher forcing with hooks, bf16):
# an order of magnitude for transformers' MoE blocks on one A100/H100-class GPU; replace with a measured value.
EXTRACT_TOKENS_PER_S = 2000.0
# Predictor training and recall evaluation stream the traces: bounded by reading them (bytes/s).
TRACE_READ_BYTES_PER_S = 1.5e9


@dataclass(frozen=True)
class TraceSet:
    model: str
    workload: str
    samples: int
    tokens: int
    measured: bool
    bytes_per_token: int

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def bytes_per_token(cfg: Mapping[str, Any], model: str) -> int:
    """Trace bytes per token of ``model``: per MoE layer x (bf16/fp16/fp32; twice with ``traces.pre_attention``, the
    pre-attention input beside the router input) + logits + int32 top-K, plus metadata."""
    m, t = cfg["models"][model], cfg["traces"]
    x = dtype_from_name(t["input_dtype"], INPUT_DTYPES, "traces.input_dtype").itemsize
    logits = dtype_from_name(t["logits_dtype"], LOGITS_DTYPES, "traces.logits_dtype").itemsize
    inputs = 2 if t.get("pre_attention") else 1
    per_layer = inputs * m["hidden_size"] * x + m["n_experts"] * logits + m["top_k"] * TOPK_DTYPE.itemsize
    return n_moe_layers(m) * per_layer + TOKEN_META_BYTES


def _samples(cfg: Mapping[str, Any], workload: str, overrides: Mapping[str, int]) -> int:
    if workload in overrides:
        return int(overrides[workload])
    if workload == "corpus":
        return int(cfg["train_corpus"]["n_samples"])
    w = cfg["workloads"][workload]
    if w.get("n_samples"):
        return int(w["n_samples"])
    path = (w.get("dataset") or {}).get("path")
    if path in HUB_SAMPLES:
        return HUB_SAMPLES[path]
    raise SpecPrefetchError(f"workload {workload}: no n_samples in the config and no known size for {path!r}; "
                            f"pass --samples {workload}=N")


def _tokens_per_sample(cfg: Mapping[str, Any], model: str, workload: str) -> int:
    """Assumed mean tokens per sample: text, plus the merged image tokens of a VLM sample, capped by max_length."""
    img = cfg.get("image") or {}
    image_tokens = (img["size"] // img["patch_size"]) ** 2 // 4  # 2x2-merged patches
    if workload == "corpus":  # a mixture: text, with images in the share of its image sources
        category = "LLM"
        tc = cfg["train_corpus"]
        weights = [(v, k in IMAGE_GENERATORS) for k, v in (tc.get("mixture") or {}).items()]
        weights += [(float(e["weight"]), bool(e.get("images", True))) for e in tc.get("hub") or []]
        total = sum(w for w, _ in weights) or 1.0
        image = int(sum(w for w, has_image in weights if has_image) / total * image_tokens)
    else:
        category = cfg["workloads"][workload]["category"]
        image = image_tokens if category == "VLM" else 0
    return min(int(cfg["models"][model]["max_length"]), TEXT_TOKENS[category] + image)


def trace_sets(cfg: Mapping[str, Any], results: Path | None = None,
               samples: Mapping[str, int] | None = None) -> list[TraceSet]:
    """Every trace set the profile extracts (no corpus when predictors train online), measured from
    ``results/traces/<model>/<workload>`` where it exists."""
    out = []
    for model in cfg["models"]:
        for workload in ([] if trains_online(cfg) else ["corpus"]) + list(cfg["workloads"]):
            bpt = bytes_per_token(cfg, model)
            man = results / "traces" / model / workload / "manifest.json" if results is not None else None
            if man is not None and man.is_file():
                m = read_doc(man, None, "trace manifest", required=("n_samples", "n_tokens"))
                out.append(TraceSet(model, workload, int(require(m, "n_samples", int, str(man))),
                                    int(require(m, "n_tokens", int, str(man))), True, bpt))
                continue
            n = _samples(cfg, workload, samples or {})
            out.append(TraceSet(model, workload, n, n * _tokens_per_sample(cfg, model, workload), False, bpt))
    return out


def estimate(cfg: Mapping[str, Any], results: Path | None = None, samples: Mapping[str, int] | None = None,
             extract_tokens_per_s: float = EXTRACT_TOKENS_PER_S,
             read_bytes_per_s: float = TRACE_READ_BYTES_PER_S,
             sets: list[TraceSet] | None = None) -> list[dict[str, Any]]:
    """Per rule: jobs, tokens, storage (GB) and GPU-hours; see the module docstring for what is assumed.
    ``sets``: the :func:`trace_sets` already measured (else measured here)."""
    online = trains_online(cfg)
    sets = trace_sets(cfg, results, samples) if sets is None else sets
    corpus_tokens = {m: _samples(cfg, "corpus", samples or {}) * _tokens_per_sample(cfg, m, "corpus")
                     for m in cfg["models"]}
    scatter = int(cfg["traces"]["scatter"])
    methods = list(cfg["predictors"]["methods"])
    learned = [m for m in methods if m in LEARNED_METHODS]
    seeds = int(cfg["predictors"].get("seeds", 1))  # the schema checked it (an integer >= 1)
    fits = len(learned) * seeds  # trainings of a learned method, per model
    epochs = float(cfg["predictors"]["training"]["epochs"])
    gpu = cfg["profile"] == "paper"
    corpus = [s for s in sets if s.workload == "corpus"]
    evals = [s for s in sets if s.workload != "corpus"]
    tokens = sum(s.tokens for s in sets)
    rows = [
        {"rule": "extract_traces", "jobs": len(sets) * scatter, "tokens": tokens,
         "storage_gb": sum(s.bytes for s in sets) / 1e9,
         "gpu_hours": tokens / extract_tokens_per_s / 3600 if gpu else 0.0,
         "note": f"{scatter} shard(s) per trace set, forward passes at {extract_tokens_per_s:.0f} tok/s per GPU; "
                 "plus a gathered copy of each set read whole (the corpus when training from traces, the "
                 "simulator's workloads)"},
        {"rule": "train_predictor", "jobs": len(cfg["models"]) * (len(methods) - len(learned) + fits),
         "tokens": int(sum(corpus_tokens.values()) * epochs * fits), "storage_gb": 0.0,
         "gpu_hours": (sum(corpus_tokens.values()) * epochs * fits / extract_tokens_per_s / 3600 if online
                       else sum(s.bytes for s in corpus) * epochs * fits / read_bytes_per_s / 3600)
         if gpu else 0.0,
         "note": (f"online: {len(learned)} learned methods x {seeds} seed(s) x {epochs:g} epoch(s) of corpus forward "
                  f"passes through the frozen model (no corpus traces stored)" if online else
                  f"{len(learned)} learned methods x {seeds} seed(s) x {epochs:g} epoch(s) over the corpus traces, "
                  f"bound by reading them at {read_bytes_per_s / 1e9:.1f} GB/s")},
        {"rule": "evaluate_recall", "jobs": len(evals) * scatter, "tokens": sum(s.tokens for s in evals),
         "storage_gb": 0.0,
         "gpu_hours": sum(s.bytes for s in evals) / read_bytes_per_s / 3600 if gpu else 0.0,
         "note": "every workload trace read once, all predictors per batch"},
    ]
    return rows


def render_estimate(cfg: Mapping[str, Any], rows: list[dict[str, Any]], sets: list[TraceSet]) -> str:
    """The estimate as Markdown: per trace set, then per rule."""
    lines = [f"Profile {cfg['profile']}: trace sets (bytes/token from the config's dims and dtypes)", "",
             "| model | trace set | samples | tokens | source | bytes/token | storage (GB) |",
             "|---|---|---:|---:|---|---:|---:|"]
    for s in sets:
        lines.append(f"| {s.model} | {s.workload} | {s.samples:,} | {s.tokens:,} | "
                     f"{'measured' if s.measured else 'estimated'} | {s.bytes_per_token:,} | {s.bytes / 1e9:,.2f} |")
    lines += ["", "| rule | jobs | tokens | storage (GB) | GPU-hours | how |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['rule']} | {r['jobs']} | {r['tokens']:,} | {r['storage_gb']:,.1f} | "
                     f"{math.ceil(r['gpu_hours'] * 10) / 10:,.1f} | {r['note']} |")
    return "\n".join(lines)
