"""Extract routing traces: one captured forward per sample, router logits and executed top-K recomputed.

For every sample of a workload: encode it (``encode_sample``), run ONE forward under ``RouterCapture``
(``torch.inference_mode``), recompute each MoE layer's float32 logits from the gate weight, take the experts
the model executed (the gate's returned indices, checked against ``RoutingSpec`` on the first sample, or
recomputed with it), keep the valid tokens and hand them to :class:`TraceWriter`. Two modes:

- ``teacher_forced``: the sequence is prompt + reference (what the harness shows, then the gold answer);
- ``generate``: the model's own greedy continuation of the prompt (``traces.max_new_tokens``), generated
  first, then one forward over prompt + continuation is captured (``generate()`` does not return router
  inputs; a causal model's token states do not depend on later tokens, so one forward over the whole
  sequence routes every token as cached decoding did, up to floating-point differences between the two).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from specprefetch.io import SpecPrefetchError, config_hash, provenance, seed_everything, sha256_file
from specprefetch.traces.store import (
    INPUT_DTYPES,
    LOGITS_DTYPES,
    TOPK_DTYPE,
    TraceWriter,
    dtype_from_name,
    scatter_range,
    trace_stats,
)

log = logging.getLogger(__name__)

MODES = ("teacher_forced", "generate")
FULL_HASH_LIMIT = 256 << 20  # files above this are fingerprinted (size + first/last MiB), not fully hashed

__all__ = ["MODES", "GateOutputs", "extract_traces", "gate_output_indices", "model_fingerprint", "route_captured",
           "trace_stats", "traced_forward", "with_continuation"]


# ------------------------------------------------------------------------------------------ per forward
def route_captured(
    spec: Any,
    xs: list[Tensor],
    valid: Tensor | None,
    input_dtype: torch.dtype,
    logits_dtype: torch.dtype,
    executed: list[Tensor | None] | None = None,
    check: bool = False,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Turn captured router inputs into stored tensors: (x, logits, topk) per MoE layer, on CPU.

    ``xs[i]`` is gate i's input ``[tokens, D]`` as the model saw it. Logits are recomputed from the gate
    weight on the full captured tensor with the op the router uses (float32 models: bit-identical logits).
    The top-K is the gate's own returned indices where ``executed[i]`` holds them (what the experts ran;
    free, whereas recomputing a top-k over ``n`` experts costs as much as the router itself), reordered best
    first by the logits; otherwise it is recomputed with ``RoutingSpec`` (``executed_topk`` replays bf16/fp16
    routers in their own dtype). ``check`` recomputes anyway and raises if the two disagree (a changed gate
    output format or a wrong ``RoutingSpec``). Valid rows are kept and cast to the storage dtypes on the
    compute device (fewer bytes to move) before one copy to CPU.
    """
    keep = _valid_rows(valid, xs[0].device)
    logits = [spec.logits(i, x) for i, x in enumerate(xs)]
    topk = _executed_topk(spec, xs, logits, executed, check)
    out_x, out_logits, out_topk = [], [], []
    for x, lg, tk in zip(xs, logits, topk):
        if keep is not None:
            x, lg, tk = x[keep], lg[keep], tk[keep]
        out_x.append(x.to(input_dtype).cpu())
        out_logits.append(lg.to(logits_dtype).cpu())
        out_topk.append(tk.to(TOPK_DTYPE).cpu())
    return out_x, out_logits, out_topk


def _valid_rows(valid: Tensor | None, device: torch.device) -> Tensor | None:
    """The row mask of the valid tokens on ``device`` (None: every row is kept)."""
    return None if valid is None or bool(valid.all()) else valid.reshape(-1).to(device)


def _recompute_topk(spec: Any, xs: list[Tensor], logits: list[Tensor]) -> list[Tensor]:
    """Executed experts from the router inputs alone; one batched selection over all layers where exact.

    Selection is row-wise, so when no layer has its own correction bias and logits are float32 as the router
    computes them, stacking the layers' logits and selecting once equals per-layer calls (one kernel, not L).
    """
    native = [bool(spec.native_logits_dtype) and x.dtype != torch.float32 for x in xs]
    per_layer_bias = any(spec.correction_bias(i) is not None for i in range(len(xs)))
    if any(native) or per_layer_bias or len(xs) == 1:
        return [spec.executed_topk(i, x) if nat else spec.topk(i, lg)
                for i, (x, lg, nat) in enumerate(zip(xs, logits, native))]
    return list(spec.topk(0, torch.cat(logits)).split([lg.shape[0] for lg in logits]))


