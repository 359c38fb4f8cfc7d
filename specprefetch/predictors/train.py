"""Train (or, for training-free methods, fit) a next-layer expert predictor (paper §3.4).

Objective: L_pred = 1/(L−1) Σ_l 1/|Ω| Σ_t KL(π_t^{l+1} ‖ π̂_t^{l+1}) with π = softmax of the frozen router's
logits (stop-grad: they are data) and π̂ = softmax of the predictor's logits. Optimisation goes through the
Hugging Face ``Trainer`` with the paper's recipe from the config (AdamW β/ε/lr/weight decay, cosine schedule
with warmup ratio, gradient clipping, bf16 autocast, one epoch, DeepSpeed ZeRO when configured and started by a
distributed launcher: NCCL on CUDA, gloo on CPU). Data comes from stored traces (``source: traces``) or from the
frozen model run in the loop on the corpus (``source: online``); both give whole-sample batches in the trace layout.

Training-free methods (fate, previous_token, frequency, oracle) only collect what they need (the gates,
the corpus expert counts) and save. The output directory (``predictor.safetensors`` + ``meta.json`` with
loss curve, wall time and provenance) appears atomically.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from specprefetch.contracts import read_doc
from specprefetch.io import SpecPrefetchError, atomic_path, config_hash, provenance, seed_everything, sha256_file
from specprefetch.predictors.base import METHODS, Predictor, PredictorDims, build_predictor, predictor_class
from specprefetch.predictors.base import next_layer_kl as next_layer_kl  # the paper's objective (Predictor.loss)
from specprefetch.predictors.data import OnlineChunks, TraceChunks, steps_for
from specprefetch.predictors.sizing import seed_indices, sized_config

log = logging.getLogger(__name__)
SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


# --------------------------------------------------------------------------------------------- setup helpers


def resolve_precision(precision: str) -> str:
    """'bf16' or 'fp32'. bf16 is autocast (bf16 compute, fp32 weights and optimizer states) on the training device:
    ``bf16`` on CPU (torch's CPU autocast) and on a CUDA device with bf16, ``auto`` only on a CUDA device with bf16."""
    if precision not in ("auto", "bf16", "fp32"):
        raise SpecPrefetchError(f"invalid predictors.training.precision {precision!r}")
    if precision == "fp32":
        return "fp32"
    if not torch.cuda.is_available():
        return "bf16" if precision == "bf16" else "fp32"
    if torch.cuda.is_bf16_supported():
        return "bf16"
    if precision == "bf16":
        log.warning("predictors.training.precision is bf16 but the CUDA device has no bf16: training in fp32")
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

DDP_TIMEOUT_S = 1800  # TrainingArguments' default ddp_timeout, also for the gloo group DeepSpeed runs over on CPU


def deepspeed_config_path(tcfg: Mapping[str, Any], warn: bool = True) -> Path | None:
    """The DeepSpeed config this process trains with, or None.

    ``predictors.training.deepspeed_config`` (relative paths from the repository root, as the config check reads
    them) is used when the process was started by a distributed launcher (torchrun, ``accelerate launch``, the
    ``deepspeed`` launcher: ``LOCAL_RANK`` is set); ZeRO partitions over processes, so a single process started
    without one trains with the plain Trainer (same optimizer, schedule and precision) and says so in a warning.
    Under a launcher, a missing ``deepspeed`` package is an error (the run asked for ZeRO's memory savings).
    """
    ds = tcfg.get("deepspeed_config")
    if not ds:
        return None
    if "LOCAL_RANK" not in os.environ:
        if warn:
            log.warning("predictors.training.deepspeed_config %s ignored: this process was not started by a "
                        "distributed launcher (predictors.training.launcher, e.g. torchrun); training without "
                        "DeepSpeed", ds)
        return None
    if importlib.util.find_spec("deepspeed") is None:
        raise SpecPrefetchError(f"predictors.training.deepspeed_config is {ds} but deepspeed is not installed: "
                                "pip install 'specprefetch[deepspeed]'")
    from specprefetch.config import REPO_ROOT

    path = Path(ds)
    return path if path.is_absolute() else REPO_ROOT / path


def deepspeed_settings(path: Path, precision: str) -> dict[str, Any]:
    """The DeepSpeed config as the Trainer gets it: the file with the precision filled in.

    bf16 means autocast everywhere (bf16 compute, fp32 weights, fp32 optimizer states): without DeepSpeed the
    Trainer's (accelerate's) autocast, with it DeepSpeed's ``torch_autocast`` section, whose ``enabled: "auto"``
    is filled here from ``precision``. DeepSpeed's own ``bf16`` mode (bf16 weights, and the Trainer would cast the
    KL targets to bf16) is not used: ``bf16.enabled`` must be false or "auto" (the Trainer fills it with its own
    ``bf16``, false under DeepSpeed). The learning-rate schedule is the Trainer's (``predictors.training.scheduler``
    with ``warmup_ratio``): a ``scheduler`` section (DeepSpeed's WarmupCosineLR warms up logarithmically and decays
    to 1e-4 of the peak) is refused. The Trainer fills the other "auto" values (lr, betas, eps, weight decay,
    gradient clipping, batch sizes) and refuses explicit ones that differ from the config.
    """
    conf = copy.deepcopy(read_doc(path, None, "DeepSpeed config"))
    where = str(path)
    if "scheduler" in conf:
        raise SpecPrefetchError(f"{where}: remove the 'scheduler' section: the schedule is predictors.training's "
                                "(scheduler, warmup_ratio), which the Trainer hands to DeepSpeed")
    for key in ("bf16", "fp16"):
        if (conf.get(key) or {}).get("enabled", False) not in (False, "auto"):
            raise SpecPrefetchError(f"{where}: {key}.enabled must be false or \"auto\": precision bf16 runs as "
                                    "torch_autocast (bf16 compute, fp32 weights), set by predictors.training.precision")
    autocast = precision == "bf16"
    section = conf.setdefault("torch_autocast", {"enabled": "auto"})
    if section.get("enabled", "auto") == "auto":
        section["enabled"] = autocast
    elif bool(section["enabled"]) != autocast:
        raise SpecPrefetchError(f"{where}: torch_autocast.enabled is {section['enabled']} but predictors.training."
                                f"precision resolves to {precision}: set it to \"auto\"")
    if autocast:
        section.setdefault("dtype", "bfloat16")
    return conf


def _gloo_deepspeed_state() -> None:
    """Set up accelerate's distributed state for DeepSpeed over gloo (CPU).

    accelerate only starts DeepSpeed when not on CPU and, with no accelerator, picks no backend (its state would
    then count one process); so on CPU the state is made here, before the TrainingArguments, which then use it
    (``use_configured_state``): ``deepspeed.init_distributed(dist_backend="gloo")`` over the launcher's
    RANK/WORLD_SIZE/MASTER_ADDR. DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) would pick oneCCL ("ccl")
    only with oneccl_bindings_for_pytorch installed; the backend named here is gloo either way. Its shared-memory
    all-reduce op (DeepSpeed inference's, not used by ZeRO training) is marked unavailable, so nothing is
    compiled: without that, the first run JIT-builds it with g++.
    """
    from datetime import timedelta

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    # deepspeed.ops probes every op's build (compiler runs) on the table's first access; build_shm_op alone reads it
    table = vars(deepspeed.ops).setdefault("__compatible_ops__", {})
    table["deepspeed_shm_comm"] = False
    if PartialState._shared_state and PartialState().distributed_type == DistributedType.DEEPSPEED:
        return
    AcceleratorState._reset_state(reset_partial_state=True)
    before = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # how accelerate tells its state to start DeepSpeed's comm
    try:
        PartialState(backend="gloo", timeout=timedelta(seconds=DDP_TIMEOUT_S))
    finally:
        if before is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = before


def _make_trainer(predictor: Predictor, dataset: Any, collate: Any, tcfg: Mapping[str, Any], steps: int,
                  precision: str, out_dir: str, loss_log: list[float], lr_log: list[float] | None = None) -> Any:
    """A ``transformers.Trainer`` whose loss is the next-layer KL (custom ``compute_loss``); with
    ``checkpoint_steps`` it saves a resumable checkpoint (the latest only) in ``out_dir`` that often.

    With a DeepSpeed config (:func:`deepspeed_config_path`) the Trainer runs DeepSpeed (ZeRO as the file says;
    NCCL on CUDA, gloo on CPU) with :func:`deepspeed_settings`; the step's learning rate goes to ``lr_log``.
    """
    from transformers import Trainer, TrainingArguments

    class _KLTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            if lr_log is not None and self.optimizer is not None:
                lr_log.append(float(self.optimizer.param_groups[0]["lr"]))  # the rate this step's update uses
            preds = model(inputs)
            loss = predictor.loss(preds, inputs)
            loss_log.append(float(loss.detach().float()))
            return (loss, preds) if return_outputs else loss

    cuda = torch.cuda.is_available()
    ds_path = deepspeed_config_path(tcfg)
    ds = deepspeed_settings(ds_path, precision) if ds_path is not None else None
    gloo_ds = ds is not None and not cuda
    if gloo_ds:
        _gloo_deepspeed_state()
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
        bf16=precision == "bf16" and ds is None,  # under DeepSpeed its torch_autocast does it (deepspeed_settings)
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
        accelerator_config={"dispatch_batches": False, "split_batches": False, "use_configured_state": gloo_ds},
        ddp_find_unused_parameters=False,  # multi-process runs (torchrun): every adapter gets a gradient
        ddp_timeout=DDP_TIMEOUT_S,
        deepspeed=ds,
    )
    return _KLTrainer(model=predictor, args=args, train_dataset=dataset, data_collator=collate)


