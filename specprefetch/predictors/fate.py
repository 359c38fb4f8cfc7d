"""FATE (Fang et al. 2025b), training-free: apply layer l+1's native gate to layer l's router input (at look-ahead
d, layer l+d's gate: ``dims.lookahead``).

Adjacent router inputs are close (residual stream), so ``W^{l+1} x^l`` approximates the next layer's
router logits before ``x^{l+1}`` exists. The gates come from the trace's ``routers.safetensors`` and
are stored in the predictor as buffers (zero trainable parameters), so a saved FATE predictor is
self-contained. Priorities use the architecture's scoring: softmax of the logits, or for sigmoid
routers (DeepSeek-V3 style) sigmoid plus the ``e_score_correction_bias`` the model selects with
(group-limited top-k is not applied: candidates are a ranking, not an execution).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specprefetch.predictors.base import Batch, Predictor, PredictorDims, PredictorError, register


@register("fate")
class FatePredictor(Predictor):
    """Next layer's gate on the current layer's router input."""

    learned = False

    def __init__(self, dims: PredictorDims, method_cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(dims, method_cfg)
        p, n, d = dims.n_pairs, dims.n_experts, dims.hidden_size
        self.register_buffer("weight", torch.zeros(p, n, d))
        self.register_buffer("bias", torch.zeros(p, n))
        self.register_buffer("correction_bias", torch.zeros(p, n))

    def set_gates(self, routers: Mapping[str, Tensor]) -> None:
        """Load gates d..L-1 from ``gate.{i}.weight`` (+ ``.bias`` / ``.e_score_correction_bias``)."""
        for l in range(self.dims.n_pairs):
            i = self.dims.target(l)
            key = f"gate.{i}.weight"
            w = routers.get(key)
            if w is None or tuple(w.shape) != tuple(self.weight.shape[1:]):
                got = None if w is None else tuple(w.shape)
                raise PredictorError(f"fate: router {key} has shape {got}, expected {tuple(self.weight.shape[1:])}")
            self.weight[l].copy_(w.float())
            if f"gate.{i}.bias" in routers:
                self.bias[l].copy_(routers[f"gate.{i}.bias"].float())
            if f"gate.{i}.e_score_correction_bias" in routers:
                self.correction_bias[l].copy_(routers[f"gate.{i}.e_score_correction_bias"].float())

    def fit_statistics(self, reader: Any) -> None:
        self.set_gates(reader.routers())

    def forward(self, batch: Batch) -> list[Tensor]:
        """Router logits W^{l+d} x^l (+ b^{l+d}) in float32, like the native router computes them."""
        self.check_batch(batch)
        return [F.linear(batch["x"][l].float(), self.weight[l], self.bias[l]) for l in range(self.dims.n_pairs)]

    def token_scores(self, batch: Batch) -> list[Tensor]:
        logits = self.forward(batch)
        if self.dims.scoring == "sigmoid":
            return [torch.sigmoid(z) + self.correction_bias[l] for l, z in enumerate(logits)]
        return [F.softmax(z, dim=-1) for z in logits]