def _executed_topk(spec: Any, xs: list[Tensor], logits: list[Tensor], executed: list[Tensor | None] | None,
                   check: bool) -> list[Tensor]:
    shape_ok = executed is not None and all(
        e is not None and tuple(e.shape) == (x.shape[0], spec.top_k) for e, x in zip(executed, xs))
    if not shape_ok:
        return _recompute_topk(spec, xs, logits)
    assert executed is not None
    out = []
    for lg, idx in zip(logits, executed):
        idx = idx.long()
        order = lg.gather(-1, idx).argsort(dim=-1, descending=True)
        out.append(idx.gather(-1, order))
    if check:
        for i, (got, ref) in enumerate(zip(out, _recompute_topk(spec, xs, logits))):
            bad = int((got.sort(-1).values != ref.sort(-1).values).any(-1).sum())
            if bad:
                raise SpecPrefetchError(
                    f"{spec.arch}: the experts gate {i} (model layer {spec.moe_layers[i]}) returned differ from "
                    f"RoutingSpec.topk for {bad} of {got.shape[0]} tokens; the router's selection rule is not "
                    "what specprefetch.models.routing reproduces")
    return out


def gate_output_indices(output: Any, top_k: int) -> Tensor | None:
    """The expert indices in a router's output: its one integer tensor with last dim ``top_k``, else None.

    transformers' routers return ``(logits, weights, indices)``, DeepSeek-VL2's ``MoEGate``
    ``(indices, weights, aux_loss)``; any other format falls back to recomputing the top-K.
    """
    items = output if isinstance(output, (tuple, list)) else (output,)
    found = [t for t in items if isinstance(t, Tensor) and not t.is_floating_point() and t.dtype != torch.bool
             and t.dim() >= 2 and t.shape[-1] == top_k]
    return found[0].detach().reshape(-1, top_k) if len(found) == 1 else None


class GateOutputs:
    """Forward hooks on every gate that keep the expert indices it returned (see :func:`gate_output_indices`).

    Only references are kept, so the forward is unchanged; ``indices()`` is None for a layer whose gate ran
    more or less than once (then the top-K is recomputed).
    """

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self._out: list[list[Tensor | None]] = [[] for _ in spec.gates]
        self._handles: list[Any] = []

    def __enter__(self) -> GateOutputs:
        for i, gate in enumerate(self.spec.gates):
            store = self._out[i]
            k = self.spec.top_k
            self._handles.append(gate.register_forward_hook(
                lambda module, args, output, store=store, k=k: store.append(gate_output_indices(output, k))))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def indices(self) -> list[Tensor | None]:
        return [outs[0] if len(outs) == 1 else None for outs in self._out]


def traced_forward(model: torch.nn.Module, spec: Any, kwargs: dict[str, Tensor], valid: Tensor | None,
                   input_dtype: torch.dtype, logits_dtype: torch.dtype, *, check: bool = False,
                   pre_attention: bool = False) -> dict[str, list[Tensor]]:
    """One forward under ``RouterCapture`` plus :func:`route_captured` (what extraction adds per forward): the
    per-layer tensors of the trace contract, ``x``, ``logits``, ``topk`` and, with ``pre_attention``, ``pre`` (each
    MoE layer's pre-attention norm output, valid rows, in ``input_dtype``)."""
    from specprefetch.models.capture import RouterCapture

    with RouterCapture(model, spec, pre_attention=pre_attention) as cap, GateOutputs(spec) as gates:
        model(**kwargs, use_cache=False)
        xs = cap.inputs()
        pres = cap.pre_attention_inputs() if pre_attention else None
        executed = gates.indices()
    x, logits, topk = route_captured(spec, xs, valid, input_dtype, logits_dtype, executed=executed, check=check)
    out = {"x": x, "logits": logits, "topk": topk}
    if pres is not None:
        keep = _valid_rows(valid, pres[0].device)
        out["pre"] = [(p if keep is None else p[keep]).to(input_dtype).cpu() for p in pres]
    return out


# ------------------------------------------------------------------------------------------ generate mode
def _prompt_only(enc: Any, per_token_keys: tuple[str, ...]) -> dict[str, Tensor]:
    """The forward kwargs cut to the prompt (``is_prompt``), for ``generate``."""
    n_prompt = int(enc.is_prompt.sum())
    kw = dict(enc.kwargs)
    for k in per_token_keys:
        if k in kw:
            kw[k] = kw[k][:, :n_prompt]
    return kw


