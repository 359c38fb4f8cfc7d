"""Router discovery: where a model's MoE gates are and exactly how each arch turns logits into experts.

Discovery dispatches on ``model.config.model_type`` and walks the module path that arch is known to use
(checked against transformers 5.24; DeepSeek-VL2 is our own implementation of the official code); it never
searches modules by name.
Each arch's selection rule (softmax/sigmoid scoring, greedy or group-limited top-k, DeepSeek-V3's
``e_score_correction_bias``) is reproduced by :func:`select_experts`, so traces, predictors and the runtime
can recompute the executed experts from a gate weight and a router input alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specprefetch.models.selection import TOPK_METHODS, RoutingError, router_scores, select_experts

log = logging.getLogger(__name__)

#: model_type of the model's config -> our arch name (config ``models.*.arch``).
MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "deepseek_vl_v2": "deepseek_vl2",  # DeepSeek-VL2, natively (specprefetch.models.deepseek_vl2)
    "deepseek_vl2_standin": "deepseek_vl2_standin",  # our stand-in (specprefetch.models.standins)
}
SUPPORTED_ARCHS: tuple[str, ...] = tuple(dict.fromkeys(MODEL_TYPE_TO_ARCH.values()))
__all__ = ["SUPPORTED_ARCHS", "TOPK_METHODS", "RoutingError", "RoutingSpec", "discover_routing", "router_scores",
           "select_experts"]


# ------------------------------------------------------------------------------------------ spec
@dataclass
class RoutingSpec:
    """Where the MoE gates of a model are and how it routes (see the shared data contract).

    ``gates[i]`` is the router module of MoE layer ordinal ``i`` (model layer ``moe_layers[i]``); its
    ``weight`` is ``[n_experts, hidden_size]``. ``native_logits_dtype=True`` means the model computes router
    logits in the router input's dtype (Qwen, Mixtral, OLMoE); otherwise in float32 (DeepSeek).
    """

    arch: str
    moe_layers: list[int]
    gates: list[nn.Module]
    n_experts: int
    top_k: int
    hidden_size: int
    scoring: str
    n_shared_experts: int
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    group_fill: float = float("-inf")
    native_logits_dtype: bool = False
    num_hidden_layers: int = 0
    model_type: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # ``pre_norms[i]``: the pre-attention norm (``input_layernorm``) of MoE layer ordinal ``i``'s decoder layer; its
    # output is what the layer's attention reads (the pre-attention predictor's input, beyond the paper)
    pre_norms: list[nn.Module] = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        """L, the number of MoE layers."""
        return len(self.moe_layers)

    def _gate(self, i: int) -> nn.Module:
        if not 0 <= i < len(self.gates):
            raise RoutingError(f"MoE layer ordinal {i} out of range [0, {len(self.gates)})")
        return self.gates[i]

    def weight(self, i: int) -> Tensor:
        return self._gate(i).weight

    def correction_bias(self, i: int) -> Tensor | None:
        bias = getattr(self._gate(i), "e_score_correction_bias", None)
        return bias if self.topk_method == "noaux_tc" else None

    def logits(self, i: int, x: Tensor) -> Tensor:
        """Router logits of MoE layer ``i`` in float32, recomputed from the gate weight: ``[T, n]``."""
        w = self.weight(i)
        x = x.reshape(-1, w.shape[-1])
        return F.linear(x.float(), w.float().to(x.device))

    def probs(self, i: int, logits: Tensor) -> Tensor:
        """The routing distribution pi used as the KL target (paper 3.4): softmax of the logits, float32."""
        return logits.float().softmax(dim=-1)

    def scores(self, i: int, logits: Tensor) -> Tensor:
        """The gating scores the model weights experts with (softmax or sigmoid)."""
        return router_scores(logits, self.scoring)

    def topk(self, i: int, logits: Tensor) -> Tensor:
        """The experts MoE layer ``i`` executes for these logits: LongTensor ``[T, K]``, best first."""
        bias = self.correction_bias(i)
        return select_experts(
            logits, self.top_k, self.scoring, self.topk_method, self.n_group, self.topk_group,
            None if bias is None else bias.detach().float().to(logits.device), self.group_fill,
        )

    def executed_topk(self, i: int, x: Tensor) -> Tensor:
        """Exactly what the model executes for router input ``x``: logits in the model's own compute dtype.

        Qwen/Mixtral/OLMoE routers compute ``F.linear(x, W)`` in the model dtype (bf16 for the real
        checkpoints) before a float32 softmax, so near-ties can differ from float32 logits; this replays
        that. For float32 models and DeepSeek routers it equals ``topk(i, logits(i, x))``.
        """
        if not self.native_logits_dtype or x.dtype == torch.float32:
            return self.topk(i, self.logits(i, x))
        w = self.weight(i)
        native = F.linear(x.reshape(-1, w.shape[-1]), w.to(x.device, x.dtype))
        return self.topk(i, native)

    def router_tensors(self) -> dict[str, Tensor]:
        """The gates as a flat dict for ``routers.safetensors``: ``gate.{i}.weight`` (+ correction bias)."""
        out: dict[str, Tensor] = {}
        for i, gate in enumerate(self.gates):
            out[f"gate.{i}.weight"] = gate.weight.detach().float().cpu().contiguous()
            bias = getattr(gate, "bias", None)
            if isinstance(bias, Tensor):
                out[f"gate.{i}.bias"] = bias.detach().float().cpu().contiguous()
            cb = self.correction_bias(i)
            if cb is not None:
                out[f"gate.{i}.e_score_correction_bias"] = cb.detach().float().cpu().contiguous()
        return out

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (for manifests and ``specprefetch inspect-model``)."""
        return {
            "arch": self.arch,
            "model_type": self.model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "moe_layers": list(self.moe_layers),
            "n_moe_layers": self.n_layers,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "scoring": self.scoring,
            "n_shared_experts": self.n_shared_experts,
            "topk_method": self.topk_method,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "group_fill": None if math.isinf(self.group_fill) else self.group_fill,
            "native_logits_dtype": self.native_logits_dtype,
            "gate_class": type(self.gates[0]).__name__ if self.gates else None,
            **self.extra,
        }


