"""4-bit grouped quantization of expert weights, computed by torch's own CPU int4 kernel (no dequantization).

The paper's on-device store holds DeepSeek-VL2-Tiny's experts in 4 bits (≈ 1.94 MB per expert with its scales).
Here a weight matrix ``W [N, K]`` (``y = x @ W.T``) is quantized symmetrically per group of ``group_size``
consecutive input columns (llama.cpp's Q4_0 idea: ``W ≈ (q - 8) * scale``, ``q`` in 0..15, ``scale = max|w| / 7``;
zero is exact, so a zero column stays exactly zero). The record holds

- the packed weights as ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` lays them out (``uint8 [N, K/2]``),
  the layout ``torch.ops.aten._weight_int4pack_mm_for_cpu`` reads, so an expert is computed straight from the
  bytes that were read from storage, as a phone runtime computes on its Q4 blocks;
- ``scales_and_zeros`` (bf16 ``[K/group, N, 2]``; the zeros are 0 for symmetric quantization).

The packing is aten's (``PACKING``): a store records the torch version that packed it, and a store packed by another
torch version is refused (its layout is torch's, not ours). Activations enter the kernel in bf16.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specprefetch.io import SpecPrefetchError

PACKING = "aten-int4pack-cpu"
GROUP_SIZES = (32, 64, 128, 256)


class QuantError(SpecPrefetchError):
    """A quantized store cannot be built or used on this platform."""


def check_int4_available(device: torch.device | str = "cpu") -> None:
    if torch.device(device).type != "cpu":
        raise QuantError(f"the int4 expert store uses aten's CPU packing ({PACKING}); on {device} use "
                         "device.paper_scale.format: bf16")
    ops = torch.ops.aten
    if not (hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")):
        raise QuantError(f"torch {torch.__version__} has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)")


def quantize(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric grouped 4-bit quantization of ``w [N, K]``: ``(q int32 [N, K] in 0..15, scales_and_zeros bf16
    [K/group, N, 2])`` with ``w ≈ (q - 8) * scale``."""
    n, k = w.shape
    if k % group_size:
        raise QuantError(f"input width {k} is not a multiple of the group size {group_size}")
    g = w.detach().float().reshape(n, k // group_size, group_size)
    scale = (g.abs().amax(dim=-1) / 7.0).to(torch.bfloat16).float()          # the scale the kernel will use
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (torch.round(g / safe[..., None]).clamp(-8, 7) + 8).to(torch.int32).reshape(n, k)
    sz = torch.stack([scale.T, torch.zeros_like(scale.T)], dim=-1).to(torch.bfloat16).contiguous()
    return q, sz


def pack(q: Tensor) -> Tensor:
    """aten's CPU int4 packing of ``q int32 [N, K]`` -> ``uint8 [N, K/2]``."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


def scales_shape(n: int, k: int, group_size: int) -> tuple[int, int, int]:
    return (k // group_size, n, 2)


def linear(x: Tensor, packed: Tensor, scales_and_zeros: Tensor, group_size: int) -> Tensor:
    """``x [M, K] @ W.T`` for a packed ``W [N, K]``: bf16 in, bf16 out (the kernel's dtypes)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, group_size,
                                                      scales_and_zeros)

