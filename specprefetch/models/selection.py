"""How a router turns logits into experts: softmax/sigmoid scores, greedy / group-limited / ``noaux_tc`` top-k.

One implementation for every consumer: :mod:`specprefetch.models.routing` replays with it what a model executed,
and our DeepSeek-VL2 :class:`~specprefetch.models.deepseek_vl2.Router` routes with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specprefetch.io import SpecPrefetchError

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class RoutingError(SpecPrefetchError):
    """The model's routing cannot be discovered or does not look like its arch says."""


# ------------------------------------------------------------------------------------------ selection
def select_experts(
    logits: Tensor,
    top_k: int,
    scoring: str = "softmax",
    topk_method: str = "greedy",
    n_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: Tensor | None = None,
    group_fill: float = float("-inf"),
) -> Tensor:
    """The experts a router selects from its logits ``[T, n]``: LongTensor ``[T, top_k]``, best first.

    ``greedy``: top-k of the scores (softmax/sigmoid of the logits; same order as the logits for softmax).
    ``group_limited_greedy`` (DeepSeek-V2): keep the ``topk_group`` groups with the largest max score,
    zero the others, top-k. ``noaux_tc`` (DeepSeek-V3): scores + ``correction_bias`` choose; groups ranked by
    the sum of their 2 best choice scores; masked experts filled with ``group_fill`` (transformers uses -inf,
    DeepSeek-VL2's repository code 0.0).
    """
    if logits.dim() != 2:
        raise RoutingError(f"router logits must be [tokens, n_experts], got shape {tuple(logits.shape)}")
    scores = router_scores(logits, scoring)
    n = scores.shape[-1]
    if topk_method == "greedy":
        choice = scores
    elif topk_method in ("group_limited_greedy", "noaux_tc"):
        if not n_group or not topk_group or n % n_group:
            raise RoutingError(
                f"topk_method {topk_method!r} needs n_group dividing n_experts={n} and topk_group "
                f"(got n_group={n_group}, topk_group={topk_group})"
            )
        if topk_method == "group_limited_greedy":
            choice = scores
            group_scores = choice.view(-1, n_group, n // n_group).max(dim=-1).values
            fill = 0.0
        else:
            bias = torch.zeros(n) if correction_bias is None else correction_bias
            choice = scores + bias.to(scores.device, scores.dtype).unsqueeze(0)
            group_scores = choice.view(-1, n_group, n // n_group).topk(2, dim=-1)[0].sum(dim=-1)
            fill = group_fill
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, n // n_group).reshape(-1, n).bool()
        choice = choice.masked_fill(~score_mask, fill)
    else:
        raise RoutingError(f"unknown topk_method {topk_method!r}; supported: {', '.join(TOPK_METHODS)}")
    return torch.topk(choice, k=top_k, dim=-1, sorted=True)[1]


def router_scores(logits: Tensor, scoring: str) -> Tensor:
    """The router's gating scores in float32: softmax or sigmoid of the logits."""
    if scoring == "softmax":
        return logits.float().softmax(dim=-1)
    if scoring == "sigmoid":
        return logits.float().sigmoid()
    raise RoutingError(f"unknown scoring function {scoring!r}; supported: softmax, sigmoid")
