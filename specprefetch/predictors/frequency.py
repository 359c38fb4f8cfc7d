"""Frequency reference: rank the experts of each layer by how often the frozen router executed them on
the training corpus (a static, input-independent prefetch list; the floor a learned predictor must beat)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from specprefetch.predictors.base import Batch, Predictor, PredictorDims, PredictorError, register

log = logging.getLogger(__name__)


@register("frequency")
class FrequencyPredictor(Predictor):
    """Per-layer expert popularity counted on the corpus traces (layers 1..L-1)."""

    learned = False

    def __init__(self, dims: PredictorDims, method_cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(dims, method_cfg)
        self.register_buffer("counts", torch.zeros(dims.n_pairs, dims.n_experts, dtype=torch.float64))

    def fit_statistics(self, reader: Any) -> None:
        """Count executed experts of MoE layers 1..L-1 over every token of the trace."""
        from specprefetch.predictors.data import shard_to_batch

        shards = (shard_to_batch(s, reader.n_layers) for s in reader.iter_shards())
        self.count_batches(tqdm(shards, total=len(reader.manifest["shards"]), desc="frequency", disable=None),
                           where=f"trace {getattr(reader, 'dir', '?')}")

    def count_batches(self, batches: Iterable[Batch], where: str = "the corpus") -> None:
        """Set the counts from batches in the trace layout (traces, or the live model online)."""
        counts = torch.zeros_like(self.counts)
        for b in batches:
            for l in range(self.dims.n_pairs):
                idx = b["topk"][self.dims.target(l)].long().flatten().cpu()
                counts[l] += torch.bincount(idx, minlength=self.dims.n_experts).to(counts)
        if float(counts.sum()) == 0:
            raise PredictorError(f"frequency: {where} has no tokens to count")
        self.counts.copy_(counts)
        log.info("frequency: counted %d expert activations", int(counts.sum()))

    def probabilities(self) -> Tensor:
        """[L-1, n] popularity distribution per target layer."""
        c = self.counts.float()
        return c / c.sum(dim=-1, keepdim=True).clamp_min(1.0)

    def forward(self, batch: Batch) -> list[Tensor]:
        self.check_batch(batch)
        t = batch["token_ids"].shape[0]
        logp = self.probabilities().clamp_min(1e-12).log()
        return [logp[l].expand(t, -1) for l in range(self.dims.n_pairs)]

    def token_scores(self, batch: Batch) -> list[Tensor]:
        t = batch["token_ids"].shape[0]
        p = self.probabilities()
        return [p[l].expand(t, -1) for l in range(self.dims.n_pairs)]
