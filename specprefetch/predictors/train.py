"""Train (or, for training-free methods, fit) a next-layer expert predictor (paper §3.4).

Objective: L_pred = 1/(L−1) Σ_l 1/|Ω| Σ_t KL(π_t^{l+1} ‖ π̂_t^{l+1}) with π = softmax of the frozen router's
logits (stop-grad: they are data) and π̂ = softmax of the predictor's logits. Optimisation goes through the
Hugging Face ``Trainer`` with the paper's recipe from the config (AdamW β/ε/lr/weight decay, cosine schedule
with warmup ratio, gradient clipping, bf16 where the hardware has it, one epoch, DeepSpeed when configured
and on CUDA). Data comes from stored traces (``source: traces``) or from the frozen model run in the loop
on the corpus (``source: online``); both give whole-sample batches in the trace layout.

Training-free methods (fate, previous_token, frequency, oracle) only collect what they need (the gates,
the corpus expert counts) and save. The output directory (``predictor.safetensors`` + ``meta.json`` with
loss curve, wall time and provenance) appears atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from specprefetch.contracts import read_doc
from specprefetch.io import SpecPrefetchError, atomic_path, config_hash, provenance, seed_everything, sha256_file
from specprefetch.predictors.base import METHODS, Predictor, PredictorDims, build_predictor, predictor_class
from specprefetch.predictors.data import OnlineChunks, TraceChunks, steps_for

log = logging.getLogger(__name__)
SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


# --------------------------------------------------------------------------------------------- objective


def next_layer_kl(preds: Sequence[Tensor], logits: Sequence[Tensor]) -> Tensor:
    """Mean over layer pairs of the token-mean KL(π^{l+1} ‖ π̂^{l+1}); ``logits`` are all L layers' router
    logits (the target of pair l is layer l+1), ``preds`` the L−1 predictions. Computed in float32."""
    if len(preds) != len(logits) - 1:
        raise SpecPrefetchError(f"KL loss: {len(preds)} predictions for {len(logits)} layers (need L-1)")
    terms = []
    for l, z in enumerate(preds):
        target = F.log_softmax(logits[l + 1].detach().float(), dim=-1)
        terms.append(F.kl_div(F.log_softmax(z.float(), dim=-1), target, log_target=True, reduction="batchmean"))
    return torch.stack(terms).mean()


# --------------------------------------------------------------------------------------------- setup helpers


def resolve_precision(precision: str) -> str:
    """'bf16' or 'fp32': bf16 only when asked for (bf16/auto) and CUDA supports it; CPU trains in fp32."""
    if precision not in ("auto", "bf16", "fp32"):
        raise SpecPrefetchError(f"invalid predictors.training.precision {precision!r}")
    if precision == "fp32":
        return "fp32"
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    if precision == "bf16":
        log.warning("predictors.training.precision is bf16 but no CUDA bf16 device is available: training in fp32")
    return "fp32"


def model_vocab_size(model_dir: Path | None) -> int | None:
    """``vocab_size`` from a model directory's config.json (top level or its text config), if present."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    path = Path(model_dir) / "config.json"
    conf = read_doc(path, None, "model config")
    for section in (conf, conf.get("text_config") or {}, conf.get("language_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return int(section["vocab_size"])
    return None


def resolve_vocab(cfg: Mapping[str, Any], model_dir: Path | None, max_token_id: int,
                  table: Tensor | None) -> int:
    """The draft model's vocabulary: the largest of the model's embedding rows / config vocab, the
    tokenizer config and the largest token id seen (so no training id falls into the unknown row)."""
    sizes = [max_token_id + 1]
    if table is not None:
        sizes.append(int(table.shape[0]))
    v = model_vocab_size(model_dir)
    if v:
        sizes.append(v)
    if (cfg.get("tokenizer") or {}).get("vocab_size"):
        sizes.append(int(cfg["tokenizer"]["vocab_size"]))
    return max(sizes)


def _model_cfg(cfg: Mapping[str, Any], model_name: str) -> Mapping[str, Any]:
    if model_name not in cfg.get("models", {}):
        raise SpecPrefetchError(f"model {model_name!r} is not in the config's models ({', '.join(cfg['models'])})")
    return cfg["models"][model_name]


def _open_trace(train_traces: Path | None, model_name: str) -> Any | None:
    if train_traces is None:
        return None
    from specprefetch.traces.store import TraceReader

    reader = TraceReader(train_traces, verify=True)
    if reader.manifest.get("model") not in (None, model_name):
        raise SpecPrefetchError(f"{Path(train_traces) / 'manifest.json'}: trace of model "
                                f"{reader.manifest.get('model')!r}, training a predictor for {model_name!r}")
    return reader


def _check_dims_vs_config(dims: PredictorDims, mcfg: Mapping[str, Any], where: str) -> None:
    from specprefetch.config import n_moe_layers

    expect = {"n_experts": mcfg["n_experts"], "top_k": mcfg["top_k"], "hidden_size": mcfg["hidden_size"],
              "n_layers": n_moe_layers(mcfg)}
    for k, v in expect.items():
        if getattr(dims, k) != int(v):
            raise SpecPrefetchError(f"{where}: {k}={getattr(dims, k)} but the config's model says {v}")


# --------------------------------------------------------------------------------------------- the Trainer


def _make_trainer(predictor: Predictor, dataset: Any, collate: Any, tcfg: Mapping[str, Any], steps: int,
                  precision: str, out_dir: str, loss_log: list[float]) -> Any:
    """A ``transformers.Trainer`` whose loss is the next-layer KL (custom ``compute_loss``); with
    ``checkpoint_steps`` it saves a resumable checkpoint (the latest only) in ``out_dir`` that often."""
    from transformers import Trainer, TrainingArguments

    class _KLTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            preds = model(inputs)
            loss = next_layer_kl(preds, inputs["logits"])
            loss_log.append(float(loss.detach().float()))
            return (loss, preds) if return_outputs else loss

    cuda = torch.cuda.is_available()
    ds = tcfg.get("deepspeed_config")
    if ds and not cuda:
        log.info("deepspeed_config %s ignored: no CUDA device", ds)
    betas = tcfg["betas"]
    warmup = float(tcfg["warmup_ratio"])
    scheduler = tcfg["scheduler"]
    if scheduler not in SCHEDULERS:
        raise SpecPrefetchError(f"invalid predictors.training.scheduler {scheduler!r}")
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=float(tcfg["lr"]),
        adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]),
        adam_epsilon=float(tcfg["eps"]),
        weight_decay=float(tcfg["weight_decay"]),
        optim="adamw_torch",
        lr_scheduler_type=SCHEDULERS[scheduler],
        warmup_steps=warmup if warmup < 1 else steps,
        max_grad_norm=float(tcfg["max_grad_norm"]),
        bf16=precision == "bf16",
        seed=int(tcfg["seed"]),
        data_seed=int(tcfg["seed"]),
        logging_steps=max(1, steps // 20),
        save_strategy="steps" if int(tcfg["checkpoint_steps"]) > 0 else "no",
        save_steps=max(1, int(tcfg["checkpoint_steps"])),
        save_total_limit=1,
        report_to="none",
        remove_unused_columns=False,
        label_names=[],
        dataloader_num_workers=0,
        dataloader_pin_memory=cuda,
        use_cpu=not cuda,
        accelerator_config={"dispatch_batches": False, "split_batches": False},
        ddp_find_unused_parameters=False,  # multi-process runs (torchrun): every adapter gets a gradient
        deepspeed=ds if (ds and cuda) else None,
    )
    return _KLTrainer(model=predictor, args=args, train_dataset=dataset, data_collator=collate)


