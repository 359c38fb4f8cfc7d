"""Next-layer expert priorities at run time, and the window-aware prefetch selection (paper §3.3).

At MoE layer ``l`` the runtime hands the router input ``x^l`` ([T, D]) to a :class:`PriorityProvider`, which
returns the priority vector ``s^{l+d}`` over the ``n`` experts of layer ``l+d`` (batch priorities: the sum of
the per-token distributions, §3.2); ``d`` is the provider's ``lookahead``: 1 in the paper, and a predictor
trained at distance ``d`` (``predictors.lookahead``) prefetches ``d`` layers ahead. :func:`select_prefetch` then
takes the ``M_max`` best experts that are neither available nor in flight, in descending priority.

Providers: a trained predictor of ``specprefetch.predictors`` (SpecPrefetch adapters, FATE, and any method that
implements ``layer_token_scores(l, x)``) evaluated one layer at a time, and Naive Prefetch (the experts the
previous token used at layer ``l+1``, ranked by their routing weight), which needs the runtime's own history.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specprefetch.contracts import POLICY
from specprefetch.io import SpecPrefetchError


class PriorityError(SpecPrefetchError):
    """A predictor cannot be evaluated layer by layer at run time."""


class PriorityProvider:
    """Base: no predictions (OFF and the all-resident bound)."""

    name = "none"
    empty_when_zero = False
    lookahead = 1  # the layer predicted: l + lookahead
    # "router": asked at layer l's router with its router input (the paper); "pre_attention": asked before layer
    # l + 1's attention with that layer's pre-attention input (its window: the attention; beyond the paper)
    stage = "router"
    batch = 1  # sequences decoded together (set by the runtime): a prefill's rows are [batch x tokens], batch-major

    def reset(self) -> None:
        """Forget per-sequence state (a new prompt starts)."""

    def scores(self, layer: int, x: Tensor) -> Tensor | np.ndarray | None:
        """Priorities ``[n]`` (float32, CPU) for layer ``layer + lookahead`` from router input ``x`` of ``layer``: a
        tensor, or a numpy array on a one-token CPU hot path (:func:`select_prefetch` takes either)."""
        return None

    def observe(self, layer: int, top_k_index: Tensor, top_k_weights: Tensor) -> None:
        """The native routing of ``layer`` for the current step (after it executed)."""


class PredictorPriority(PriorityProvider):
    """A ``specprefetch.predictors`` predictor evaluated on one layer's router input.

    The per-layer weights are extracted once (contiguous, float32) so a prediction is two (SpecPrefetch) or one
    (FATE) small matmuls. For a single token the softmax is skipped: it is monotonic, so the ranking, the only thing
    the prefetcher uses, is the logits' (for several tokens the priorities are the summed softmax, paper §3.2).

    A decoding step on the CPU (one token) is the hot path: there the matmuls run in numpy on transposed copies of
    the weights, which skips torch's per-op dispatch (a few µs an op, against a layer's budget of ~10 µs for the
    whole control path); prefill, CUDA and several tokens use torch.
    """

    def __init__(self, predictor: Any, device: torch.device | str = "cpu") -> None:
        from specprefetch.predictors.specprefetch import SpecPrefetchAdapter

        self.name = str(getattr(predictor, "method", type(predictor).__name__))
        self.lookahead = int(getattr(predictor.dims, "lookahead", 1))
        self.stage = str(getattr(predictor, "stage", "router"))
        self.pred = predictor.to(device).eval()
        self.empty_when_zero = bool(getattr(predictor, "empty_when_zero", False))
        self.n_pairs = int(predictor.dims.n_pairs)
        self.sigmoid = getattr(predictor.dims, "scoring", "softmax") == "sigmoid"
        custom = getattr(predictor, "layer_token_scores", None)
        self._np_chain: list[tuple[np.ndarray, ...]] | None = None
        self._np_bias: list[np.ndarray | None] = [None] * self.n_pairs
        on_cpu = torch.device(device).type == "cpu"
        with torch.no_grad():
            if callable(custom):
                self._token_scores = custom
                self._logits = None
            elif isinstance(predictor, SpecPrefetchAdapter):  # B A x: SpecPrefetch, the pre-attention router
                self._a = [predictor.A[l].detach().float().contiguous() for l in range(self.n_pairs)]
                self._b = [predictor.B[l].detach().float().contiguous() for l in range(self.n_pairs)]
                self._logits = self._specprefetch
                if on_cpu:
                    self._np_chain = [(_np_t(a), _np_t(b)) for a, b in zip(self._a, self._b, strict=True)]
            elif self.name == "fate":
                self._w = [predictor.weight[l].detach().float().contiguous() for l in range(self.n_pairs)]
                self._bias = [predictor.bias[l].detach().float().contiguous() for l in range(self.n_pairs)]
                self._cb = [predictor.correction_bias[l].detach().float().contiguous() for l in range(self.n_pairs)]
                self._logits = self._fate
                if on_cpu:
                    self._np_chain = [(_np_t(w),) for w in self._w]
                    self._np_bias = [b.numpy() for b in self._bias]
            else:
                raise PriorityError(f"predictor method {self.name!r} cannot be evaluated layer by layer at run "
                                    "time (it needs a layer_token_scores(l, x) method)")
        self._np_fast = self._np_chain is not None and not self.sigmoid

    def _specprefetch(self, layer: int, x: Tensor) -> Tensor:
        return F.linear(F.linear(x.float(), self._a[layer]), self._b[layer])

    def _fate(self, layer: int, x: Tensor) -> Tensor:
        return F.linear(x.float(), self._w[layer], self._bias[layer])

    def scores(self, layer: int, x: Tensor) -> Tensor | np.ndarray | None:
        if layer >= self.n_pairs:
            return None
        if self._np_fast and x.ndim == 2 and x.shape[0] == 1 and x.dtype is torch.float32 and x.is_cpu:
            return self._one_token_logits(layer, x)  # numpy: no tensor round trip on the hot path
        return self._torch_scores(layer, x.reshape(-1, x.shape[-1]))

    @torch.no_grad()
    def _torch_scores(self, layer: int, x: Tensor) -> Tensor:
        if self._logits is None:
            s = self._token_scores(layer, x).sum(dim=0)
        else:
            z = self._logits(layer, x)
            if self.sigmoid:
                s = (torch.sigmoid(z) + self._cb[layer]).sum(dim=0)
            elif z.shape[0] == 1:
                s = z[0]  # one token: softmax is monotonic, the ranking is the logits'
            else:
                s = F.softmax(z, dim=-1).sum(dim=0)
        return s if s.device.type == "cpu" else s.cpu()


    def _one_token_logits(self, layer: int, x: Tensor) -> np.ndarray:
        """The logits of one token on the CPU (the ranking of a decoding step), in numpy."""
        v = (x.detach() if x.requires_grad else x).numpy()[0]
        for w in self._np_chain[layer]:
            v = v @ w
        bias = self._np_bias[layer]
        return v + bias if bias is not None else v


def _np_t(w: Tensor) -> np.ndarray:
    """``w.T`` as a contiguous numpy array (CPU weights), for ``x @ w.T`` without torch's dispatch."""
    return np.ascontiguousarray(w.t().numpy())