def with_continuation(bundle: Any, enc: Any, max_new_tokens: int) -> Any:
    """Replace the reference by the model's greedy continuation of the prompt (up to ``max_new_tokens``).

    The continuation's ids are appended as generated (never re-tokenised from text), per-token tensors are
    extended (attention 1, token-type / image masks 0), ``is_prompt`` marks the prompt part.
    """
    from specprefetch.models.loading import PER_TOKEN_KEYS

    prompt_kw = _prompt_only(enc, PER_TOKEN_KEYS)
    n_prompt = int(prompt_kw["input_ids"].shape[1])
    tok = bundle.tokenizer
    gen_kwargs: dict[str, Any] = {"max_new_tokens": int(max_new_tokens), "do_sample": False}
    pad = getattr(tok, "pad_token_id", None)
    if pad is not None:
        gen_kwargs["pad_token_id"] = pad
    new = _generate_new_ids(bundle, enc.sample_id, prompt_kw, gen_kwargs).to(prompt_kw["input_ids"].device)
    kw = dict(prompt_kw)
    kw["input_ids"] = torch.cat([prompt_kw["input_ids"], new], dim=1)
    for k in PER_TOKEN_KEYS:
        if k in kw and k != "input_ids":
            fill = 1 if k == "attention_mask" else 0
            kw[k] = torch.cat([kw[k], torch.full_like(new, fill, dtype=kw[k].dtype)], dim=1)
    s = int(kw["input_ids"].shape[1])
    pos = torch.arange(s)
    is_image = torch.zeros(s, dtype=torch.bool)
    is_image[:n_prompt] = enc.is_image[:n_prompt]
    return replace(enc, kwargs=kw, input_ids=kw["input_ids"][0].cpu(), is_prompt=pos < n_prompt,
                   is_image=is_image, valid=kw["attention_mask"][0].bool().cpu())


def _generate_new_ids(bundle: Any, sample_id: str, prompt_kw: dict[str, Tensor], gen_kwargs: dict[str, Any]) -> Tensor:
    """Greedy continuation ids ``[1, new]`` of the prompt.

    transformers models, our stand-ins and our DeepSeek-VL2 return the prompt followed by the continuation.
    """
    n_prompt = int(prompt_kw["input_ids"].shape[1])
    out = bundle.model.generate(**prompt_kw, **gen_kwargs)
    ids = out if isinstance(out, Tensor) else out.sequences
    if ids.shape[1] < n_prompt or not torch.equal(ids[:, :n_prompt].cpu(), prompt_kw["input_ids"].cpu()):
        raise SpecPrefetchError(f"sample {sample_id!r}: generate() did not return the prompt followed by the "
                                "continuation; cannot align the captured forward")
    return ids[:, n_prompt:]


# ------------------------------------------------------------------------------------------ provenance
def model_fingerprint(model_dir: Path | None, model_cfg: dict[str, Any]) -> dict[str, Any]:
    """What model produced the trace: a content hash of a local directory, or the hub id and revision.

    Files up to 256 MiB are hashed fully; larger checkpoint shards by size plus their first and last MiB,
    which identifies a download without reading tens of GB.
    """
    if model_dir is None:
        return {"hub_id": model_cfg.get("hub_id"), "revision": model_cfg["revision"]}
    h = hashlib.sha256()
    n_files = 0
    for path in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir).as_posix()
        size = path.stat().st_size
        if size <= FULL_HASH_LIMIT:
            digest = sha256_file(path)
        else:
            with open(path, "rb") as f:
                head = f.read(1 << 20)
                f.seek(-(1 << 20), 2)
                digest = hashlib.sha256(head + f.read() + str(size).encode()).hexdigest()
        h.update(f"{rel}\0{size}\0{digest}\n".encode())
        n_files += 1
    return {"model_dir": str(model_dir), "model_dir_sha256": h.hexdigest(), "n_files": n_files}


def _workload_name(workload_dir: Path) -> str:
    """The workload's name from its manifest ("corpus" for the training corpus), else the directory name."""
    from specprefetch.data.workloads import read_manifest

    return str(read_manifest(workload_dir).get("name") or workload_dir.name)


def _workload_sha(workload_dir: Path) -> str | None:
    path = Path(workload_dir) / "manifest.json"
    return sha256_file(path) if path.is_file() else None


def _trace_meta(cfg: dict[str, Any], model_name: str, model_dir: Path | None, workload_dir: Path, spec: Any,
                scatter: dict[str, Any], device: str) -> dict[str, Any]:
    """The trace manifest's description of what was traced: model and routing shapes, workload, mode, scatter
    shard, and the provenance that pins the checkpoint (fingerprint), the workload (manifest digest) and the
    ``traces`` settings."""
    tcfg = cfg["traces"]
    model_cfg = cfg["models"][model_name]
    return {
        "model": model_name,
        "workload": _workload_name(workload_dir),
        "mode": tcfg["mode"],
        "scatter": scatter,
        **{k: v for k, v in spec.describe().items() if k not in ("n_moe_layers",)},
        "provenance": provenance(
            tcfg, int(cfg["seed"]), traces_config=tcfg, model_config_hash=config_hash(model_cfg),
            model=model_fingerprint(Path(model_dir) if model_dir is not None else
                                    (Path(model_cfg["path"]) if model_cfg.get("path") else None), model_cfg),
            workload_dir=str(workload_dir), workload_manifest_sha256=_workload_sha(workload_dir),
            device=str(device), profile=cfg.get("profile"),
        ),
    }


