"""Paper-scale experts: the trained stand-in's experts widened to the real model's expert shape and storage form.

The device benchmarks must move the paper model's bytes and compute its FLOPs (DeepSeek-VL2-Tiny: 64 routed
experts of ``3 x 1280 x 896`` parameters, 2 shared, top-6, 11 MoE layers; ≈ 1.94 MB per expert in 4 bits), while
the routing, the predictor inputs and the decoded tokens stay those of a trained model. Each stand-in expert
(``gate_up [2I, H]``, ``down [H, I]``) is embedded in a real-size expert (``[2I', H']``, ``[H', I']``):

- the trained weights occupy the top-left blocks of gate, up and down;
- the added input columns of gate/up multiply the zero padding of the (zero-padded) input: they add exactly 0;
- the added intermediate units have zero columns in ``down``: they add exactly 0 (int4: their groups quantize to
  scale 0, so the kernel's dequantized weight is 0 in any formulation);
- the added output rows of ``down`` are computed and dropped (the model's hidden width is ``H``).

The added weights are seeded random values with the trained matrix's standard deviation (realistic quantization
scales and the same kernel work as real weights). Bytes and FLOPs are therefore the paper's and the output is the
trained stand-in's own (up to the 4-bit quantization, which the plain reference model shares: it computes from the
same stored records, :class:`ResidentExperts`). Shared experts are widened the same way (resident, never
offloaded). Attention, embeddings and the dense first layer keep the stand-in's size (so the measured compute
window is the experts' compute plus a small rest: a conservative window for prefetching).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.store import ALIGNMENT, RecordLayout

FORMATS = {"int4": ("int4", torch.bfloat16), "bf16": ("none", torch.bfloat16), "fp32": ("none", torch.float32)}


@dataclass(frozen=True)
class ExpertScale:
    """The real model's expert shape and storage form (``device.paper_scale`` of a model)."""

    hidden_size: int
    intermediate_size: int
    shared_intermediate_size: int = 0  # the shared experts' (summed) width; 0: shared experts keep their size
    format: str = "int4"               # int4 (aten's CPU kernel), bf16 or fp32
    group_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise SpecPrefetchError(f"unknown paper-scale expert format {self.format!r} ({', '.join(FORMATS)})")

    def layout(self, model_hidden: int, intermediate: int | None = None) -> RecordLayout:
        quant, dtype = FORMATS[self.format]
        return RecordLayout(self.hidden_size, intermediate or self.intermediate_size, dtype, ALIGNMENT, quant,
                            self.group_size if quant == "int4" else 0, model_hidden)

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def check_fits(self, hidden: int, intermediate: int, where: str) -> None:
        """The stand-in's expert ``(hidden, intermediate)`` must fit into the real one, on whole quantization
        groups."""
        if hidden > self.hidden_size or intermediate > self.intermediate_size:
            raise SpecPrefetchError(f"{where}: experts ({hidden}, {intermediate}) are wider than the paper-scale "
                                    f"({self.hidden_size}, {self.intermediate_size})")
        if self.format == "int4" and intermediate % self.group_size:
            raise SpecPrefetchError(f"{where}: expert width {intermediate} is not a multiple of the int4 group size "
                                    f"{self.group_size} (the added units must fill whole groups to add exactly 0)")

    def records(self, gate_up: Tensor, down: Tensor, layout: RecordLayout, layer: int) -> list[bytes]:
        """The store records of one layer's fused experts (``[E, 2I, H]``, ``[E, H, I]``), each widened."""
        return [layout.pack(*widen(gate_up[e], down[e], layout.hidden, layout.intermediate,
                                   _generator(self.seed, layer, e))) for e in range(gate_up.shape[0])]


def scale_of(store: Any) -> ExpertScale | None:
    """The widening a store was built with (None: the model's own experts)."""
    doc = store.scale_doc
    if doc is None:
        return None
    try:
        return ExpertScale(**doc)
    except TypeError as exc:
        raise SpecPrefetchError(f"{store.root}/manifest.json: paper_scale: {exc}") from None


