"""Pretrain a stand-in from scratch on the corpus, so that it routes meaningfully before traces are taken.

Loss = next-token LM loss on every text token (image placeholders and padding excluded) + ``aux_loss_coef`` x
the Switch-style load-balancing loss (transformers' ``load_balancing_loss_func``, per MoE layer, averaged).
AdamW (routers at 3x the learning rate, see ``ROUTER_LR_MULT``), linear warmup then cosine decay, gradient
clipping, length-grouped batches, a fixed seed and deterministic algorithms: the same seed gives byte-identical
weights. On a shared CPU run it with one intra-op thread (``OMP_NUM_THREADS=1``, which Snakemake sets from a
rule's ``threads: 1``): two threads measured 16x more CPU time per step under oversubscription.

``train_log.json`` (saved in the model directory) reports what makes a stand-in usable for the paper's
measurements: LM loss against the corpus unigram baseline, per-layer routing entropy and expert load
(collapse shows as a large max load share), and FATE's cross-layer recall@K on held-out tokens against the
chance level K/n.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from specprefetch.io import SpecPrefetchError, atomic_path, provenance, seed_everything, sha256_file, write_json_atomic
from specprefetch.models.capture import RouterCapture
from specprefetch.models.loading import ModelBundle, collate_encoded, encode_sample, stand_in_sequence
from specprefetch.models.routing import RoutingSpec, discover_routing
from specprefetch.models.standins import StandIn, build_stand_in, save_stand_in, special_token_ids

log = logging.getLogger(__name__)

TRAIN_LOG = "train_log.json"
LOG_FORMAT = "specprefetch-pretrain-log/1"
HELDOUT_FRACTION = 0.05
MAX_HELDOUT = 64
ADAMW_BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01
CLIP_NORM = 1.0
MIN_LR_RATIO = 0.1
# Routers learn 3x faster than the rest. At a CPU-scale budget (400 steps) routers trained at the base rate stay
# near uniform (tiny-qwen3-vl-moe, embedded profile: top-8 softmax mass 0.11-0.21, entropy 4.55-4.78 of max 4.85
# nats), unlike the peaked routers of real checkpoints; 10x made them nearly one-hot (top-8 mass 0.88-1.0,
# entropy 0.2-1.0 nats); 3x gives top-8 mass 0.26-0.55, entropy 3.1-4.4 nats, the same held-out LM loss
# (4.34 vs 4.31 nats/token) and a balanced load (max expert share 0.024).
ROUTER_LR_MULT = 3.0


def read_corpus(corpus_dir: Path) -> list[Any]:
    """The corpus samples (workload format), validated by the data package's reader."""
    from specprefetch.data.workloads import read_workload

    samples = read_workload(Path(corpus_dir))
    if len(samples) < 2:
        raise SpecPrefetchError(f"{corpus_dir}: corpus has {len(samples)} sample(s); need at least 2 "
                                "(train and held-out)")
    return samples


