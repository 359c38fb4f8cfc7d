"""SpecPrefetch (paper §3.2): one low-rank adapter per adjacent MoE pair, ẑ^{l+1} = B^l A^l x^l.

A^l is r×D and B^l is n×r, with no bias, so the adapters hold exactly (L−1)·r·(D+n) parameters.
B starts at zero (LoRA-style) so the first prediction is uniform and training starts from a
well-defined point; A gets a Kaiming-uniform start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from specprefetch.predictors.base import Batch, Predictor, PredictorDims, PredictorError, register

DEFAULT_RANK = 16


@register("specprefetch")
class SpecPrefetchAdapter(Predictor):
    """Layer-specific low-rank next-layer router predictors."""

    def __init__(self, dims: PredictorDims, method_cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(dims, method_cfg)
        rank = int(self.method_cfg.setdefault("rank", DEFAULT_RANK))
        if rank < 1:
            raise PredictorError(f"invalid predictors.specprefetch.rank {rank}: must be >= 1")
        self.rank = rank
        n_pairs, d, n = dims.n_pairs, dims.hidden_size, dims.n_experts
        self.A = nn.Parameter(torch.empty(n_pairs, rank, d))
        self.B = nn.Parameter(torch.zeros(n_pairs, n, rank))
        for i in range(n_pairs):
            nn.init.kaiming_uniform_(self.A.data[i], a=math.sqrt(5))

    def forward(self, batch: Batch) -> list[Tensor]:
        self.check_batch(batch)
        out = []
        for l in range(self.dims.n_pairs):
            x = self._x(batch, l)
            out.append((x @ self.A[l].T) @ self.B[l].T)
        return out