class PreviousTokenPriority(PriorityProvider):
    """Naive Prefetch: the previous token's experts at layer l+d (d = 1: the paper's), ranked by their routing
    weight."""

    name = "previous_token"
    empty_when_zero = True

    def __init__(self, n_layers: int, n_experts: int, lookahead: int = 1) -> None:
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.lookahead = int(lookahead)
        self.reset()

    def reset(self) -> None:
        self.last: list[Tensor | None] = [None] * self.n_layers

    def scores(self, layer: int, x: Tensor) -> Tensor | None:
        if layer + self.lookahead >= self.n_layers:
            return None
        return self.last[layer + self.lookahead]

    def observe(self, layer: int, top_k_index: Tensor, top_k_weights: Tensor) -> None:
        # each sequence's last token of the step is its "previous" one next step (rows: [batch x tokens])
        k = top_k_index.shape[-1]
        idx = top_k_index.reshape(self.batch, -1, k)[:, -1].long().cpu()
        w = top_k_weights.reshape(self.batch, -1, k)[:, -1].float().cpu().clamp(min=0)
        s = torch.zeros(self.n_experts)
        # a positive score for every executed expert: how many sequences used it, then its routing weight
        for i, wi in zip(idx, w):
            s.index_add_(0, i, 1.0 + wi / (1.0 + wi.max()))
        self.last[layer] = s


