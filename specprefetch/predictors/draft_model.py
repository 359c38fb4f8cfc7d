"""Draft Model baseline: a small causal transformer over the token ids that predicts, for every token,
the routing of every MoE layer 1..L-1 ahead of the main model (it never sees the main model's hidden
states, only the tokens so far, so it can run a full layer — or a full step — ahead).

Architecture: token embedding (+ fixed sinusoidal position encoding) -> ``num_layers`` pre-norm causal
transformer layers (``d_model``, ``num_heads``, FFN 4·d_model, no dropout) -> LayerNorm -> one linear head
producing (L−1)·n logits, split per target layer. The embedding is initialised from the frozen model's
input embeddings when a model directory is given (PCA to ``d_model`` when D > d_model, an orthonormal
lift otherwise) and trained with the rest; without one it is learned from scratch. With
``freeze_embedding: true`` the embedding is not trained (``requires_grad`` off, so it is neither optimised nor
counted as trainable): the draft model then reads a fixed projection of the frozen model's own embedding, and its
trainable parameters are the transformer and the head only — the paper profile's setting (Table 3's 19–26M cannot
include a ~150k-row vocabulary embedding). Token ids outside the vocabulary map to one extra "unknown" row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from specprefetch.contracts import member, read_doc, require, reraise_as
from specprefetch.predictors.base import (
    Batch,
    Predictor,
    PredictorDims,
    PredictorError,
    check_sample_contiguous,
    register,
    sample_runs,
)

log = logging.getLogger(__name__)
DEFAULTS = {"num_layers": 2, "d_model": 128, "num_heads": 4}


def sinusoidal(positions: Tensor, dim: int) -> Tensor:
    """Transformer sinusoidal encoding of integer positions [...] -> [..., dim] (no parameters, no length cap)."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    ang = positions.float().unsqueeze(-1) * freq
    enc = torch.cat([ang.sin(), ang.cos()], dim=-1)
    if dim % 2:
        enc = torch.nn.functional.pad(enc, (0, 1))
    return enc


@register("draft_model")
class DraftModelPredictor(Predictor):
    """Causal token-level transformer predicting all layers' routing."""

    def __init__(self, dims: PredictorDims, method_cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(dims, method_cfg)
        for k, v in DEFAULTS.items():
            self.method_cfg.setdefault(k, v)
        d_model = int(self.method_cfg["d_model"])
        heads = int(self.method_cfg["num_heads"])
        layers = int(self.method_cfg["num_layers"])
        if d_model % heads:
            raise PredictorError(f"invalid predictors.draft_model: num_heads={heads} must divide d_model={d_model}")
        if not dims.vocab_size or dims.vocab_size < 1:
            raise PredictorError("draft_model needs dims.vocab_size (from the model dir, the tokenizer config "
                                 "or the training trace's token ids)")
        self.d_model = d_model
        self.embed = nn.Embedding(dims.vocab_size + 1, d_model)  # last row: unknown ids
        nn.init.normal_(self.embed.weight, std=1.0)  # the scale of the position encoding
        # read, not setdefault: a config without the key keeps its method_cfg (and meta.json) as before
        self.freeze_embedding = bool(self.method_cfg.get("freeze_embedding", False))
        self.embed.weight.requires_grad_(not self.freeze_embedding)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, dims.n_pairs * dims.n_experts)

    # -- initialisation from the frozen model
    def init_embeddings(self, table: Tensor) -> None:
        """Initialise the token embedding from the frozen model's input embeddings [V, H]."""
        table = table.detach().float()
        v = min(table.shape[0], self.dims.vocab_size or 0)
        proj = project_embeddings(table[:v], self.d_model)
        with torch.no_grad():
            self.embed.weight[:v].copy_(proj)
        log.info("draft_model: embedding initialised from the model's input embeddings (%d x %d -> %d, %s)",
                 table.shape[0], table.shape[1], self.d_model, "frozen" if self.freeze_embedding else "trained")

    # -- prediction
    def forward(self, batch: Batch) -> list[Tensor]:
        check_sample_contiguous(batch, "draft_model")
        ids = batch["token_ids"].long()
        vocab = int(self.dims.vocab_size or 0)
        ids = torch.where((ids >= 0) & (ids < vocab), ids, torch.full_like(ids, vocab))
        starts, lengths = sample_runs(batch["sample_index"])
        n_runs, s_max = int(lengths.numel()), int(lengths.max())
        run = torch.repeat_interleave(torch.arange(n_runs, device=ids.device), lengths)
        col = torch.arange(ids.numel(), device=ids.device) - starts[run]
        tokens = torch.full((n_runs, s_max), vocab, dtype=torch.long, device=ids.device)
        tokens[run, col] = ids
        pos = torch.zeros((n_runs, s_max), dtype=torch.long, device=ids.device)
        pos[run, col] = batch["position"].long()
        h = self.embed(tokens)
        h = h + sinusoidal(pos, self.d_model).to(h.dtype)
        causal = torch.triu(torch.ones(s_max, s_max, dtype=torch.bool, device=ids.device), diagonal=1)
        pad = torch.arange(s_max, device=ids.device)[None, :] >= lengths[:, None]
        h = self.encoder(h, mask=causal, src_key_padding_mask=pad)
        out = self.head(self.norm(h))[run, col]  # [T, (L-1) n]
        return list(out.view(ids.numel(), self.dims.n_pairs, self.dims.n_experts).unbind(dim=1))