def state_digest(module: torch.nn.Module) -> str:
    """sha256 of a module's state (names and float32 values, in name order): equal digests, equal weights."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _compute_probe(predictor: Predictor, seen: dict[str, Any]) -> Any:
    """Wrap the predictor's forward to record, at the first training forward, whether autocast was on and the
    dtypes; returns the undo. The wrapper sits inside whatever autocast the Trainer applies (accelerate wraps
    ``forward`` itself, DeepSpeed's engine calls the module under its autocast), so it sees what the maths ran in."""
    import functools

    inner = predictor.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if not seen and predictor.training:
            p = next(predictor.parameters())
            seen.update(autocast=bool(torch.is_autocast_enabled(p.device.type)),
                        autocast_dtype=str(torch.get_autocast_dtype(p.device.type)).removeprefix("torch."),
                        output_dtype=str(out[0].dtype).removeprefix("torch."),
                        param_dtype=str(p.dtype).removeprefix("torch."), device=p.device.type)
        return out

    predictor.forward = forward  # type: ignore[method-assign]
    # the Trainer's own wrapping (accelerate's autocast) goes with it: the class's forward is left
    return lambda: predictor.__dict__.pop("forward", None)


def _distributed_record(trainer: Any, predictor: Predictor, world: int, ds_path: Path | None) -> dict[str, Any]:
    """What ran, for meta.json: process-group backend, each rank's weight digest, and DeepSpeed's effective
    settings read back from its engine (ZeRO stage, optimizer and its hyper-parameters, clipping, batch sizes,
    how much of the optimizer state this rank holds)."""
    import torch.distributed as dist

    digest = state_digest(predictor)
    record: dict[str, Any] = {"backend": None, "world_size": world, "param_sha256_by_rank": [digest], "deepspeed": None}
    if dist.is_available() and dist.is_initialized():
        record["backend"] = str(dist.get_backend())
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)
        record["param_sha256_by_rank"] = digests
    engine = getattr(trainer, "deepspeed", None)
    if engine is None:
        return record
    import deepspeed

    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    held = sum(int(v.numel()) for state in inner.state.values() for k, v in state.items() if k == "exp_avg")
    held_by_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held_by_rank, held)
    record["deepspeed"] = {
        "version": deepspeed.__version__,
        "config": str(ds_path),
        "zero_stage": int(engine.zero_optimization_stage()),
        "optimizer": type(opt).__name__,
        "base_optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "optimizer_hparams": {k: (list(v) if isinstance(v, tuple) else v) for k, v in inner.defaults.items()
                              if k in ("lr", "betas", "eps", "weight_decay")},
        "gradient_clipping": float(engine.gradient_clipping()),
        "train_micro_batch_size_per_gpu": int(engine.train_micro_batch_size_per_gpu()),
        "train_batch_size": int(engine.train_batch_size()),
        "bf16_weights": bool(engine.bfloat16_enabled()),
        "torch_autocast": bool(engine.torch_autocast_enabled()),
        "torch_autocast_dtype": str(engine.torch_autocast_dtype()).removeprefix("torch.")
        if engine.torch_autocast_enabled() else None,
        "lr_scheduler": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
        "optimizer_state_numel_by_rank": held_by_rank,  # Adam's exp_avg elements each rank holds (ZeRO: a share)
        "trainable_numel": predictor.trainable_params(),
        "accelerator": type(deepspeed.get_accelerator()).__name__,
    }
    return record


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
    lr_log: list[float] = []
    compute: dict[str, Any] = {}
    use_ckpt = ckpt_dir is not None and int(tcfg["checkpoint_steps"]) > 0
    resume = latest_checkpoint(ckpt_dir) if use_ckpt else None
    with contextlib.ExitStack() as stack:
        out = str(ckpt_dir) if use_ckpt else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="specprefetch-trainer-"))
        trainer = _make_trainer(predictor, dataset, collate, tcfg, steps, precision, out, loss_log, lr_log)
        log.info("training %s: %d steps over %d chunks (%d tokens), %s%s%s", predictor.method, steps,
                 dataset.n_chunks, dataset.n_tokens, precision, ", DeepSpeed" if trainer.is_deepspeed_enabled else "",
                 f", resuming from {resume}" if resume else "")
        unprobe = _compute_probe(predictor, compute)
        try:
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        finally:
            unprobe()
        history = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        distributed = _distributed_record(trainer, predictor, world, deepspeed_config_path(tcfg)
                                          if trainer.is_deepspeed_enabled else None)
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
        "lr_curve": lr_log,  # the learning rate of each step's update (this run's steps; not across a resume)
        "compute": compute,  # autocast and dtypes seen in the first training forward
        "distributed": distributed,  # backend, per-rank weight digests, DeepSpeed's effective settings
    }