# ------------------------------------------------------------------------------------------ discovery
def discover_routing(model: nn.Module) -> RoutingSpec:
    """Find the MoE routers of ``model`` by its ``config.model_type`` (never by guessing module names)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    arch = MODEL_TYPE_TO_ARCH.get(model_type or "")
    if arch is None:
        raise RoutingError(
            f"unsupported model_type {model_type!r} ({type(model).__name__}); supported model types: "
            f"{', '.join(sorted(MODEL_TYPE_TO_ARCH))} (archs: {', '.join(SUPPORTED_ARCHS)})"
        )
    spec = _DISCOVER[arch](model)
    spec.model_type = model_type or ""
    _check_gates(spec)
    log.debug("discovered %s routing: %d MoE layers, n=%d, K=%d, D=%d", arch, spec.n_layers,
              spec.n_experts, spec.top_k, spec.hidden_size)
    return spec


def _check_gates(spec: RoutingSpec) -> None:
    if len(spec.moe_layers) < 1:
        raise RoutingError(f"{spec.arch}: no MoE layers found")
    for i, gate in zip(spec.moe_layers, spec.gates):
        w = getattr(gate, "weight", None)
        if not isinstance(w, Tensor) or tuple(w.shape) != (spec.n_experts, spec.hidden_size):
            raise RoutingError(
                f"{spec.arch}: gate of layer {i} ({type(gate).__name__}) has weight shape "
                f"{None if w is None else tuple(w.shape)}, expected ({spec.n_experts}, {spec.hidden_size})"
            )
    if not 1 <= spec.top_k <= spec.n_experts:
        raise RoutingError(f"{spec.arch}: top_k={spec.top_k} not in [1, n_experts={spec.n_experts}]")


def _layers_of(decoder: nn.Module, arch: str) -> nn.ModuleList:
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RoutingError(f"{arch}: {type(decoder).__name__} has no decoder `layers` ModuleList")
    return layers


def _base_decoder(model: nn.Module, decoder_cls: type, arch: str) -> nn.Module:
    """The decoder (``XModel``) of an ``XForCausalLM`` or the ``XModel`` itself."""
    if isinstance(model, decoder_cls):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, decoder_cls):
        return inner
    raise RoutingError(f"{arch}: expected {decoder_cls.__name__} or a model wrapping it as `.model`, "
                       f"got {type(model).__name__}")


def _moe_modules(layers: nn.ModuleList, indices: list[int], gate_cls: type | None, arch: str) -> dict[str, Any]:
    """The router (``layers[i].mlp.gate``) and the pre-attention norm (``layers[i].input_layernorm``) of each MoE
    layer ``i``: the ``gates`` and ``pre_norms`` of its :class:`RoutingSpec`."""
    gates, norms = [], []
    for i in indices:
        mlp = getattr(layers[i], "mlp", None)
        gate = getattr(mlp, "gate", None)
        if gate is None or (gate_cls is not None and not isinstance(gate, gate_cls)):
            want = gate_cls.__name__ if gate_cls is not None else "a router"
            raise RoutingError(f"{arch}: layer {i} should be MoE (per its config) but layers[{i}].mlp.gate is "
                               f"{type(gate).__name__ if gate is not None else 'missing'}, not {want}")
        norm = getattr(layers[i], "input_layernorm", None)
        if not isinstance(norm, nn.Module):
            raise RoutingError(f"{arch}: decoder layer {i} has no `input_layernorm` module (its pre-attention norm)")
        gates.append(gate)
        norms.append(norm)
    return {"gates": gates, "pre_norms": norms}


def _sparse_step_layers(text_cfg: Any) -> list[int]:
    """Qwen3-MoE rule: MoE iff not in mlp_only_layers and (idx+1) % decoder_sparse_step == 0."""
    only = set(getattr(text_cfg, "mlp_only_layers", None) or [])
    step = int(getattr(text_cfg, "decoder_sparse_step", 1) or 1)
    if text_cfg.num_experts <= 0:
        return []
    return [i for i in range(text_cfg.num_hidden_layers) if i not in only and (i + 1) % step == 0]


def _discover_qwen3_vl_moe(model: nn.Module) -> RoutingSpec:
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m

    if isinstance(model, m.Qwen3VLMoeForConditionalGeneration):
        text = model.model.language_model
    elif isinstance(model, m.Qwen3VLMoeModel):
        text = model.language_model
    else:
        raise RoutingError(f"qwen3_vl_moe: unexpected model class {type(model).__name__}")
    tc = model.config.text_config
    idx = _sparse_step_layers(tc)
    return RoutingSpec(
        arch="qwen3_vl_moe", moe_layers=idx, **_moe_modules(_layers_of(text, "qwen3_vl_moe"), idx,
                                                             m.Qwen3VLMoeTextTopKRouter, "qwen3_vl_moe"),
        n_experts=tc.num_experts, top_k=tc.num_experts_per_tok, hidden_size=tc.hidden_size, scoring="softmax",
        n_shared_experts=0, norm_topk_prob=True, native_logits_dtype=True, num_hidden_layers=tc.num_hidden_layers,
    )


def _discover_qwen3_moe(model: nn.Module) -> RoutingSpec:
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    dec = _base_decoder(model, m.Qwen3MoeModel, "qwen3_moe")
    c = model.config
    idx = _sparse_step_layers(c)
    return RoutingSpec(
        arch="qwen3_moe", moe_layers=idx,
        **_moe_modules(_layers_of(dec, "qwen3_moe"), idx, m.Qwen3MoeTopKRouter, "qwen3_moe"),
        n_experts=c.num_experts, top_k=c.num_experts_per_tok, hidden_size=c.hidden_size, scoring="softmax",
        n_shared_experts=0, norm_topk_prob=bool(c.norm_topk_prob), native_logits_dtype=True,
        num_hidden_layers=c.num_hidden_layers,
    )


def _discover_mixtral(model: nn.Module) -> RoutingSpec:
    from transformers.models.mixtral import modeling_mixtral as m

    dec = _base_decoder(model, m.MixtralModel, "mixtral")
    c = model.config
    idx = list(range(c.num_hidden_layers))  # every Mixtral layer is MoE
    return RoutingSpec(
        arch="mixtral", moe_layers=idx,
        **_moe_modules(_layers_of(dec, "mixtral"), idx, m.MixtralTopKRouter, "mixtral"),
        n_experts=c.num_local_experts, top_k=c.num_experts_per_tok, hidden_size=c.hidden_size, scoring="softmax",
        n_shared_experts=0, norm_topk_prob=True, native_logits_dtype=True, num_hidden_layers=c.num_hidden_layers,
    )


def _discover_olmoe(model: nn.Module) -> RoutingSpec:
    from transformers.models.olmoe import modeling_olmoe as m

    dec = _base_decoder(model, m.OlmoeModel, "olmoe")
    c = model.config
    idx = list(range(c.num_hidden_layers))  # every OLMoE layer is MoE
    return RoutingSpec(
        arch="olmoe", moe_layers=idx, **_moe_modules(_layers_of(dec, "olmoe"), idx, m.OlmoeTopKRouter, "olmoe"),
        n_experts=c.num_experts, top_k=c.num_experts_per_tok, hidden_size=c.hidden_size, scoring="softmax",
        n_shared_experts=0, norm_topk_prob=bool(c.norm_topk_prob), native_logits_dtype=True,
        num_hidden_layers=c.num_hidden_layers,
    )


def _deepseek_v2_spec(lm: nn.Module, arch: str) -> RoutingSpec:
    """transformers' DeepseekV2: MoE iff idx >= first_k_dense_replace; float32 softmax; greedy/group-limited."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

    dec = _base_decoder(lm, m.DeepseekV2Model, arch)
    c = lm.config
    idx = [i for i in range(c.num_hidden_layers) if i >= (c.first_k_dense_replace or 0)]
    method = c.topk_method or "greedy"
    return RoutingSpec(
        arch=arch, moe_layers=idx, **_moe_modules(_layers_of(dec, arch), idx, m.DeepseekV2TopkRouter, arch),
        n_experts=c.n_routed_experts, top_k=c.num_experts_per_tok, hidden_size=c.hidden_size, scoring="softmax",
        n_shared_experts=int(c.n_shared_experts or 0), topk_method=method,
        n_group=c.n_group if method != "greedy" else None, topk_group=c.topk_group if method != "greedy" else None,
        norm_topk_prob=False,  # transformers' DeepseekV2TopkRouter never renormalises the top-k weights
        routed_scaling_factor=float(c.routed_scaling_factor), group_fill=0.0, native_logits_dtype=False,
        num_hidden_layers=c.num_hidden_layers,
    )