def _first(items: Sequence[Any]) -> Any:
    """Collate for batch size 1: every dataset item already is a whole batch."""
    return items[0]


def latest_checkpoint(ckpt_dir: Path | None) -> Path | None:
    """The newest complete ``checkpoint-<step>`` in ``ckpt_dir`` (the Trainer writes its trainer_state.json last)."""
    if ckpt_dir is None or not ckpt_dir.is_dir():
        return None
    done = [d for d in ckpt_dir.glob("checkpoint-*") if (d / "trainer_state.json").is_file()
            and d.name.split("-")[-1].isdigit()]
    return max(done, key=lambda d: int(d.name.split("-")[-1]), default=None)


def checkpoint_dir_for(out_dir: Path) -> Path:
    """Where a predictor's resume checkpoints live: beside its output, so a rerun of the same job finds them."""
    return Path(out_dir).parent / f".{Path(out_dir).name}.checkpoints"


def _checkpoint_dir(ckpt_dir: Path, fingerprint: str) -> Path:
    """``ckpt_dir`` holding only checkpoints of this very run: one of another config or data is discarded."""
    stamp = ckpt_dir / "fingerprint.txt"
    if ckpt_dir.exists() and (not stamp.is_file() or stamp.read_text() != fingerprint):
        log.info("discarding %s: checkpoints of another configuration", ckpt_dir)
        shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint)
    return ckpt_dir