# --------------------------------------------------------------------------------------------- entry point


@dataclasses.dataclass
class _TrainingData:
    """What a predictor is fitted on, decided once before any weight is drawn.

    ``traces`` is the corpus trace directory as given and ``reader`` its open reader (None online without
    traces; kept for the records even when a learned method trains online). ``bundle`` is the frozen model of
    ``source: online``; ``dataset``/``collate`` are what the Trainer iterates (learned methods) or what a
    training-free method counts online. ``dims`` are the predictor's shapes, checked against the config's model;
    ``max_token_id`` is the largest token id the draft model's vocabulary must hold (-1 when not known).
    """

    traces: Path | None
    reader: Any | None
    online: bool
    dims: PredictorDims
    max_token_id: int = -1
    bundle: Any = None
    dataset: Any = None
    collate: Any = _first

    def trace_record(self) -> dict[str, Any] | None:
        """meta.json's ``trained_on``: which trace (directory and manifest digest) and how many tokens it holds."""
        if self.reader is None:
            return None
        return {"dir": str(self.traces), "manifest_sha256": sha256_file(Path(self.traces) / "manifest.json"),
                "n_tokens": self.reader.n_tokens}

    def release(self) -> None:
        """Drop the frozen model and the data stream (the collate holds the dataset), so it is freed before the
        predictor is written."""
        self.bundle = self.dataset = None
        self.collate = _first


