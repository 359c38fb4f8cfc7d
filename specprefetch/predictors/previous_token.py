"""Naive Prefetch (paper §4.4, Table 5): prefetch for layer l+1 the experts that the previous token of
the same sample executed at layer l+1.

The first token of a sample has no previous token: it gets NO candidates (recall 0 for that token),
which is what a runtime that only replays the last step can offer; a frequency fallback would mix in
another method. For M > K the candidate set stays at the previous token's K experts (it has nothing
else to rank), so its recall saturates at M = K.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specprefetch.predictors.base import Batch, Predictor, check_sample_contiguous, multi_hot, register


@register("previous_token")
class PreviousTokenPredictor(Predictor):
    """Indicator of the previous token's executed experts at the target layer."""

    learned = False
    empty_when_zero = True

    def forward(self, batch: Batch) -> list[Tensor]:
        self.check_batch(batch)
        check_sample_contiguous(batch, "previous_token")
        sidx = batch["sample_index"]
        has_prev = torch.zeros_like(sidx, dtype=torch.bool)
        has_prev[1:] = sidx[1:] == sidx[:-1]
        n = self.dims.n_experts
        out = []
        for l in range(self.dims.n_pairs):
            hot = multi_hot(batch["topk"][self.dims.target(l)], n)
            prev = torch.zeros_like(hot)
            prev[1:] = hot[:-1]
            out.append(prev * has_prev[:, None].to(prev.dtype))
        return out

    def token_scores(self, batch: Batch) -> list[Tensor]:
        return self.forward(batch)
