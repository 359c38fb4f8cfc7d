"""Single MLP (Table 2 ablation): ONE two-layer MLP shared by every MoE layer pair.

It sees x^l plus a learned embedding of the pair index l (equivalent to concatenating a one-hot of l
to the input), so a single set of weights has to model every cross-layer routing transition — the
design SpecPrefetch's layer-specific adapters are compared against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from specprefetch.predictors.base import Batch, Predictor, PredictorDims, PredictorError, register

DEFAULT_HIDDEN = 256


@register("single_mlp")
class SingleMLPPredictor(Predictor):
    """h = GELU(W1 x^l + e_l + b1);  ẑ^{l+1} = W2 h + b2, shared over l."""

    def __init__(self, dims: PredictorDims, method_cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(dims, method_cfg)
        hidden = int(self.method_cfg.setdefault("hidden", DEFAULT_HIDDEN))
        if hidden < 1:
            raise PredictorError(f"invalid predictors.single_mlp.hidden {hidden}: must be >= 1")
        self.fc1 = nn.Linear(dims.hidden_size, hidden)
        self.layer_embedding = nn.Embedding(dims.n_pairs, hidden)
        nn.init.normal_(self.layer_embedding.weight, std=0.02)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dims.n_experts)

    def forward(self, batch: Batch) -> list[Tensor]:
        self.check_batch(batch)
        out = []
        for l in range(self.dims.n_pairs):
            x = self._x(batch, l)
            e = self.layer_embedding.weight[l]
            out.append(self.fc2(self.act(self.fc1(x) + e)))
        return out

    def forward_pair(self, x: Tensor, pair: int) -> Tensor:
        """Logits for one pair only (what a runtime calls at layer ``pair``)."""
        return self.fc2(self.act(self.fc1(x.to(self.fc1.weight.dtype)) + self.layer_embedding.weight[pair]))

    def layer_token_scores(self, layer: int, x: Tensor) -> Tensor:
        """Run-time API (``runtime.core.priority``): π̂^{layer+1} [T, n] from router input x^layer [T, D]."""
        return F.softmax(self.forward_pair(x, layer).float(), dim=-1)