def split_heldout(n: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded split of sample indices into (train, held-out): 5% held out, at least 1, at most 64."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_held = min(MAX_HELDOUT, max(1, round(n * HELDOUT_FRACTION)))
    return sorted(order[n_held:]), sorted(order[:n_held])


def lr_lambda(warmup: int, total: int) -> Any:
    """Linear warmup to the peak, then cosine decay to ``MIN_LR_RATIO`` x the peak at the last step."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def _target_labels(kwargs: dict[str, Tensor], masks: dict[str, Tensor]) -> Tensor:
    labels = kwargs["input_ids"].clone()
    labels[masks["is_image"] | ~masks["valid"]] = -100
    return labels


def lm_loss(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross entropy (logits at t predict labels at t+1; -100 ignored)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction=reduction)


class BalanceWindow:
    """Global-batch load balancing (Qiu et al. 2025, "Demons in the Detail", Qwen3's recipe): the expert load
    fractions f of the Switch loss N * sum_i f_i P_i are counted over the last ``steps`` batches, not the current
    one only. f carries no gradient, so N * sum_i f_i^window P_i^batch is exactly the current batch's share of the
    gradient of a balance loss over the whole window: a batch may route (say) its image tokens to a few experts as
    long as the window as a whole stays balanced. ``steps`` 1 is the per-batch (micro-batch) loss."""

    def __init__(self, steps: int) -> None:
        from collections import deque

        self.steps = int(steps)
        self.counts: Any = deque(maxlen=self.steps)

    def fractions(self, counts: Tensor, rows: Tensor) -> Tensor:
        """Push this batch's ``[layers, n_experts]`` top-K counts over ``rows`` tokens; the window's fractions."""
        self.counts.append((counts.detach(), rows.detach()))
        return torch.stack([c for c, _ in self.counts]).sum(0) / torch.stack([r for _, r in self.counts]).sum()


def aux_loss(router_logits: Sequence[Tensor] | None, spec: RoutingSpec, attention_mask: Tensor,
             window: BalanceWindow | None = None) -> Tensor:
    """Switch-style load balancing, per MoE layer then averaged (transformers' implementation, padding masked).

    transformers pools all layers into one balance term, which lets one layer collapse while others
    compensate; balancing each layer is what "no layer collapses" needs. Minimum K (uniform routing).
    With a ``window`` of more than one step, the load fractions are the window's (see :class:`BalanceWindow`).
    """
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    if not router_logits or len(router_logits) != spec.n_layers:
        raise SpecPrefetchError(f"expected router logits of {spec.n_layers} MoE layers from the forward, got "
                                f"{0 if not router_logits else len(router_logits)}")
    if window is None or window.steps <= 1:
        per_layer = [load_balancing_loss_func((lg,), spec.n_experts, spec.top_k, attention_mask)
                     for lg in router_logits]
        return torch.stack(per_layer).mean()
    mask = attention_mask.reshape(-1).float()
    probs, counts = [], []
    for lg in router_logits:
        p = F.softmax(lg.float(), dim=-1)
        top = torch.topk(p, spec.top_k, dim=-1).indices
        counts.append(torch.zeros(spec.n_experts).scatter_add_(0, top.reshape(-1),
                                                                mask.repeat_interleave(spec.top_k)))
        probs.append((p * mask.unsqueeze(-1)).sum(0) / mask.sum())
    f = window.fractions(torch.stack(counts), mask.sum())
    return (spec.n_experts * (f * torch.stack(probs)).sum(-1)).mean()


def unigram_stats(tokenizer: Any, meta: dict[str, Any], train: Sequence[Any], heldout: Sequence[Any],
                  vocab: int) -> dict[str, float]:
    """Unigram entropy of the training targets (nats/token) and the held-out cross entropy of that unigram
    model (add-one smoothed): the loss a model that ignores context would get."""
    image_id = meta["special_token_ids"][meta["image_token"]]

    def counts(samples: Sequence[Any]) -> Tensor:
        c = torch.zeros(vocab, dtype=torch.float64)
        for s in samples:
            seq, _ = stand_in_sequence(tokenizer, meta, s, 1 if getattr(s, "image", None) else 0)
            ids = torch.tensor([t for t in seq[1:] if t != image_id])
            c += torch.bincount(ids, minlength=vocab).double()
        return c

    tr, he = counts(train), counts(heldout)
    p = tr / tr.sum()
    nz = p > 0
    entropy = float(-(p[nz] * p[nz].log()).sum())
    smooth = (tr + 1) / (tr.sum() + vocab)
    xent = float(-(he * smooth.log()).sum() / he.sum())
    return {"unigram_entropy_nats": entropy, "unigram_heldout_xent_nats": xent,
            "n_train_target_tokens": int(tr.sum()), "n_heldout_target_tokens": int(he.sum())}


def _bundle(name: str, mcfg: dict[str, Any], stand_in: StandIn) -> ModelBundle:
    spec = discover_routing(stand_in.model)
    return ModelBundle(name=name, arch=spec.arch, kind="stand_in", model=stand_in.model, tokenizer=stand_in.tokenizer,
                       image_processor=stand_in.image_processor, routing=spec, model_cfg=mcfg, meta=stand_in.meta)


def approx_tokens(sample: Any) -> int:
    """A cheap length estimate (about 4 characters per token, 64 tokens per image) for length grouping."""
    text = len(getattr(sample, "prompt", "")) + len(getattr(sample, "reference", ""))
    return text // 4 + (64 if getattr(sample, "image", None) else 0)


def batch_plan(lengths: Sequence[int], steps: int, batch_size: int, seed: int,
               pool_batches: int = 16) -> list[list[int]]:
    """Sample indices of every step: seeded epoch-wise shuffles, cut into pools of ``pool_batches`` batches,
    each pool sorted by length and split into batches (less padding), the pool's batches in seeded order."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    plan: list[list[int]] = []
    while len(plan) < steps:
        pool: list[int] = []
        while len(pool) < batch_size * pool_batches:
            if not order:
                order = torch.randperm(len(lengths), generator=gen).tolist()
            pool.append(order.pop())
        pool.sort(key=lambda i: (lengths[i], i))
        batches = [pool[j:j + batch_size] for j in range(0, len(pool), batch_size)]
        plan.extend(batches[p] for p in torch.randperm(len(batches), generator=gen).tolist())
    return plan[:steps]


def param_groups(model: nn.Module, spec: RoutingSpec, lr: float, router_lr_mult: float) -> list[dict[str, Any]]:
    """AdamW groups: routers at ``router_lr_mult`` x lr without weight decay (see ROUTER_LR_MULT), the rest
    at lr with weight decay."""
    router_ids = {id(g.weight) for g in spec.gates}
    routers = [p for p in model.parameters() if id(p) in router_ids]
    rest = [p for p in model.parameters() if id(p) not in router_ids]
    return [{"params": rest, "lr": lr, "weight_decay": WEIGHT_DECAY},
            {"params": routers, "lr": lr * router_lr_mult, "weight_decay": 0.0}]


def train_steps(bundle: ModelBundle, samples: Sequence[Any], root: Path, pcfg: dict[str, Any],
                desc: str = "pretrain", router_lr_mult: float | None = None) -> list[dict[str, float]]:
    """Run ``pcfg["steps"]`` optimizer steps over seeded epoch-wise shuffles of ``samples``; the loss curve."""
    model, spec = bundle.model, bundle.routing
    steps, bs, seq_len = int(pcfg["steps"]), int(pcfg["batch_size"]), int(pcfg["seq_len"])
    coef = float(pcfg["aux_loss_coef"])
    router_lr_mult = ROUTER_LR_MULT if router_lr_mult is None else router_lr_mult
    opt = torch.optim.AdamW(param_groups(model, spec, float(pcfg["lr"]), router_lr_mult), betas=ADAMW_BETAS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(int(pcfg["warmup_steps"]), steps))
    plan = batch_plan([approx_tokens(s) for s in samples], steps, bs, int(pcfg["seed"]))
    window = BalanceWindow(int(pcfg.get("balance_window", 1)))
    pad_id = bundle.meta["special_token_ids"]["<|pad|>"]
    curve: list[dict[str, float]] = []
    model.train()
    bar = tqdm(range(steps), desc=desc, disable=None, unit="step")
    log_every = max(1, steps // 20)
    for step in bar:
        batch = [encode_sample(bundle, samples[i], root, seq_len) for i in plan[step]]
        kwargs, masks = collate_encoded(batch, pad_id)
        out = model(**kwargs, output_router_logits=True, use_cache=False)
        lm = lm_loss(out.logits, _target_labels(kwargs, masks))
        aux = aux_loss(out.router_logits, spec, kwargs["attention_mask"], window)
        loss = lm + coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM))
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        loss_v, lm_v, aux_v = float(loss.detach()), float(lm.detach()), float(aux.detach())
        if not math.isfinite(loss_v):
            raise SpecPrefetchError(f"{desc}: loss became {loss_v} at step {step}; lower models.*.pretrain.lr")
        curve.append({"step": step, "loss": loss_v, "lm_loss": lm_v, "aux_loss": aux_v, "lr": lr,
                      "grad_norm": grad_norm})
        bar.set_postfix(lm=f"{lm_v:.3f}", aux=f"{aux_v:.3f}")
        if (step + 1) % log_every == 0 or step + 1 == steps:
            log.info("%s: step %d/%d lm %.3f aux %.3f lr %.2e", desc, step + 1, steps, lm_v, aux_v, lr)
    model.eval()
    return curve


def image_token_embeddings(bundle: ModelBundle, pixel_kwargs: dict[str, Tensor]) -> Tensor:
    """``[n_tokens, D]``: the language-space image embeddings the LM receives (vision tower + projector/merger),
    one row per image token, images in order and each image's tokens in row-major order of its 2x2 merge blocks."""
    model = bundle.model
    if bundle.arch == "qwen3_vl_moe":
        out = model.model.get_image_features(pixel_kwargs["pixel_values"], pixel_kwargs["image_grid_thw"])
        return torch.cat(list(out.pooler_output))
    feats = model.image_features(pixel_kwargs["pixel_values"])
    return feats.reshape(-1, feats.shape[-1])


def pixel_targets(bundle: ModelBundle, pixel_kwargs: dict[str, Tensor]) -> Tensor:
    """``[n_tokens, P]``: each image token's pixels (the processor's normalised values of its 2x2 patch block), in
    :func:`image_token_embeddings`' order. Qwen2-VL's processor already groups a merge block's patches together;
    DeepSeek-VL2's projector unfolds 2x2 patches of a row-major grid, so the pixels are unfolded the same way."""
    pv = pixel_kwargs["pixel_values"]
    merge = int(bundle.meta["image"]["spatial_merge"]) if bundle.arch == "qwen3_vl_moe" else \
        int(bundle.model.projector.downsample)
    if bundle.arch == "qwen3_vl_moe":
        return pv.reshape(pv.shape[0] // (merge * merge), -1).float()
    block = int(bundle.meta["image"]["patch_size"]) * merge
    pad_h, pad_w = (-pv.shape[-2]) % block, (-pv.shape[-1]) % block
    blocks = F.unfold(F.pad(pv.float(), (0, pad_w, 0, pad_h)), kernel_size=block, stride=block)
    return blocks.transpose(1, 2).reshape(-1, blocks.shape[1])


def vision_encoder_params(bundle: ModelBundle) -> list[nn.Parameter]:
    """The vision encoder proper (patch embedding, position embedding, transformer blocks), without the projector
    (DeepSeek-VL2) or the patch mergers (Qwen3-VL) that map it into the language model's space."""
    model = bundle.model
    if bundle.arch == "qwen3_vl_moe":
        return [p for n, p in model.model.visual.named_parameters() if not n.startswith(("merger", "deepstack"))]
    return list(model.vision.parameters())


def vision_params(bundle: ModelBundle) -> list[nn.Parameter]:
    """Vision encoder + projector/mergers: everything between the pixels and the language model's input."""
    model = bundle.model
    return list(model.model.visual.parameters()) if bundle.arch == "qwen3_vl_moe" else \
        [*model.vision.parameters(), *model.projector.parameters()]


def vision_stage(bundle: ModelBundle, samples: Sequence[Any], root: Path, vcfg: dict[str, Any],
                 seed: int) -> list[dict[str, float]]:
    """Stage 0: train the vision encoder + projector alone to reconstruct every image token's pixels from its
    language-space embedding (a linear decoder, discarded afterwards), on the corpus images.

    The real models' image tokens come from a *pretrained* encoder (SigLIP; Qwen3-VL's ViT), whose patch
    embeddings are content-bearing and differ from patch to patch, and their vision-language adaptor is aligned
    before the language model sees it (DeepSeek-VL2 stage 1, LLaVA stage 1). A tower trained from scratch only by the
    LM loss gives the tokens of one image nearly one embedding (router-input cosine 0.96-0.98 here), which the
    routers cannot split and the balance loss then flattens. The reconstruction objective is the scaled-down
    pretraining: each token must carry its own block's content, in its direction (the decoder reads the
    RMS-normalised embedding, as the language model's first RMSNorm does)."""
    from specprefetch.models.loading import load_image

    steps, bs, lr = int(vcfg["steps"]), int(vcfg["batch_size"]), float(vcfg["lr"])
    images = [s for s in samples if getattr(s, "image", None)]
    if not images:
        raise SpecPrefetchError("invalid config key 'models.*.pretrain.vision.steps': the corpus has no images to "
                                "pretrain the vision tower on (set it to 0)")
    gen = torch.Generator().manual_seed(seed)
    params = vision_params(bundle)
    probe = _pixels(bundle, [load_image(images[0], root)])
    with torch.no_grad():
        d = image_token_embeddings(bundle, probe).shape[-1]
    decoder = nn.Linear(d, pixel_targets(bundle, probe).shape[-1])
    opt = torch.optim.AdamW([{"params": params, "weight_decay": WEIGHT_DECAY},
                             {"params": decoder.parameters(), "weight_decay": 0.0}], lr=lr, betas=ADAMW_BETAS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(max(1, steps // 20), steps))
    cache: dict[int, Any] = {}
    curve: list[dict[str, float]] = []
    bundle.model.train()
    order: list[int] = []
    for step in tqdm(range(steps), desc="vision stage", disable=None, unit="step"):
        idx = []
        while len(idx) < min(bs, len(images)):
            if not order:
                order = torch.randperm(len(images), generator=gen).tolist()
            idx.append(order.pop())
        pil = []
        for i in idx:
            if i not in cache:
                cache[i] = load_image(images[i], root)
            pil.append(cache[i])
        px = _pixels(bundle, pil)
        loss = F.mse_loss(decoder(_rms_normed(image_token_embeddings(bundle, px).float())), pixel_targets(bundle, px))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*params, *decoder.parameters()], CLIP_NORM)
        opt.step()
        sched.step()
        loss_v = float(loss.detach())
        if not math.isfinite(loss_v):
            raise SpecPrefetchError(f"vision stage: loss became {loss_v} at step {step}; lower "
                                    "models.*.pretrain.vision.lr")
        curve.append({"step": step, "recon_loss": loss_v})
    bundle.model.eval()
    log.info("vision stage: %d steps, reconstruction MSE %.3f -> %.3f", steps, curve[0]["recon_loss"],
             curve[-1]["recon_loss"])
    return curve


def _rms_normed(x: Tensor) -> Tensor:
    """``x`` scaled to unit RMS per row: the language model reads its input through an RMSNorm, so only the
    embedding's direction reaches the routers; the content has to be decodable from the direction."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _pixels(bundle: ModelBundle, images: list[Any]) -> dict[str, Tensor]:
    out = bundle.image_processor(images=images, return_tensors="pt")
    px = {"pixel_values": out["pixel_values"]}
    if bundle.arch == "qwen3_vl_moe":
        px["image_grid_thw"] = out["image_grid_thw"]
    return px


@torch.no_grad()
def evaluate_routing(bundle: ModelBundle, samples: Sequence[Any], root: Path, max_length: int) -> dict[str, Any]:
    """Held-out LM loss and routing quality: per-layer token entropy, softmax mass of the executed top-K,
    load histogram, max load share, and FATE recall@K (layer l+1's gate on layer l's router input, top-K,
    vs the executed experts)."""
    model, spec = bundle.model, bundle.routing
    n, k, n_l = spec.n_experts, spec.top_k, spec.n_layers
    load = torch.zeros(n_l, n, dtype=torch.float64)
    entropy = torch.zeros(n_l, dtype=torch.float64)
    topk_mass = torch.zeros(n_l, dtype=torch.float64)
    fate_hits = torch.zeros(max(0, n_l - 1), dtype=torch.float64)
    nll, n_targets, n_tokens = 0.0, 0, 0
    model.eval()
    for s in tqdm(samples, desc="evaluate routing", disable=None, unit="sample"):
        enc = encode_sample(bundle, s, root, max_length)
        with RouterCapture(model, spec) as cap:
            out = model(**enc.kwargs, use_cache=False)
        masks = {"is_image": enc.is_image.unsqueeze(0), "valid": enc.valid.unsqueeze(0)}
        labels = _target_labels(enc.kwargs, masks)
        nll += float(lm_loss(out.logits, labels, reduction="sum"))
        n_targets += int((labels[:, 1:] != -100).sum())
        valid = enc.valid
        xs = cap.inputs()
        executed = [spec.executed_topk(i, x)[valid] for i, x in enumerate(xs)]
        for i, x in enumerate(xs):
            probs = spec.probs(i, spec.logits(i, x)[valid]).double()
            entropy[i] += float(-(probs * probs.clamp_min(1e-30).log()).sum())
            topk_mass[i] += float(probs.gather(1, executed[i]).sum())
            load[i] += torch.bincount(executed[i].reshape(-1), minlength=n).double()
            if i + 1 < n_l:
                cand = spec.topk(i + 1, spec.logits(i + 1, x[valid]))
                fate_hits[i] += float((cand.unsqueeze(-1) == executed[i + 1].unsqueeze(1)).any(-1).sum())
        n_tokens += int(valid.sum())
    if n_tokens == 0:
        raise SpecPrefetchError("held-out evaluation saw no tokens")
    share = load / load.sum(dim=1, keepdim=True)
    load_entropy = -(share * share.clamp_min(1e-30).log()).sum(dim=1)
    layers = [{
        "layer": spec.moe_layers[i], "ordinal": i,
        "token_entropy_nats": float(entropy[i] / n_tokens),
        "topk_mass": float(topk_mass[i] / n_tokens),
        "load_entropy_nats": float(load_entropy[i]),
        "load_histogram": [int(v) for v in load[i].tolist()],
        "max_load_share": float(share[i].max()),
        "min_load_share": float(share[i].min()),
    } for i in range(n_l)]
    fate = (fate_hits / (n_tokens * k)).tolist()
    return {
        "heldout_lm_loss": nll / max(1, n_targets),
        "n_heldout_tokens": n_tokens,
        "uniform_load_share": 1.0 / n,
        "max_entropy_nats": math.log(n),
        "layers": layers,
        "fate_recall_at_k_per_pair": fate,
        "fate_recall_at_k": float(sum(fate) / len(fate)) if fate else float("nan"),
        "chance_recall_at_k": k / n,
    }


def quality_checks(result: dict[str, Any]) -> dict[str, Any]:
    """The stand-in routes meaningfully: LM loss below the unigram baseline, no layer collapsed, FATE far
    above chance. Reported (not enforced: smoke runs train for seconds)."""
    max_share = max(layer["max_load_share"] for layer in result["routing"]["layers"])
    k_over_n = result["routing"]["chance_recall_at_k"]
    return {
        "lm_below_unigram": result["heldout_lm_loss"] < result["unigram"]["unigram_heldout_xent_nats"],
        "max_load_share": max_share,
        "no_collapse": max_share < 0.5,
        "fate_over_chance": result["routing"]["fate_recall_at_k"] / k_over_n,
        "fate_far_above_chance": result["routing"]["fate_recall_at_k"] > 2 * k_over_n,
    }


def pretrain_stand_in(cfg: dict[str, Any], model_name: str, corpus_dir: str | Path, tokenizer_dir: str | Path,
                      out_dir: str | Path) -> dict[str, Any]:
    """Build, train and save the stand-in ``model_name`` into ``out_dir`` (atomically); returns the train log."""
    from specprefetch.data.tokenizer import load_tokenizer

    mcfg = cfg["models"].get(model_name)
    if mcfg is None:
        raise SpecPrefetchError(f"unknown model {model_name!r}; config models: {', '.join(cfg['models'])}")
    if mcfg["source"] != "stand_in" or "pretrain" not in mcfg:
        raise SpecPrefetchError(f"invalid config key 'models.{model_name}.source': pretrain-stand-in needs a "
                                f"stand_in model with a pretrain section, got source {mcfg['source']!r}")
    pcfg = mcfg["pretrain"]
    corpus_dir, tokenizer_dir = Path(corpus_dir), Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise SpecPrefetchError(f"tokenizer not found: {tokenizer_dir} (run train-tokenizer)")
    tokenizer = load_tokenizer(tokenizer_dir, hint="run train-tokenizer")
    special_token_ids(tokenizer, where=str(tokenizer_dir))
    samples = read_corpus(corpus_dir)
    seed = int(pcfg["seed"])
    train_idx, held_idx = split_heldout(len(samples), seed)
    train, heldout = [samples[i] for i in train_idx], [samples[i] for i in held_idx]

    seed_everything(seed)
    stand_in = build_stand_in(cfg, model_name, tokenizer)
    bundle = _bundle(model_name, mcfg, stand_in)
    n_params = sum(p.numel() for p in stand_in.model.parameters())
    log.info("pretraining %s (%s, %.1fM parameters) on %d samples (%d held out): %d steps x %d x %d tokens",
             model_name, bundle.arch, n_params / 1e6, len(train), len(heldout), pcfg["steps"],
             pcfg["batch_size"], pcfg["seq_len"])
    t0 = time.perf_counter()
    vcfg = pcfg.get("vision") or {}
    vision_curve: list[dict[str, float]] = []
    if int(vcfg.get("steps", 0)):
        vision_curve = vision_stage(bundle, train, corpus_dir, vcfg, seed)
        if vcfg.get("freeze_encoder", False):
            for p in vision_encoder_params(bundle):
                p.requires_grad_(False)
    vision_s = time.perf_counter() - t0
    curve = train_steps(bundle, train, corpus_dir, pcfg, desc=f"pretrain {model_name}")
    train_s = time.perf_counter() - t0
    routing = evaluate_routing(bundle, heldout, corpus_dir, int(pcfg["seq_len"]))
    uni = unigram_stats(tokenizer, stand_in.meta, train, heldout, len(tokenizer))
    result: dict[str, Any] = {
        "format": LOG_FORMAT, "model": model_name, "arch": bundle.arch, "n_parameters": n_params,
        "n_train_samples": len(train), "n_heldout_samples": len(heldout),
        "heldout_ids": [str(getattr(s, "id", "")) for s in heldout],
        "train_wall_s": round(train_s, 2), "vision_wall_s": round(vision_s, 2), "vision_curve": vision_curve,
        "eval_wall_s": round(time.perf_counter() - t0 - train_s, 2),
        "loss_curve": curve, "final_train_lm_loss": curve[-1]["lm_loss"],
        "heldout_lm_loss": routing.pop("heldout_lm_loss"), "unigram": uni, "routing": routing,
        "routing_spec": bundle.routing.describe(),
    }
    result["quality"] = quality_checks(result)
    result["provenance"] = provenance(
        {"model": mcfg, "image": cfg["image"]}, seed=seed,
        corpus_samples_sha256=sha256_file(corpus_dir / "samples.jsonl"),
        tokenizer_sha256=sha256_file(tokenizer_dir / "tokenizer.json"),
        deterministic=torch.are_deterministic_algorithms_enabled(), torch_threads=torch.get_num_threads(),
    )
    stand_in.meta["train"] = {"steps": int(pcfg["steps"]), "seed": seed, "heldout_lm_loss": result["heldout_lm_loss"]}
    with atomic_path(out_dir, is_dir=True) as tmp:
        save_stand_in(stand_in, tmp)  # records the sha256 of every weight file in specprefetch_model.json
        write_json_atomic(tmp / TRAIN_LOG, result)
    q = result["quality"]
    log.info("%s: %.0f s; held-out LM loss %.3f vs unigram %.3f; max load share %.3f; FATE recall@K %.3f "
             "(chance %.3f)", model_name, train_s, result["heldout_lm_loss"], uni["unigram_heldout_xent_nats"],
             q["max_load_share"], routing["fate_recall_at_k"], routing["chance_recall_at_k"])
    return result


def param_digest(model: nn.Module) -> str:
    """sha256 over every parameter's bytes in name order: equal digests mean identical weights."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