def _trace_samples(bundle: Any, samples: list[Any], workload_dir: Path, writer: TraceWriter,
                   tcfg: dict[str, Any], desc: str) -> int:
    """Run the model over every sample (with its greedy continuation in ``generate`` mode) and store each one's
    valid tokens' router inputs, logits and top-K; return how many samples were truncated to ``max_length``."""
    from specprefetch.models import encode_sample

    spec = bundle.routing
    input_dtype, logits_dtype = writer.input_dtype, writer.logits_dtype
    n_truncated = 0
    bar = tqdm(samples, desc=desc, unit="sample", disable=None)
    for sample in bar:
        enc = encode_sample(bundle, sample, workload_dir).to(bundle.device)
        n_truncated += int(enc.truncated)
        if tcfg["mode"] == "generate":
            enc = with_continuation(bundle, enc, int(tcfg["max_new_tokens"]))
        # the first sample also recomputes the top-K with RoutingSpec and checks it equals the gates' own
        layers = traced_forward(bundle.model, spec, enc.kwargs, enc.valid, input_dtype, logits_dtype,
                                check=writer.n_samples == 0, pre_attention=writer.pre_attention)
        valid = enc.valid.cpu()
        writer.add_sample(**layers, token_ids=enc.input_ids.cpu()[valid],
                          position=torch.arange(valid.shape[0])[valid], is_image=enc.is_image.cpu()[valid],
                          is_prompt=enc.is_prompt.cpu()[valid])
        bar.set_postfix(tokens=writer.n_tokens, shards=writer.n_shards, refresh=False)
    return n_truncated


# ------------------------------------------------------------------------------------------ driver
def extract_traces(cfg: dict[str, Any], model_name: str, model_dir: Path | None, workload_dir: Path,
                   out_dir: Path, device: str = "cpu", shard: tuple[int, int] | None = None) -> dict[str, Any]:
    """Write the routing trace of ``model_name`` on the workload in ``workload_dir`` to ``out_dir``.

    ``shard=(i, n)`` extracts only scatter shard i of n (a contiguous range of samples, :func:`scatter_range`;
    ``sample_index`` stays workload-global), for :func:`gather_traces` to join. Returns :func:`trace_stats` of the
    written trace. ``out_dir`` appears only when every sample succeeded.
    """
    from specprefetch.data.workloads import read_workload
    from specprefetch.models import load_bundle

    tcfg = cfg["traces"]
    mode = tcfg["mode"]
    if mode not in MODES:
        raise SpecPrefetchError(f"invalid config key 'traces.mode': {mode!r} (use {', '.join(MODES)})")
    input_dtype = dtype_from_name(tcfg["input_dtype"], INPUT_DTYPES, "traces.input_dtype")
    logits_dtype = dtype_from_name(tcfg["logits_dtype"], LOGITS_DTYPES, "traces.logits_dtype")
    seed_everything(int(cfg["seed"]))
    workload_dir, out_dir = Path(workload_dir), Path(out_dir)
    samples = read_workload(workload_dir)
    if not samples:
        raise SpecPrefetchError(f"{workload_dir}: workload has no samples")
    index, count = shard or (0, 1)
    lo, hi = scatter_range(len(samples), index, count)
    if lo == hi:
        raise SpecPrefetchError(f"{workload_dir}: scatter shard {index} of {count} is empty ({len(samples)} samples); "
                                f"lower config key 'traces.scatter'")
    samples = samples[lo:hi]
    bundle = load_bundle(cfg, model_name, model_dir, device=device)
    meta = _trace_meta(cfg, model_name, model_dir, workload_dir, bundle.routing,
                       {"index": index, "count": count, "samples": [lo, hi]}, device)
    log.info("extracting %s traces of %s on %s (%d samples, scatter shard %d of %d) -> %s", mode, model_name,
             workload_dir.name, len(samples), index, count, out_dir)
    start = time.perf_counter()
    with TraceWriter(out_dir, meta, int(tcfg["shard_tokens"]), input_dtype, logits_dtype,
                     sample_offset=lo, pre_attention=bool(tcfg.get("pre_attention", False))) as writer, \
            torch.inference_mode():
        writer.set_routers(bundle.routing.router_tensors())
        n_truncated = _trace_samples(bundle, samples, workload_dir, writer, tcfg,
                                     desc=f"traces {model_name}/{workload_dir.name}")
        writer.meta["n_truncated"] = n_truncated
        if n_truncated:
            log.warning("%d of %d samples were truncated to models.%s.max_length", n_truncated, len(samples),
                        model_name)
    log.info("wrote %d tokens of %d samples in %.1fs", writer.n_tokens, writer.n_samples,
             time.perf_counter() - start)
    return trace_stats(out_dir)
