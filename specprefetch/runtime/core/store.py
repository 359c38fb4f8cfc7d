"""The expert store: routed experts on disk, one contiguous aligned record per expert, so one expert is one read.

Layout of a store directory (format ``specprefetch-expert-store/2``):

- ``layer-000.bin`` ... one file per MoE layer ordinal; expert ``e`` of that layer is the record at byte
  offset ``e * record_bytes``. A record holds the expert's tensors (:class:`RecordLayout`): ``gate_up [2I, H]`` and
  ``down [H, I]`` in a float dtype, or both in 4 bits with their scales (:mod:`.quant`), each part on a
  cache-line boundary, zero-padded so every record starts on an ``alignment`` boundary (4096: a page, and what
  O_DIRECT needs).
- ``manifest.json`` (written last): shapes, dtype, quantization, the record's parts, the paper-scale widening
  (:mod:`.paper_scale`) if any, and per file its size and sha256 plus the sha256 of every record (a load can be
  verified without reading the whole file).

Only routed experts live here; attention, embeddings, dense layers and shared experts stay resident in the
model. Experts are found through the model's routers (:func:`find_moe_blocks`): the experts module is the
sibling of each gate, a transformers 5 fused-experts module (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from specprefetch.contracts import STORE_FORMAT, finite, member, path_problem, read_doc, require, reraise_as
from specprefetch.io import SpecPrefetchError, atomic_path, provenance, write_json_atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ALIGNMENT = 4096
SUB_ALIGNMENT = 64  # down_proj starts on a cache-line boundary inside a record


class StoreError(SpecPrefetchError):
    """An expert store (or the model it is built from) is missing, corrupt or inconsistent; names the file."""


# ------------------------------------------------------------------------------------------ model side
@dataclass
class MoEBlock:
    """One MoE layer of a model: its block (holds ``gate`` and ``experts``), the gate, and the experts module."""

    ordinal: int
    model_layer: int
    block: nn.Module
    gate: nn.Module
    experts: nn.Module


def _routing_spec(model: nn.Module) -> Any:
    from specprefetch.models.routing import discover_routing

    return discover_routing(model)


def find_moe_blocks(model: nn.Module, spec: Any | None = None) -> list[MoEBlock]:
    """The MoE blocks of ``model`` in layer order, found through router discovery (never by name guessing).

    The experts module must be the gate's sibling named ``experts`` with fused 3-D ``gate_up_proj`` and
    ``down_proj`` tensors (transformers 5's layout); anything else (e.g. DeepSeek-VL2's repository code with a
    ModuleList of per-expert MLPs) is rejected with the module named.
    """
    spec = spec if spec is not None else _routing_spec(model)
    parents: dict[int, nn.Module] = {}
    for _, module in model.named_modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    blocks = []
    for i, (layer, gate) in enumerate(zip(spec.moe_layers, spec.gates)):
        block = parents.get(id(gate))
        experts = getattr(block, "experts", None)
        if block is None or experts is None:
            raise StoreError(f"MoE layer {layer}: the gate {type(gate).__name__} has no sibling `experts` module")
        if not _served(experts):
            check_fused_experts(experts, f"MoE layer {layer} ({type(experts).__name__})")
        blocks.append(MoEBlock(i, int(layer), block, gate, experts))
    return blocks


def _served(experts: nn.Module) -> bool:
    """Experts served by the runtime or computed from a store's records (not a fused experts module)."""
    return bool(getattr(experts, "is_offloaded", False) or getattr(experts, "from_store", False))


