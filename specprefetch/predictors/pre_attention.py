"""Same-layer pre-attention expert prediction (beyond the paper; after arXiv 2511.10676).

Layer ``t``'s experts are predicted from layer ``t``'s own pre-attention input: the output of its pre-attention norm
(``input_layernorm``), what its attention reads, stored in traces extracted with ``traces.pre_attention: true``
(batch key ``pre``). The prediction is two linear maps, ẑ^t = B^t A^t x̃^t with A^t r×D and B^t n×r (the paper
cited uses "2 linear functions"; here they are SpecPrefetch's low-rank form, so at one rank the two methods have the
same parameters and differ only in their input and objective). The window is shorter: the prefetch is issued before
layer ``t``'s attention and overlaps only that attention (and the router), not a whole layer.

The protocol is Tables 1-2's: pair ``l`` predicts layer ``l+1`` (the first MoE layer is not a target, as for every
other method), so recall is comparable at the same budgets.

Objective (ours; the cited paper calls its loss "ranking-aware" without a form we can check here): the paper's KL to
the native router distribution plus ``rank_loss_weight`` times a pairwise logistic ranking loss (RankNet) that puts
every executed expert above every other one: mean over tokens and over pairs (i in T^t, j not in T^t) of
softplus(ẑ_j − ẑ_i).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specprefetch.predictors.base import Batch, PredictorDims, PredictorError, multi_hot, next_layer_kl, register
from specprefetch.predictors.specprefetch import SpecPrefetchAdapter

DEFAULT_RANK_LOSS_WEIGHT = 1.0


def pairwise_ranking_loss(preds: Sequence[Tensor], topk: Sequence[Tensor], lookahead: int = 1) -> Tensor:
    """Mean over pairs ``l`` of the token-mean pairwise logistic loss: softplus(ẑ_j − ẑ_i) averaged over the
    executed experts ``i`` of layer ``l + lookahead`` and the other experts ``j`` (float32)."""
    terms = []
    for l, z in enumerate(preds):
        z = z.float()
        idx = topk[l + lookahead].long()
        n, k = z.shape[-1], idx.shape[-1]
        if k >= n:  # every expert executes: nothing to rank
            terms.append(z.sum() * 0.0)
            continue
        neg = 1.0 - multi_hot(idx, n)                              # [T, n]: j not executed
        margin = z.unsqueeze(1) - z.gather(1, idx).unsqueeze(2)    # [T, K, n]: ẑ_j − ẑ_i
        per_token = (F.softplus(margin) * neg.unsqueeze(1)).sum(dim=(1, 2)) / (k * (n - k))
        terms.append(per_token.mean())
    return torch.stack(terms).mean()


@register("pre_attention")
class PreAttentionRouter(SpecPrefetchAdapter):
    """Per target layer, a low-rank linear router on the layer's own pre-attention input (see the module)."""

    stage = "pre_attention"

    def __init__(self, dims: PredictorDims, method_cfg: Mapping[str, Any] | None = None) -> None:
        if dims.lookahead != 1:
            raise PredictorError(f"pre_attention predicts a layer from its own pre-attention input: it has no "
                                 f"look-ahead distance (got lookahead={dims.lookahead})")
        super().__init__(dims, method_cfg)
        weight = float(self.method_cfg.setdefault("rank_loss_weight", DEFAULT_RANK_LOSS_WEIGHT))
        if not weight >= 0.0:
            raise PredictorError(f"invalid predictors.pre_attention.rank_loss_weight {weight!r}: must be >= 0")
        self.rank_loss_weight = weight

    def _x(self, batch: Batch, layer: int) -> Tensor:
        """Pair ``layer``'s input: the pre-attention input of its target layer ``layer + 1``."""
        pre = batch.get("pre")
        if pre is None:
            raise PredictorError("pre_attention needs each layer's pre-attention input (batch key 'pre'): extract "
                                 "the traces with traces.pre_attention: true")
        if len(pre) != self.dims.n_layers:
            raise PredictorError(f"pre_attention: batch['pre'] has {len(pre)} layers, predictor built for "
                                 f"L={self.dims.n_layers}")
        x = pre[layer + 1]
        if x.shape[-1] != self.dims.hidden_size:
            raise PredictorError(f"pre_attention: pre.{layer + 1} has hidden size {x.shape[-1]}, predictor built "
                                 f"for D={self.dims.hidden_size}")
        return x.to(self._param_dtype())

    def loss(self, preds: Sequence[Tensor], batch: Batch) -> Tensor:
        """The KL of every method plus the weighted pairwise ranking loss (see the module docstring)."""
        kl = next_layer_kl(preds, batch["logits"], 1)
        if self.rank_loss_weight == 0.0:
            return kl
        return kl + self.rank_loss_weight * pairwise_ranking_loss(preds, batch["topk"], 1)