def _training_data(cfg: Mapping[str, Any], model_name: str, method: str, learned: bool,
                   train_traces: Path | None, model_dir: Path | None, corpus_dir: Path | None) -> _TrainingData:
    """Open the inputs ``predictors.training.source`` asks for and check their shapes against the config's model.

    Online, learned methods always train on the live model, while training-free ones use the traces when given
    (they need no forward pass). From traces, learned methods get shuffled whole-sample chunks of
    ``batch_tokens``; training-free ones read the trace themselves.
    """
    mcfg = cfg["models"][model_name]
    tcfg = cfg["predictors"]["training"]
    reader = _open_trace(Path(train_traces) if train_traces is not None else None, model_name)
    online = tcfg["source"] == "online" and (learned or reader is None)
    if reader is None and not online:
        raise SpecPrefetchError(f"training {method} needs the corpus traces (--traces DIR)")
    if online:
        bundle, dataset = _online_dataset(cfg, model_name, model_dir, corpus_dir, tcfg)
        data = _TrainingData(train_traces, reader, online=True, dims=dims_from_spec(bundle.routing),
                             max_token_id=len(bundle.tokenizer) - 1, bundle=bundle, dataset=dataset,
                             collate=dataset.materialize)
        _check_dims_vs_config(data.dims, mcfg, f"model {model_dir}")
        return data
    data = _TrainingData(train_traces, reader, online=False, dims=PredictorDims.from_manifest(reader.manifest))
    if learned:
        data.dataset = TraceChunks(reader, int(tcfg["batch_tokens"]), seed=int(tcfg["seed"]), shuffle=True)
        data.max_token_id = data.dataset.max_token_id
    _check_dims_vs_config(data.dims, mcfg, f"trace {train_traces}")
    return data