def _fit_learned(predictor: Predictor, dataset: Any, collate: Any, tcfg: Mapping[str, Any],
                 precision: str, ckpt_dir: Path | None = None) -> dict[str, Any]:
    """Run the Trainer; return what meta.json records about the run.

    With ``checkpoint_steps`` and a ``ckpt_dir`` (kept beside the output, so a preempted or killed job finds it),
    the run resumes from the newest checkpoint there (weights, optimizer, scheduler, RNG state and data position:
    the result equals an uninterrupted run) and the directory is removed after success.
    """
    import torch.distributed as dist

    # torchrun / accelerate launch set WORLD_SIZE before the Trainer initialises the process group
    world = (dist.get_world_size() if dist.is_available() and dist.is_initialized()
             else int(os.environ.get("WORLD_SIZE", 1)))
    steps = steps_for(dataset.n_chunks, float(tcfg["epochs"]), world)
    loss_log: list[float] = []
    use_ckpt = ckpt_dir is not None and int(tcfg["checkpoint_steps"]) > 0
    resume = latest_checkpoint(ckpt_dir) if use_ckpt else None
    with contextlib.ExitStack() as stack:
        out = str(ckpt_dir) if use_ckpt else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="specprefetch-trainer-"))
        trainer = _make_trainer(predictor, dataset, collate, tcfg, steps, precision, out, loss_log)
        log.info("training %s: %d steps over %d chunks (%d tokens), %s%s", predictor.method, steps,
                 dataset.n_chunks, dataset.n_tokens, precision, f", resuming from {resume}" if resume else "")
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        history = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    predictor.to("cpu").float().eval()
    tail = max(1, len(loss_log) // 20)
    return {
        "steps": steps,
        "n_chunks": dataset.n_chunks,
        "n_tokens": dataset.n_tokens,
        "initial_loss": loss_log[0] if loss_log else None,
        "final_loss": sum(loss_log[-tail:]) / tail if loss_log else None,
        "loss_curve": loss_log,
        "logged_loss": history,  # the Trainer's logged losses (kept across a resume)
        "resumed_from_step": int(resume.name.split("-")[-1]) if resume else None,
        "world_size": world,
    }


# --------------------------------------------------------------------------------------------- entry point


def train_predictor(
    cfg: Mapping[str, Any],
    model_name: str,
    method: str,
    train_traces: Path | None,
    out_dir: Path,
    model_dir: Path | None = None,
    corpus_dir: Path | None = None,
) -> dict[str, Any]:
    """Train/fit ``method`` for ``model_name`` and save it to ``out_dir`` (atomically); return its meta.

    ``train_traces``: the corpus trace directory (the data of ``source: traces``; with ``source: online`` it
    may be None, then gates / expert counts come from the model). ``model_dir``: the frozen model (draft-model
    embedding init; required online). ``corpus_dir``: the corpus workload directory (required online).
    """
    if method not in METHODS:
        raise SpecPrefetchError(f"unknown predictor method {method!r}; known: {', '.join(METHODS)}")
    t0 = time.perf_counter()
    mcfg = _model_cfg(cfg, model_name)
    tcfg = cfg["predictors"]["training"]
    seed = int(tcfg["seed"])
    source = tcfg["source"]
    if source not in ("traces", "online"):
        raise SpecPrefetchError(f"invalid predictors.training.source {source!r}: use traces or online")
    model_dir = Path(model_dir) if model_dir is not None else None
    seed_everything(seed)

    learned = predictor_class(method).learned
    reader = _open_trace(Path(train_traces) if train_traces is not None else None, model_name)
    # Online: learned methods always train on the live model; training-free ones use the traces if given.
    online = source == "online" and (learned or reader is None)
    if reader is None and not online:
        raise SpecPrefetchError(f"training {method} needs the corpus traces (--traces DIR)")

    bundle: Any = None
    dataset: Any = None
    collate: Any = _first
    if online:
        bundle, dataset = _online_dataset(cfg, model_name, model_dir, corpus_dir, tcfg)
        collate = dataset.materialize
        dims = dims_from_spec(bundle.routing)
        max_id = len(bundle.tokenizer) - 1
        _check_dims_vs_config(dims, mcfg, f"model {model_dir}")
    else:
        dims = PredictorDims.from_manifest(reader.manifest)
        max_id = -1
        if learned:
            dataset = TraceChunks(reader, int(tcfg["batch_tokens"]), seed=seed, shuffle=True)
            max_id = dataset.max_token_id
        _check_dims_vs_config(dims, mcfg, f"trace {train_traces}")

    table = None
    if method == "draft_model":
        from specprefetch.predictors.draft_model import find_input_embeddings

        table = find_input_embeddings(model_dir) if model_dir is not None else None
        dims = dataclasses.replace(dims, vocab_size=resolve_vocab(cfg, model_dir, max_id, table))

    predictor = build_predictor(method, cfg, dims, model=model_name)
    if table is not None:
        predictor.init_embeddings(table)  # type: ignore[attr-defined]
    elif getattr(predictor, "freeze_embedding", False):
        log.warning("draft_model: freeze_embedding is set but no input embedding was found in %s: the frozen "
                    "embedding stays random", model_dir if model_dir is not None else "(no --model-dir)")

    run: dict[str, Any] = {"source": "online" if online else "traces"}
    if learned:
        precision = resolve_precision(tcfg["precision"])
        run.update(precision=precision, batch_tokens=int(tcfg["batch_tokens"]))
        ckpt_dir = None
        if int(tcfg["checkpoint_steps"]) > 0:
            fingerprint = config_hash({"model": dict(mcfg), "method": method, "method_cfg": predictor.method_cfg,
                                       "training": dict(tcfg), "dims": dataclasses.asdict(dims), "online": online,
                                       "trace": sha256_file(Path(train_traces) / "manifest.json")
                                       if reader is not None else None})
            ckpt_dir = _checkpoint_dir(checkpoint_dir_for(out_dir), fingerprint)
        run.update(_fit_learned(predictor, dataset, collate, tcfg, precision, ckpt_dir))
    elif online:
        _fit_statistics_online(predictor, bundle, dataset)
        run["n_tokens"] = dataset.n_tokens
    else:
        predictor.fit_statistics(reader)
        run["n_tokens"] = reader.n_tokens
    bundle = dataset = None  # release the frozen model before writing

    fragment = {"model": dict(mcfg), "method": method, "method_cfg": predictor.method_cfg, "training": dict(tcfg)}
    trace_info = None
    if reader is not None:
        trace_info = {"dir": str(train_traces), "manifest_sha256": sha256_file(Path(train_traces) / "manifest.json"),
                      "n_tokens": reader.n_tokens}
    meta = {
        "model": model_name,
        "config_hash": config_hash(fragment),
        "training": run,
        "final_loss": run.get("final_loss"),
        "loss_curve": run.pop("loss_curve", []),
        "wall_time_s": round(time.perf_counter() - t0, 3),
        "trained_on": trace_info,
        "corpus_dir": str(corpus_dir) if online and corpus_dir is not None else None,
        "provenance": provenance(fragment, seed, model_dir=str(model_dir) if model_dir else None),
    }
    if int(os.environ.get("RANK", 0)) != 0:  # distributed training: rank 0 writes the output
        return {**predictor.meta(), **meta}
    with atomic_path(out_dir, is_dir=True) as tmp:
        predictor.save(tmp, extra_meta=meta)
    if learned:  # the output is complete: its resume checkpoints are no longer needed
        shutil.rmtree(checkpoint_dir_for(out_dir), ignore_errors=True)
    log.info("saved %s predictor for %s to %s (%d trainable params, final loss %s, %.1fs)", method, model_name,
             out_dir, predictor.trainable_params(), meta["final_loss"], meta["wall_time_s"])
    return {**predictor.meta(), **meta}


def dims_from_spec(spec: Any) -> PredictorDims:
    """Predictor dims of a live model's RoutingSpec (the online counterpart of the trace manifest)."""
    return PredictorDims(n_layers=len(spec.moe_layers), hidden_size=int(spec.hidden_size),
                         n_experts=int(spec.n_experts), top_k=int(spec.top_k), scoring=str(spec.scoring),
                         arch=str(spec.arch))


def _fit_statistics_online(predictor: Predictor, bundle: Any, dataset: OnlineChunks) -> None:
    """Training-free methods without traces: FATE takes the live gates, frequency counts the live routing."""
    if predictor.method == "fate":
        predictor.set_gates(bundle.routing.router_tensors())  # type: ignore[attr-defined]
    elif predictor.method == "frequency":
        batches = (dataset.materialize([chunk]) for chunk in dataset.chunks)
        predictor.count_batches(tqdm(batches, total=dataset.n_chunks, desc="frequency", disable=None))  # type: ignore[attr-defined]


def _online_dataset(cfg: Mapping[str, Any], model_name: str, model_dir: Path | None, corpus_dir: Path | None,
                    tcfg: Mapping[str, Any]) -> tuple[Any, OnlineChunks]:
    """Load the frozen model (on this process's GPU when there is one) and the corpus for ``source: online``."""
    if model_dir is None or corpus_dir is None:
        raise SpecPrefetchError("predictors.training.source is 'online': pass the model directory (--model-dir) "
                                "and the corpus workload directory (--corpus)")
    from specprefetch.data.workloads import read_workload
    from specprefetch.models import load_bundle

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    bundle = load_bundle(dict(cfg), model_name, Path(model_dir), device=device)
    samples = read_workload(Path(corpus_dir))
    if not samples:
        raise SpecPrefetchError(f"{corpus_dir}: the corpus has no samples")
    dataset = OnlineChunks(bundle, samples, Path(corpus_dir), int(tcfg["batch_tokens"]),
                           cfg.get("traces") or {}, seed=int(tcfg["seed"]), shuffle=True)
    return bundle, dataset