def _discover_deepseek_v2(model: nn.Module) -> RoutingSpec:
    return _deepseek_v2_spec(model, "deepseek_v2")


def _discover_deepseek_v3(model: nn.Module) -> RoutingSpec:
    """transformers' DeepseekV3: sigmoid + e_score_correction_bias, group top-k by top-2 sums, -inf fill."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    dec = _base_decoder(model, m.DeepseekV3Model, "deepseek_v3")
    c = model.config
    idx = [i for i in range(c.num_hidden_layers) if i >= (c.first_k_dense_replace or 0)]
    return RoutingSpec(
        arch="deepseek_v3", moe_layers=idx,
        **_moe_modules(_layers_of(dec, "deepseek_v3"), idx, m.DeepseekV3TopkRouter, "deepseek_v3"),
        n_experts=c.n_routed_experts, top_k=c.num_experts_per_tok, hidden_size=c.hidden_size, scoring="sigmoid",
        n_shared_experts=int(c.n_shared_experts or 0), topk_method="noaux_tc", n_group=c.n_group,
        topk_group=c.topk_group, norm_topk_prob=bool(c.norm_topk_prob),
        routed_scaling_factor=float(c.routed_scaling_factor), group_fill=float("-inf"), native_logits_dtype=False,
        num_hidden_layers=c.num_hidden_layers,
    )


def _discover_deepseek_vl2(model: nn.Module) -> RoutingSpec:
    """Our DeepSeek-VL2 (:mod:`specprefetch.models.deepseek_vl2`): ``language.model.layers[i].mlp.gate`` is a
    :class:`~specprefetch.models.deepseek_vl2.Router` (the official ``MoEGate``'s rule: MoE iff ``idx >=
    first_k_dense_replace`` and ``idx % moe_layer_freq == 0``; masked groups filled with 0.0; float32 logits)."""
    from specprefetch.models.deepseek_vl2 import DeepseekVL2ForCausalLM, Router, is_moe_layer

    if not isinstance(model, DeepseekVL2ForCausalLM):
        raise RoutingError(f"deepseek_vl2: expected specprefetch's DeepseekVL2ForCausalLM, got {type(model).__name__}")
    c = model.config.text
    idx = [i for i in range(c.num_hidden_layers) if is_moe_layer(c, i)]
    method = c.topk_method
    return RoutingSpec(
        arch="deepseek_vl2", moe_layers=idx, **_moe_modules(_layers_of(model.language.model, "deepseek_vl2"), idx,
                                                             Router, "deepseek_vl2"),
        n_experts=int(c.n_routed_experts), top_k=int(c.num_experts_per_tok), hidden_size=int(c.hidden_size),
        scoring=str(c.scoring_func), n_shared_experts=int(c.n_shared_experts or 0), topk_method=method,
        n_group=c.n_group if method != "greedy" else None, topk_group=c.topk_group if method != "greedy" else None,
        norm_topk_prob=bool(c.norm_topk_prob), routed_scaling_factor=float(c.routed_scaling_factor), group_fill=0.0,
        native_logits_dtype=False, num_hidden_layers=int(c.num_hidden_layers),
    )


def _discover_deepseek_vl2_standin(model: nn.Module) -> RoutingSpec:
    """Our stand-in wraps a transformers ``DeepseekV2ForCausalLM`` as ``.language`` (as DeepSeek-VL2 does)."""
    language = getattr(model, "language", None)
    if language is None:
        raise RoutingError("deepseek_vl2_standin: model has no `.language` DeepseekV2ForCausalLM")
    spec = _deepseek_v2_spec(language, "deepseek_vl2_standin")
    return spec


_DISCOVER: dict[str, Callable[[nn.Module], RoutingSpec]] = {
    "qwen3_vl_moe": _discover_qwen3_vl_moe,
    "qwen3_moe": _discover_qwen3_moe,
    "deepseek_v2": _discover_deepseek_v2,
    "deepseek_v3": _discover_deepseek_v3,
    "mixtral": _discover_mixtral,
    "olmoe": _discover_olmoe,
    "deepseek_vl2": _discover_deepseek_vl2,
    "deepseek_vl2_standin": _discover_deepseek_vl2_standin,
}