def _new_predictor(cfg: Mapping[str, Any], model_name: str, method: str, data: _TrainingData,
                   model_dir: Path | None, lookahead: int = 1) -> tuple[Predictor, dict[str, Any]]:
    """A freshly initialised predictor for the data's shapes at look-ahead ``lookahead`` (its weights come from the
    run's seed), and the record of its size rule (empty without one: ``predictors.<method>.size``, resolved at these
    shapes).

    The draft model also needs a vocabulary that holds every token id it will see, and starts from the frozen
    model's input embeddings (projected to its width): from ``model_dir``, else from the loaded model online.
    """
    dims = dataclasses.replace(data.dims, lookahead=lookahead)
    table = None
    if method == "draft_model":
        from specprefetch.predictors.draft_model import find_input_embeddings

        table = find_input_embeddings(model_dir) if model_dir is not None else None
        if table is None and data.bundle is not None:  # online from the hub: the loaded model's own table
            table = data.bundle.model.get_input_embeddings().weight.detach().float().cpu()
        dims = dataclasses.replace(dims, vocab_size=resolve_vocab(cfg, model_dir, data.max_token_id, table))
    sized, size_rule = sized_config(cfg, method, model_name, dims)
    predictor = build_predictor(method, sized, dims, model=model_name)
    if table is not None:
        predictor.init_embeddings(table)  # type: ignore[attr-defined]
    elif getattr(predictor, "freeze_embedding", False):
        log.warning("draft_model: freeze_embedding is set but no input embedding was found in %s: the frozen "
                    "embedding stays random", model_dir if model_dir is not None else "(no --model-dir)")
    if size_rule:
        log.info("%s for %s sized by %s: %s %d, %.3gx SpecPrefetch's parameters (paper %.3gx, residual %+.2f%%)",
                 method, model_name, size_rule["rule"], size_rule["key"], size_rule["width"],
                 size_rule["achieved_ratio"], size_rule["target_ratio"], size_rule["residual_pct"])
    return predictor, size_rule