def project_embeddings(table: Tensor, d_model: int) -> Tensor:
    """Map [V, H] embeddings to [V, d_model] keeping their geometry: top principal directions when
    H >= d_model (deterministic SVD), an orthonormal lift otherwise; rescaled to unit std like a fresh init."""
    v, h = table.shape
    centered = table - table.mean(dim=0, keepdim=True)
    if h >= d_model:
        _, _, vh = torch.linalg.svd(centered, full_matrices=False)
        out = centered @ vh[:d_model].T
    else:
        gen = torch.Generator().manual_seed(0)
        q, _ = torch.linalg.qr(torch.randn(d_model, h, generator=gen))
        out = centered @ q.T
    std = out.std().clamp_min(1e-12)
    return out / std


def find_input_embeddings(model_dir: str | Path) -> Tensor | None:
    """The frozen model's (language model) input embedding table from its safetensors files, or None.

    Reads only that tensor (no model construction), so it also works for checkpoints too large to load.
    Looks at the directory's safetensors (via ``model.safetensors.index.json`` when sharded), then one
    level down (the DeepSeek-VL2 stand-in keeps its language model under ``language/``).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return None
    for folder in [model_dir, *sorted(p for p in model_dir.iterdir() if p.is_dir())]:
        candidates = _embedding_keys(folder)
        if candidates:
            candidates.sort(key=lambda kv: (("language" not in kv[0]) and ("model.embed_tokens" not in kv[0]),
                                            kv[0]))
            key, f = candidates[0]
            with safe_open(str(f), framework="pt") as st:
                return st.get_tensor(key)
    return None


def _embedding_keys(folder: Path) -> list[tuple[str, Path]]:
    """(key, file) of every ``*embed_tokens.weight`` tensor in ``folder``'s safetensors files."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with reraise_as(PredictorError):
            weight_map = require(read_doc(index, None, "safetensors index"), "weight_map", dict, str(index))
            return [(k, member(folder, f, "safetensors index")) for k, f in weight_map.items()
                    if k.endswith("embed_tokens.weight")]
    out: list[tuple[str, Path]] = []
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                out += [(k, f) for k in st.keys() if k.endswith("embed_tokens.weight")]
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types
            raise PredictorError(f"{f}: unreadable safetensors file ({exc})") from None
    return out