def builtin_provider(policy: str, n_layers: int, n_experts: int, lookahead: int = 1) -> PriorityProvider | None:
    """The priority provider of a predicting policy that needs no trained predictor (Naive Prefetch: a
    :class:`PreviousTokenPriority`, ``lookahead`` layers ahead), else None. The harness, the lm-eval wrapper and the
    simulator take Naive Prefetch's provider from here, so the simulator replays the object the runtime runs."""
    pol = POLICY[policy]
    return (PreviousTokenPriority(n_layers, n_experts, lookahead) if pol.predicts and pol.provider is None
            else None)


def select_prefetch(scores: Tensor | None, exclude: Collection[int], m_max: int,
                    empty_when_zero: bool = False) -> list[int]:
    """P^{l+1} = Top_{M_max} of s over experts not available nor in flight, in descending priority.

    Ties go to the lower expert id (a stable order), so the runtime and the simulator agree. One numpy stable
    argsort of the n priorities, then a walk that stops after ``m_max`` picks: a few µs, no tensor ops.
    """
    if m_max <= 0 or scores is None:
        return []
    if isinstance(scores, np.ndarray):  # the one-token CPU hot path (PredictorPriority.scores)
        vals = scores
    elif isinstance(scores, Tensor):
        vals = scores.detach().cpu().numpy()
    else:
        vals = np.asarray(scores)
    order = (-vals).argsort(kind="stable")  # the method, not np.argsort: ~1 µs less dispatch
    out: list[int] = []
    for e in order.tolist():
        if empty_when_zero and vals[e] <= 0.0:
            break
        if e in exclude:
            continue
        out.append(e)
        if len(out) >= m_max:
            break
    return out


def fate_from_model(spec: Any, lookahead: int = 1) -> Any:
    """A FATE predictor built from a model's own gates (training-free, no trace needed): layer l+d's gate applied
    to x^l (``lookahead`` d)."""
    from specprefetch.predictors.base import PredictorDims, build_predictor

    dims = PredictorDims(n_layers=spec.n_layers, hidden_size=spec.hidden_size, n_experts=spec.n_experts,
                         top_k=spec.top_k, scoring=spec.scoring, arch=spec.arch, lookahead=int(lookahead))
    pred = build_predictor("fate", None, dims)
    pred.set_gates(spec.router_tensors())
    return pred


def provider_factories(pred_dirs: dict[str, Path], spec: Any, device: str, model: str | None = None,
                       lookahead: Collection[int] = (1,)) -> dict[str, Callable[[], Any]]:
    """Factories of priority providers, keyed by predictor name (:func:`~specprefetch.predictors.base.ahead_name`:
    ``specprefetch``, ``specprefetch.d2``): trained predictors from their directories (a name's distance must be
    its predictor's); FATE also from the gates, at every distance of ``lookahead``.

    With ``model``, each predictor must have been trained for that model (its meta.json says so)."""
    from specprefetch.predictors.base import ahead_name, load_predictor, read_meta

    out: dict[str, Callable[[], Any]] = {}
    for name, d in pred_dirs.items():
        trained_for = read_meta(d).get("model")
        if model is not None and trained_for != model:
            raise SpecPrefetchError(f"{d}: predictor trained for model {trained_for!r}, not {model!r}")
        pred = load_predictor(d)
        if pred.dims.n_layers != spec.n_layers or pred.dims.n_experts != spec.n_experts:
            raise SpecPrefetchError(f"{d}: predictor for L={pred.dims.n_layers}, n={pred.dims.n_experts}; "
                                    f"the model has L={spec.n_layers}, n={spec.n_experts}")
        method = str(getattr(pred, "method", name.split(".")[0]))
        if name != ahead_name(method, pred.dims.lookahead):
            raise SpecPrefetchError(f"{d}: a {method} predictor {pred.dims.lookahead} layer(s) ahead, given as "
                                    f"{name!r} (name it {ahead_name(method, pred.dims.lookahead)!r})")
        out[name] = (lambda p=pred: PredictorPriority(p, device))
    for d in lookahead:
        name = ahead_name("fate", d)
        if name not in out and d < spec.n_layers:
            fate = fate_from_model(spec, d)
            out[name] = lambda p=fate: PredictorPriority(p, device)
    return out