def _resume_dir(cfg: Mapping[str, Any], model_name: str, method: str, predictor: Predictor, data: _TrainingData,
                out_dir: Path, deepspeed: bool) -> Path | None:
    """Where this run keeps its resume checkpoints (None without ``checkpoint_steps``).

    The directory is stamped with the run's identity — model, method and its settings, training recipe, shapes,
    data (trace manifest or online) and, under DeepSpeed, the process count (a DeepSpeed checkpoint resumes only
    under DeepSpeed, on as many processes) — so a rerun of the same job resumes and any other run starts afresh.
    """
    tcfg = cfg["predictors"]["training"]
    if int(tcfg["checkpoint_steps"]) <= 0:
        return None
    run_id = {"model": dict(cfg["models"][model_name]), "method": method, "method_cfg": predictor.method_cfg,
              "training": dict(tcfg), "dims": dataclasses.asdict(predictor.dims), "online": data.online,
              "trace": sha256_file(Path(data.traces) / "manifest.json") if data.reader is not None else None}
    if deepspeed:
        run_id["deepspeed"] = {"world_size": int(os.environ.get("WORLD_SIZE", 1))}
    return _checkpoint_dir(checkpoint_dir_for(out_dir), config_hash(run_id))


def _fit_training_free(predictor: Predictor, data: _TrainingData) -> int:
    """Training-free methods only collect what they need (gates, corpus expert counts), from the traces or online
    from the live model; return how many tokens they saw."""
    if data.online:
        _fit_statistics_online(predictor, data.bundle, data.dataset)
        return data.dataset.n_tokens
    predictor.fit_statistics(data.reader)
    return data.reader.n_tokens


def _save_output(predictor: Predictor, meta: dict[str, Any], out_dir: Path, learned: bool) -> dict[str, Any]:
    """Write ``out_dir`` atomically (rank 0 only under distributed training) and drop the resume checkpoints, which
    a complete output no longer needs; return the predictor's full meta."""
    if int(os.environ.get("RANK", 0)) != 0:
        return {**predictor.meta(), **meta}
    with atomic_path(out_dir, is_dir=True) as tmp:
        predictor.save(tmp, extra_meta=meta)
    if learned:
        shutil.rmtree(checkpoint_dir_for(out_dir), ignore_errors=True)
    log.info("saved %s predictor for %s to %s (%d trainable params, final loss %s, %.1fs)", predictor.method,
             meta["model"], out_dir, predictor.trainable_params(), meta["final_loss"], meta["wall_time_s"])
    return {**predictor.meta(), **meta}


def seeded_config(cfg: Mapping[str, Any], method: str, seed_index: int) -> dict[str, Any]:
    """The config seed index ``seed_index`` trains with: ``predictors.training.seed`` + the index (data order and
    initial weights; index 0 is the config itself). An index outside ``predictors.seeds`` (or above 0 for a
    training-free method) is one line naming the key."""
    learned = predictor_class(method).learned
    indices = seed_indices(cfg, learned)
    if seed_index not in indices:
        what = f"predictors.seeds is {len(indices)}: 0..{len(indices) - 1}" if learned else "training-free: seed 0"
        raise SpecPrefetchError(f"invalid seed index {seed_index} for {method} ({what})")
    if seed_index == 0:
        return dict(cfg)
    tcfg = {**cfg["predictors"]["training"], "seed": int(cfg["predictors"]["training"]["seed"]) + seed_index}
    return {**cfg, "predictors": {**cfg["predictors"], "training": tcfg}}