def check_fused_experts(experts: nn.Module, where: str) -> tuple[int, int, int]:
    """(n_experts, hidden, intermediate) of a fused experts module; raises if it is not one."""
    gu = getattr(experts, "gate_up_proj", None)
    dp = getattr(experts, "down_proj", None)
    if not isinstance(gu, Tensor) or not isinstance(dp, Tensor) or gu.dim() != 3 or dp.dim() != 3:
        raise StoreError(f"{where}: not a fused experts module (needs 3-D gate_up_proj (E, 2I, H) and "
                         "down_proj (E, H, I)); the offloaded runtime supports transformers>=5 MoE layers")
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dp.shape) != (e, h, two_i // 2):
        raise StoreError(f"{where}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dp.shape)} do not match "
                         "(E, 2I, H) / (E, H, I)")
    if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True) \
            or not getattr(experts, "is_concatenated", True) or getattr(experts, "is_transposed", False):
        raise StoreError(f"{where}: expert layout (bias/gate/concatenation/transposition) not supported")
    return int(e), int(h), int(two_i // 2)


# ------------------------------------------------------------------------------------------ layout
def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Part:
    """One tensor inside a record: byte offset, size, shape and dtype."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one expert record (identical for every expert of a store), and the expert's computation.

    ``quant`` ``none``: ``gate_up [2I, H]`` and ``down [H, I]`` in ``dtype``. ``int4``: the two matrices in aten's
    packed 4-bit form plus their bf16 scales (:mod:`.quant`); ``dtype`` is then bf16, the kernel's activation dtype.
    ``hidden``/``intermediate`` are the stored widths; ``model_hidden`` (0: ``hidden``) is the model's, when the
    stored experts are wider than the model's (the paper-scale store, :mod:`.paper_scale`): inputs are
    zero-padded to ``hidden`` and outputs cut back to ``model_hidden``.
    """

    hidden: int
    intermediate: int
    dtype: torch.dtype
    alignment: int = ALIGNMENT
    quant: str = "none"
    group_size: int = 0
    model_hidden: int = 0

    def __post_init__(self) -> None:
        if min(self.hidden, self.intermediate, self.alignment) < 1 or self.model_hidden < 0 or self.group_size < 0:
            raise StoreError(f"record layout: widths ({self.hidden}, {self.intermediate}), alignment "
                             f"{self.alignment} and group size {self.group_size} must be positive")
        if self.quant not in ("none", "int4"):
            raise StoreError(f"unknown expert quantization {self.quant!r} (none or int4)")
        if self.quant == "int4" and (self.group_size <= 0 or self.hidden % self.group_size
                                     or self.intermediate % self.group_size):
            raise StoreError(f"int4 experts need widths ({self.hidden}, {self.intermediate}) that are multiples of "
                             f"the group size {self.group_size}")
        if self.model_hidden > self.hidden:
            raise StoreError(f"stored hidden width {self.hidden} < the model's {self.model_hidden}")

    @property
    def padded(self) -> bool:
        return bool(self.model_hidden) and self.model_hidden != self.hidden

    @cached_property
    def parts(self) -> tuple[Part, ...]:
        h, i = self.hidden, self.intermediate
        if self.quant == "none":
            shapes = [("gate_up", (2 * i, h), self.dtype), ("down", (h, i), self.dtype)]
        else:
            from specprefetch.runtime.core.quant import scales_shape

            g = self.group_size
            shapes = [("gate_up", (2 * i, h // 2), torch.uint8), ("gate_up_scales", scales_shape(2 * i, h, g),
                                                                  torch.bfloat16),
                      ("down", (h, i // 2), torch.uint8), ("down_scales", scales_shape(h, i, g), torch.bfloat16)]
        out, off = [], 0
        for name, shape, dt in shapes:
            n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            out.append(Part(name, off, n, tuple(shape), dt))
            off = _align(off + n, SUB_ALIGNMENT)
        return tuple(out)

    @cached_property
    def payload_bytes(self) -> int:
        """Bytes of weights (and scales) per expert: what a transfer must move."""
        return sum(p.nbytes for p in self.parts)

    @cached_property
    def record_bytes(self) -> int:
        last = self.parts[-1]
        return _align(last.offset + last.nbytes, self.alignment)

    @cached_property
    def flops_per_token(self) -> int:
        """Multiply-adds x 2 of one expert for one token (the stored, i.e. real, shapes)."""
        return 2 * 3 * self.hidden * self.intermediate

    def views(self, record: Tensor) -> tuple[Tensor, ...]:
        """The record's tensors (``parts`` order) as views into a uint8 record buffer (no copy)."""
        return tuple(record[p.offset: p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.parts)

    def pack(self, gate_up: Tensor, down: Tensor) -> bytes:
        """One record's bytes (zero padded) for an expert's two weight matrices ([2I, H] and [H, I], any float)."""
        if tuple(gate_up.shape) != (2 * self.intermediate, self.hidden) \
                or tuple(down.shape) != (self.hidden, self.intermediate):
            raise StoreError(f"expert weights {tuple(gate_up.shape)}, {tuple(down.shape)} do not fit the record "
                             f"layout ({2 * self.intermediate}, {self.hidden}) / ({self.hidden}, {self.intermediate})")
        buf = torch.zeros(self.record_bytes, dtype=torch.uint8)
        views = self.views(buf)
        if self.quant == "none":
            tensors: tuple[Tensor, ...] = (gate_up.detach().to("cpu", self.dtype), down.detach().to("cpu", self.dtype))
        else:
            from specprefetch.runtime.core import quant

            gq, gs = quant.quantize(gate_up.detach().cpu(), self.group_size)
            dq, ds = quant.quantize(down.detach().cpu(), self.group_size)
            tensors = (quant.pack(gq), gs, quant.pack(dq), ds)
        for v, t in zip(views, tensors, strict=True):
            v.copy_(t)
        return buf.numpy().tobytes()

    def mlp(self, weights: tuple[Tensor, ...], x: Tensor, act_fn: Any) -> Tensor:
        """One expert's SwiGLU MLP on rows ``x [n, model_hidden]`` (same op order as transformers' eager loop for
        an unpadded dense record, so the result is bit-identical to it)."""
        needs_cast = self.quant == "none" and x.dtype != self.dtype  # the int4 kernel casts to bf16 itself
        xi = F.pad(x.to(self.dtype), (0, self.hidden - x.shape[-1])) if self.padded or needs_cast else x
        if self.quant == "none":
            gu, dn = weights
            gate, up = F.linear(xi, gu).chunk(2, dim=-1)
            y = F.linear(act_fn(gate) * up, dn)
        else:
            from specprefetch.runtime.core import quant

            gu, gs, dn, ds = weights
            gate, up = quant.linear(xi, gu, gs, self.group_size).chunk(2, dim=-1)
            y = quant.linear(act_fn(gate) * up, dn, ds, self.group_size)
        if self.padded:
            y = y[..., : self.model_hidden]
        return y.to(x.dtype)

    def describe(self) -> dict[str, Any]:
        """The manifest's description of the layout (what :func:`layout_from_manifest` reads back)."""
        out: dict[str, Any] = {
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "dtype": str(self.dtype).removeprefix("torch."), "alignment": self.alignment,
            "record_bytes": self.record_bytes, "payload_bytes": self.payload_bytes, "quant": self.quant,
            "model_hidden_size": self.model_hidden or self.hidden,
            "parts": {p.name: {"offset": p.offset, "shape": list(p.shape), "bytes": p.nbytes,
                               "dtype": str(p.dtype).removeprefix("torch.")} for p in self.parts},
        }
        if self.quant == "int4":
            from specprefetch.runtime.core.quant import PACKING

            out.update(group_size=self.group_size, packing=PACKING, packed_by_torch=torch.__version__)
        return out


def layout_from_manifest(m: dict[str, Any], where: str) -> RecordLayout:
    """The record layout a manifest describes; an int4 store packed by another torch version is refused."""
    quant = str(m.get("quant", "none"))
    if quant == "int4":
        from specprefetch.runtime.core.quant import PACKING, check_int4_available

        check_int4_available()
        if m.get("packing") != PACKING or m.get("packed_by_torch") != torch.__version__:
            raise StoreError(f"{where}: int4 experts packed as {m.get('packing')!r} by torch "
                             f"{m.get('packed_by_torch')!r}; this is torch {torch.__version__} ({PACKING}): "
                             "rebuild the store (build-expert-store)")
    layout = RecordLayout(int(m["hidden_size"]), int(m["intermediate_size"]), _dtype_from_name(m["dtype"], where),
                          int(m["alignment"]), quant, int(m.get("group_size", 0)),
                          int(m.get("model_hidden_size", m["hidden_size"])))
    if m.get("parts") is not None and m["parts"] != layout.describe()["parts"]:
        raise StoreError(f"{where}: the record parts it lists do not match its shapes (corrupt manifest)")
    return layout


def _dtype_from_name(name: str, where: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise StoreError(f"{where}: unknown dtype {name!r}")
    return dt


# ------------------------------------------------------------------------------------------ writer
def build_expert_store(model: nn.Module, out_dir: str | os.PathLike, spec: Any | None = None,
                       dtype: torch.dtype | None = None, model_name: str = "",
                       config_fragment: Any = None, scale: Any = None) -> Path:
    """Write the routed experts of ``model`` into an expert store at ``out_dir`` (atomically) and return it.

    ``scale`` (a :class:`~specprefetch.runtime.core.paper_scale.ExpertScale`): every expert widened to the real model's
    shape and stored in its format (the paper-scale store); else the model's own experts in ``dtype``.
    Every file is fsync'ed so that a cold read (O_DIRECT, or the page cache evicted) really reaches the device.
    """
    blocks = find_moe_blocks(model, spec)
    if not blocks:
        raise StoreError("model has no MoE layers")
    n, h, i = check_fused_experts(blocks[0].experts, "MoE layer ordinal 0")
    if scale is not None:
        scale.check_fits(h, i, "MoE layer ordinal 0")
        layout = scale.layout(h)
        if layout.quant == "int4":
            from specprefetch.runtime.core.quant import check_int4_available

            check_int4_available()
    else:
        layout = RecordLayout(h, i, dtype or blocks[0].experts.gate_up_proj.dtype)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        layers_meta = []
        for b in tqdm(blocks, desc="expert store", unit="layer", disable=None):
            shape = check_fused_experts(b.experts, f"MoE layer {b.model_layer}")
            if shape != (n, h, i):
                raise StoreError(f"MoE layer {b.model_layer}: experts {shape} differ from layer 0's {(n, h, i)}")
            gu, dn = b.experts.gate_up_proj, b.experts.down_proj
            recs = (scale.records(gu, dn, layout, b.ordinal) if scale is not None
                    else [layout.pack(gu[e], dn[e]) for e in range(n)])
            layers_meta.append(_write_layer(tmp, b, recs))
        manifest = {
            "format": STORE_FORMAT,
            "model": model_name,
            "n_layers": len(blocks),
            "n_experts": n,
            **layout.describe(),
            "model_intermediate_size": i,
            "paper_scale": scale.describe() if scale is not None else None,
            "moe_layers": [b.model_layer for b in blocks],
            "layers": layers_meta,
            "provenance": provenance(config_fragment),
        }
        write_json_atomic(tmp / MANIFEST, manifest)
    log.info("expert store %s: %d layers x %d experts, %d B per record (%s)", out_dir, len(blocks), n,
             layout.record_bytes, "paper scale" if scale is not None else "the model's own experts")
    return out_dir


def _write_layer(out: Path, block: MoEBlock, records: list[bytes]) -> dict[str, Any]:
    name = f"layer-{block.ordinal:03d}.bin"
    file_hash = hashlib.sha256()
    digests = []
    with open(out / name, "wb") as f:
        for rec in records:
            f.write(rec)
            file_hash.update(rec)
            digests.append(hashlib.sha256(rec).hexdigest())
        f.flush()
        os.fsync(f.fileno())
    return {"file": name, "ordinal": block.ordinal, "model_layer": block.model_layer,
            "bytes": sum(len(r) for r in records), "sha256": file_hash.hexdigest(), "records": digests}


# ------------------------------------------------------------------------------------------ reader
class ExpertStore:
    """A verified expert store: its layout and the path/offset of every record."""

    def __init__(self, root: str | os.PathLike, verify: bool = True) -> None:
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            raise StoreError(f"{path}: missing; {self.root} is not a complete expert store")
        self.manifest: dict[str, Any] = read_doc(path, STORE_FORMAT, "expert-store manifest")
        m = self.manifest
        with reraise_as(StoreError):  # sizes and counts: positive integers (a float, NaN or text is one line)
            for key in ("n_layers", "n_experts", "record_bytes", "hidden_size", "intermediate_size", "alignment"):
                if key in m:
                    finite(m[key], str(path), key, integer=True, positive=True)
        try:
            self.layout = layout_from_manifest(m, str(path))
            self.n_layers = int(m["n_layers"])
            self.n_experts = int(m["n_experts"])
            record_bytes = int(m["record_bytes"])
            layers = m["layers"]
        except KeyError as exc:
            raise StoreError(f"{path}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise StoreError(f"{path}: a non-numeric size or count ({exc})") from None
        if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
            raise StoreError(f"{path}: layers must be a list of mappings")
        with reraise_as(StoreError):
            for i, layer in enumerate(layers):
                finite(require(layer, "bytes", int, f"{path} layer {i}"), f"{path} layer {i}", "bytes",
                       integer=True, positive=True)
        if self.layout.record_bytes != record_bytes or len(layers) != self.n_layers:
            raise StoreError(f"{path}: record_bytes/layers inconsistent with the shapes it declares")
        self.files = [member(self.root, layer.get("file"), f"expert-store manifest {MANIFEST}") for layer in layers]
        self.record_sha = [list(require(layer, "records", list, f"{path} layer {i}")) for i, layer in enumerate(layers)]
        if any(len(r) != self.n_experts for r in self.record_sha):
            raise StoreError(f"{path}: every layer must list one sha256 per expert ({self.n_experts})")
        for f, layer in zip(self.files, layers):
            why = path_problem(f)  # before any open: a FIFO or device would block or never end
            if why is not None:
                raise StoreError(f"{f}: {'missing' if why == 'not found' else why} (listed in {path})")
            size = f.stat().st_size
            if size != int(layer["bytes"]) or size != self.layout.record_bytes * self.n_experts:
                raise StoreError(f"{f}: {size} bytes, manifest says {layer['bytes']} (truncated or wrong file)")
        self.record_bytes = self.layout.record_bytes
        self.scale_doc: dict[str, Any] | None = m.get("paper_scale")  # paper_scale.scale_of reads it
        if self.scale_doc is not None and not isinstance(self.scale_doc, dict):
            raise StoreError(f"{path}: paper_scale must be a mapping")
        self.total_experts = self.n_layers * self.n_experts
        if verify:
            self.verify()

    def offset(self, expert: int) -> int:
        return expert * self.record_bytes

    def verify(self) -> None:
        """Check every record against its sha256 (names the file and expert of the first mismatch)."""
        for layer, f in enumerate(self.files):
            with open(f, "rb") as fh:
                for e in range(self.n_experts):
                    rec = fh.read(self.layout.record_bytes)
                    if hashlib.sha256(rec).hexdigest() != self.record_sha[layer][e]:
                        raise StoreError(f"{f}: record of expert {e} does not match its sha256 (corrupt store)")

    def check_record(self, layer: int, expert: int, data: bytes | memoryview) -> None:
        if hashlib.sha256(data).hexdigest() != self.record_sha[layer][expert]:
            raise StoreError(f"{self.files[layer]}: record of expert {expert} read back corrupt")

    def check_model(self, blocks: list[MoEBlock]) -> None:
        """The store must belong to this model: same layer count and shapes (raises naming the mismatch)."""
        if len(blocks) != self.n_layers:
            raise StoreError(f"{self.root}: {self.n_layers} MoE layers, the model has {len(blocks)}")
        if _served(blocks[0].experts):
            return  # already offloaded or computed from a store (its shapes were checked when it was installed)
        n, h, i = check_fused_experts(blocks[0].experts, "MoE layer ordinal 0")
        mine = (self.n_experts, self.layout.model_hidden or self.layout.hidden,
                int(self.manifest.get("model_intermediate_size", self.layout.intermediate)))
        if (n, h, i) != mine:
            raise StoreError(f"{self.root}: built from experts {mine}, the model's are ({n}, {h}, {i})")

    def layer_records(self, layer: int) -> Tensor:
        """Every record of ``layer`` as one ``uint8 [n_experts, record_bytes]`` tensor (a resident copy)."""
        with open(self.files[layer], "rb") as fh:
            data = bytearray(fh.read())
        return torch.frombuffer(data, dtype=torch.uint8).view(self.n_experts, self.record_bytes)

    def read_all(self, layer: int) -> Iterator[tuple[int, bytes]]:
        with open(self.files[layer], "rb") as fh:
            for e in range(self.n_experts):
                yield e, fh.read(self.layout.record_bytes)