def _generator(seed: int, *key: int) -> torch.Generator:
    digest = hashlib.sha256(f"specprefetch/paper-scale/{seed}/{'/'.join(map(str, key))}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def widen(gate_up: Tensor, down: Tensor, hidden: int, intermediate: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Embed one expert (``gate_up [2I, H]``, ``down [H, I]``) in ``[2I', H']`` / ``[H', I']`` (module docstring)."""
    two_i, h = gate_up.shape
    i = two_i // 2
    gu, dn = gate_up.detach().float(), down.detach().float()
    big_gu = torch.randn(2 * intermediate, hidden, generator=gen) * gu.std()
    big_gu[:i, :h] = gu[:i]                         # gate rows
    big_gu[intermediate: intermediate + i, :h] = gu[i:]  # up rows
    big_dn = torch.randn(hidden, intermediate, generator=gen) * dn.std()
    big_dn[:, i:] = 0.0                             # the added units contribute exactly zero
    big_dn[:h, :i] = dn
    return big_gu, big_dn


class ResidentExperts(nn.Module):
    """The plain model's experts computed from an expert store's records, all resident (no runtime).

    Same signature as transformers' fused experts ``(hidden_states, top_k_index, top_k_weights)`` and the same
    eager loop (experts in ascending id, ``index_add_``), with each expert's MLP that of the record layout: the
    reference the offloaded runtime's tokens are compared with.
    """

    from_store = True  # not a fused experts module: router discovery and the runtime accept it as is

    def __init__(self, layout: RecordLayout, records: Tensor, act_fn: nn.Module) -> None:
        super().__init__()
        self.layout = layout
        self.act_fn = act_fn
        self.num_experts = int(records.shape[0])
        self.register_buffer("records", records, persistent=False)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:
                continue
            pos, tok = torch.where(top_k_index.t() == e)
            y = self.layout.mlp(self.layout.views(self.records[e]), hidden_states[tok], self.act_fn)
            out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
        return out


class WideMLP(nn.Module):
    """A widened shared-expert MLP (resident): one record of the paper-scale layout, computed like an expert."""

    def __init__(self, layout: RecordLayout, record: Tensor, act_fn: nn.Module) -> None:
        super().__init__()
        self.layout = layout
        self.act_fn = act_fn
        self.register_buffer("record", record, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return self.layout.mlp(self.layout.views(self.record), flat, self.act_fn).view(x.shape)


def widen_shared_experts(blocks: list[Any], scale: ExpertScale) -> int:
    """Replace every MoE block's ``shared_experts`` (gate/up/down projections) by its widened :class:`WideMLP`;
    returns how many were widened (0 when the model has none or ``shared_intermediate_size`` is 0)."""
    if not scale.shared_intermediate_size:
        return 0
    n = 0
    for b in blocks:
        mlp = getattr(b.block, "shared_experts", None)
        if mlp is None or isinstance(mlp, WideMLP):
            continue
        try:
            gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        except AttributeError:
            raise SpecPrefetchError(f"MoE layer {b.model_layer}: shared experts {type(mlp).__name__} have no "
                                    "gate_proj/up_proj/down_proj to widen") from None
        h = int(gate.shape[1])
        ExpertScale(scale.hidden_size, scale.shared_intermediate_size, 0, scale.format,
                    scale.group_size).check_fits(h, int(gate.shape[0]), f"MoE layer {b.model_layer} shared experts")
        layout = scale.layout(h, scale.shared_intermediate_size)
        gu, dn = widen(torch.cat([gate, up]), down, layout.hidden, layout.intermediate,
                       _generator(scale.seed, b.ordinal, -1))
        rec = torch.frombuffer(bytearray(layout.pack(gu, dn)), dtype=torch.uint8)
        b.block.shared_experts = WideMLP(layout, rec, mlp.act_fn)
        n += 1
    return n


def match_store(blocks: list[Any], store: Any) -> None:
    """Widen the shared experts the way ``store`` was widened (nothing for a store of the model's own experts)."""
    scale = scale_of(store)
    if scale is not None:
        widen_shared_experts(blocks, scale)


def install_store_experts(blocks: list[Any], store: Any, device: torch.device | str = "cpu") -> list[nn.Module]:
    """Make the model the plain model of ``store``: shared experts widened (a paper-scale store) and every MoE
    block's experts computed from the store's records, all resident (:class:`ResidentExperts`). Returns the experts
    modules it replaced (put them back to undo)."""
    match_store(blocks, store)
    saved = []
    for b in blocks:
        saved.append(b.block.experts)
        records = store.layer_records(b.ordinal).to(device)
        b.block.experts = ResidentExperts(store.layout, records, b.experts.act_fn)
    return saved