def train_predictor(
    cfg: Mapping[str, Any],
    model_name: str,
    method: str,
    train_traces: Path | None,
    out_dir: Path,
    model_dir: Path | None = None,
    corpus_dir: Path | None = None,
    seed_index: int = 0,
    lookahead: int = 1,
) -> dict[str, Any]:
    """Train/fit ``method`` for ``model_name`` and save it to ``out_dir`` (atomically); return its meta.

    ``train_traces``: the corpus trace directory (the data of ``source: traces``; with ``source: online`` it
    may be None, then gates / expert counts come from the model). ``model_dir``: the frozen model (draft-model
    embedding init; required online). ``corpus_dir``: the corpus workload directory (required online).
    ``seed_index``: which of the ``predictors.seeds`` runs this is (:func:`seeded_config`). ``lookahead``: the
    distance d of its pairs (layer l predicts layer l+d; the paper's 1).
    """
    if method not in METHODS:
        raise SpecPrefetchError(f"unknown predictor method {method!r}; known: {', '.join(METHODS)}")
    t0 = time.perf_counter()
    mcfg = _model_cfg(cfg, model_name)
    cfg = seeded_config(cfg, method, seed_index)
    tcfg = cfg["predictors"]["training"]
    seed = int(tcfg["seed"])
    if tcfg["source"] not in ("traces", "online"):
        raise SpecPrefetchError(f"invalid predictors.training.source {tcfg['source']!r}: use traces or online")
    model_dir = Path(model_dir) if model_dir is not None else None
    seed_everything(seed)  # before the data order and the initial weights are drawn

    learned = predictor_class(method).learned
    ds_path = deepspeed_config_path(tcfg, warn=False) if learned else None  # fails now if deepspeed is missing
    data = _training_data(cfg, model_name, method, learned, train_traces, model_dir, corpus_dir)
    predictor, size_rule = _new_predictor(cfg, model_name, method, data, model_dir, lookahead)
    run: dict[str, Any] = {"source": "online" if data.online else "traces"}
    if learned:
        precision = resolve_precision(tcfg["precision"])
        run.update(precision=precision, batch_tokens=int(tcfg["batch_tokens"]))
        ckpt_dir = _resume_dir(cfg, model_name, method, predictor, data, out_dir, deepspeed=ds_path is not None)
        run.update(_fit_learned(predictor, data.dataset, data.collate, tcfg, precision, ckpt_dir))
    else:
        run["n_tokens"] = _fit_training_free(predictor, data)
    trace_info = data.trace_record()
    data.release()  # the frozen model goes before writing

    fragment = {"model": dict(mcfg), "method": method, "method_cfg": predictor.method_cfg, "training": dict(tcfg)}
    meta = {
        "model": model_name,
        "seed_index": seed_index,
        "config_hash": config_hash(fragment),
        "training": run,
        "final_loss": run.get("final_loss"),
        "loss_curve": run.pop("loss_curve", []),
        "wall_time_s": round(time.perf_counter() - t0, 3),
        "trained_on": trace_info,
        "corpus_dir": str(corpus_dir) if data.online and corpus_dir is not None else None,
        "provenance": provenance(fragment, seed, model_dir=str(model_dir) if model_dir else None),
    }
    if size_rule:
        meta["size_rule"] = size_rule
    return _save_output(predictor, meta, out_dir, learned)


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
    if corpus_dir is None:
        raise SpecPrefetchError("predictors.training.source is 'online': pass the corpus workload directory "
                                "(--corpus)")
    from specprefetch.data.workloads import read_workload
    from specprefetch.models import load_bundle

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    # model_dir: a stand-in or local checkpoint; None loads the config's hub checkpoint (load_bundle says which)
    bundle = load_bundle(dict(cfg), model_name, None if model_dir is None else Path(model_dir), device=device)
    samples = read_workload(Path(corpus_dir))
    if not samples:
        raise SpecPrefetchError(f"{corpus_dir}: the corpus has no samples")
    dataset = OnlineChunks(bundle, samples, Path(corpus_dir), int(tcfg["batch_tokens"]),
                           cfg.get("traces") or {}, seed=int(tcfg["seed"]), shuffle=True)
    return bundle, dataset
