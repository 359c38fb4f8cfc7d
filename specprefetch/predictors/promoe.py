"""ProMoE-style predictor (Song et al.): a separate two-layer MLP per MoE layer pair, hidden width D.

Per pair l: ẑ^{l+1} = W2^l GELU(W1^l x^l + b1^l) + b2^l with W1^l: h×D, W2^l: n×h and h = D by default
(``predictors.promoe.hidden: null``), which is what makes it the largest learned baseline (Table 3).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from specprefetch.predictors.base import Batch, Predictor, PredictorDims, PredictorError, register


@register("promoe")
class ProMoEPredictor(Predictor):
    """Layer-specific two-layer MLPs."""

    def __init__(self, dims: PredictorDims, method_cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(dims, method_cfg)
        hidden = self.method_cfg.get("hidden")
        hidden = dims.hidden_size if hidden is None else int(hidden)
        if hidden < 1:
            raise PredictorError(f"invalid predictors.promoe.hidden {hidden}: must be >= 1 or null")
        self.method_cfg["hidden"] = self.method_cfg.get("hidden")
        self.hidden = hidden
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(dims.hidden_size, hidden), nn.GELU(), nn.Linear(hidden, dims.n_experts))
            for _ in range(dims.n_pairs)
        )

    def forward(self, batch: Batch) -> list[Tensor]:
        self.check_batch(batch)
        return [mlp(self._x(batch, l)) for l, mlp in enumerate(self.mlps)]

    def layer_token_scores(self, layer: int, x: Tensor) -> Tensor:
        """Run-time API (``runtime.core.priority``): π̂^{layer+1} [T, n] from router input x^layer [T, D]."""
        mlp = self.mlps[layer]
        return F.softmax(mlp(x.to(mlp[0].weight.dtype)).float(), dim=-1)
