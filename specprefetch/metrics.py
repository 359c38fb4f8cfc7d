"""ExpertRecall (paper §4.1, Tables 1–3): how much of the native next-layer demand the candidates cover.

ExpertRecall@M = 1/|Ω| Σ_t |T_t^{l+1} ∩ C_M^{l+1}| / K, averaged over the target layers l+1 = 1..L−1.
Candidate sets are

- token-level (default; the decoding setting, one token per step): C_M = TopM(π̂_t) per token, so
  R@K/2 ≤ 50%;
- batch-level (§3.2): C_M = TopM(s) with s_e = Σ_{t∈batch} π̂_{t,e}, the batch being one sample's tokens.

Top-M uses a stable descending sort (ties go to the lower expert id) so results are deterministic and
C_M is a prefix of C_{M'} for M < M'. Candidate slots a method cannot fill are -1 and never match.

Pure set metrics on tensors of expert ids; the evaluation of saved predictors on traces, and the gathering of the
per-shard CSVs, is :mod:`specprefetch.predictors.evaluate`. Below them, the percentile-bootstrap confidence
interval every device number carries (:func:`bootstrap_ci`: the tables' and the benchmarks' adaptive repeats').
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specprefetch.io import SpecPrefetchError

# --------------------------------------------------------------------------------------------- the metric


def recall_per_token(topk: Tensor, candidates: Tensor) -> Tensor:
    """[T] fraction |T_t ∩ C_t| / K; ``candidates`` is [T, M] (per token) or [M] (one set for all tokens)."""
    if topk.dim() != 2:
        raise SpecPrefetchError(f"expert_recall: topk must be [T, K], got shape {tuple(topk.shape)}")
    topk = topk.long()
    cand = candidates.long().to(topk.device)
    if cand.dim() == 1:
        cand = cand.unsqueeze(0).expand(topk.shape[0], -1)
    if cand.dim() != 2 or cand.shape[0] != topk.shape[0]:
        raise SpecPrefetchError(f"expert_recall: candidates shape {tuple(candidates.shape)} does not match "
                                f"topk {tuple(topk.shape)} (need [T, M] or [M])")
    k = topk.shape[1]
    if k == 0:
        raise SpecPrefetchError("expert_recall: K = 0")
    hit = (topk.unsqueeze(-1) == cand.unsqueeze(1)) & (cand.unsqueeze(1) >= 0)
    return hit.any(dim=-1).sum(dim=-1).double() / k


def expert_recall(topk: Tensor, candidates: Tensor) -> float:
    """Mean over tokens of |T ∩ C_M| / K (a value in [0, 1])."""
    if topk.shape[0] == 0:
        raise SpecPrefetchError("expert_recall: no tokens")
    return float(recall_per_token(topk, candidates).mean())


def select_candidates(scores: Tensor, m: int, empty_when_zero: bool = False) -> Tensor:
    """TopM expert ids of ``scores`` [..., n] (stable: ties to the lower id); -1 where ``empty_when_zero``
    and the score is not positive (a method with fewer than M candidates)."""
    n = scores.shape[-1]
    if not 1 <= m <= n:
        raise SpecPrefetchError(f"candidate budget M={m} must be in [1, n_experts={n}]")
    scores = scores if scores.dtype == torch.float64 else scores.float()  # keep float64 tie-breaks
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :m], idx[..., :m]
    if empty_when_zero:
        idx = torch.where(vals > 0, idx, torch.full_like(idx, -1))
    return idx


def run_ids(sample_index: Tensor) -> Tensor:
    """[T] ordinal of each token's run (0..G-1): the group id used for batch-level aggregation."""
    _, inverse = torch.unique_consecutive(sample_index, return_inverse=True)
    return inverse


def aggregate_by_sample(scores: Tensor, sample_index: Tensor) -> tuple[Tensor, Tensor]:
    """Batch-level priorities s = Σ_t π̂_t per sample: ([G, n] sums, [T] group of each token)."""
    groups = run_ids(sample_index).to(scores.device)
    out = torch.zeros(int(groups.max()) + 1 if groups.numel() else 0, scores.shape[-1],
                      dtype=torch.float64, device=scores.device)
    out.index_add_(0, groups, scores.double())
    return out, groups


# --------------------------------------------------------------------------------------------- confidence intervals

CI_LEVEL = 0.95
CI_BOOT = 10_000
CI_SEED = 0


class CI(NamedTuple):
    """A percentile-bootstrap confidence interval of a mean: ``(mean, lo, hi, n)``. With one value the interval is
    (mean, mean) and not ``decidable``: no claim can be settled by it."""

    mean: float
    lo: float
    hi: float
    n: int

    @property
    def decidable(self) -> bool:
        return self.n >= 2

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2.0


def bootstrap_ci(values: Sequence[float] | np.ndarray, n_boot: int = CI_BOOT, seed: int = CI_SEED,
                 level: float = CI_LEVEL) -> CI:
    """Percentile bootstrap CI of the mean of ``values`` (one per repeat): the repeats are resampled with
    replacement ``n_boot`` times (numpy ``default_rng(seed)``, so the interval is reproducible) and the interval is
    the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled means. For paired device gains the
    values are the per-repeat gains, so resampling them resamples the (config, OFF) pairs. NaNs are an error
    (drop them first); one value gives ``(mean, mean)``, marked not decidable."""
    arr = np.asarray(values, dtype=float).ravel()
    if arr.size == 0:
        raise ValueError("bootstrap_ci of nothing")
    if not np.isfinite(arr).all():
        raise ValueError("bootstrap_ci: non-finite values (drop missing repeats first)")
    if not 0.0 < level < 1.0 or n_boot < 1:
        raise ValueError(f"bootstrap_ci: level {level} must be in (0, 1) and n_boot {n_boot} >= 1")
    mean = float(arr.mean())
    if arr.size == 1:
        return CI(mean, mean, mean, 1)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, arr.size, size=(n_boot, arr.size))
    means = arr[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    # the resampled means of a constant series are that constant up to rounding; keep lo <= mean <= hi exact
    return CI(mean, float(min(lo, mean)), float(max(hi, mean)), int(arr.size))
