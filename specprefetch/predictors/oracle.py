"""Oracle reference (upper bound): the native router's own top-K at layer l+1.

Priorities are the indicator of the executed experts plus a tie-break by the true routing probability
(1 + 1e-6·π_e on executed experts, 0 elsewhere, in float64), so ExpertRecall@M is min(M, K)/K per token at
token level, and at batch level experts are ranked by how many of the batch's tokens execute them (the
probability term is too small to reorder different counts).
It reads layer l+1 itself, so it is not a predictor; it bounds what any predictor can reach.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specprefetch.predictors.base import Batch, Predictor, multi_hot, register

TIE_BREAK = 1e-6


@register("oracle")
class OraclePredictor(Predictor):
    """The executed top-K of the target layer."""

    learned = False

    def forward(self, batch: Batch) -> list[Tensor]:
        """The target layer's true router logits (the KL of the oracle is 0)."""
        self.check_batch(batch)
        return [batch["logits"][self.dims.target(l)].float() for l in range(self.dims.n_pairs)]

    def token_scores(self, batch: Batch) -> list[Tensor]:
        out = []
        for l in range(self.dims.n_pairs):
            probs = F.softmax(batch["logits"][self.dims.target(l)].double(), dim=-1)
            hot = multi_hot(batch["topk"][self.dims.target(l)], self.dims.n_experts, dtype=torch.float64)
            out.append(hot * (1.0 + TIE_BREAK * probs))
        return out
