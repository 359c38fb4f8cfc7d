"""The expert store: routed experts on disk, one contiguous aligned record per expert, so one expert is one read.

Layout of a store directory (format ``specprefetch-expert-store/1``):

- ``layer-000.bin`` ... one file per MoE layer ordinal; expert ``e`` of that layer is the record at byte
  offset ``e * record_bytes``. A record holds ``gate_up_proj[e]`` (``[2I, H]``) at offset 0 and
  ``down_proj[e]`` (``[H, I]``) at ``down_offset``, both C-contiguous in the model's dtype, zero-padded so
  every record starts on an ``alignment`` boundary (4096: a page, and what O_DIRECT needs).
- ``manifest.json`` (written last): shapes, dtype, record layout, and per file its size and sha256 plus the
  sha256 of every record (a load can be verified without reading the whole file).

Only routed experts live here; attention, embeddings, dense layers and shared experts stay resident in the
model. Experts are found through the model's routers (:func:`find_moe_blocks`): the experts module is the
sibling of each gate, a transformers 5 fused-experts module (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from specprefetch.contracts import STORE_FORMAT, member, read_doc, require
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
        if not getattr(experts, "is_offloaded", False):
            check_fused_experts(experts, f"MoE layer {layer} ({type(experts).__name__})")
        blocks.append(MoEBlock(i, int(layer), block, gate, experts))
    return blocks


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
class RecordLayout:
    """Byte layout of one expert record (identical for every expert of a store)."""

    hidden: int
    intermediate: int
    dtype: torch.dtype
    alignment: int = ALIGNMENT

    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @cached_property
    def gate_up_bytes(self) -> int:
        return 2 * self.intermediate * self.hidden * self.itemsize

    @cached_property
    def down_offset(self) -> int:
        return _align(self.gate_up_bytes, SUB_ALIGNMENT)

    @cached_property
    def down_bytes(self) -> int:
        return self.hidden * self.intermediate * self.itemsize

    @cached_property
    def payload_bytes(self) -> int:
        """Bytes of weights per expert (what a transfer must move)."""
        return self.gate_up_bytes + self.down_bytes

    @cached_property
    def record_bytes(self) -> int:
        return _align(self.down_offset + self.down_bytes, self.alignment)

    def views(self, record: Tensor) -> tuple[Tensor, Tensor]:
        """(gate_up [2I, H], down [H, I]) views into a uint8 record buffer (no copy)."""
        gu = record[: self.gate_up_bytes].view(self.dtype).view(2 * self.intermediate, self.hidden)
        dn = record[self.down_offset: self.down_offset + self.down_bytes].view(self.dtype)
        return gu, dn.view(self.hidden, self.intermediate)

    def pack(self, gate_up: Tensor, down: Tensor) -> bytes:
        """One record's bytes (zero padded) for an expert's two weight matrices."""
        buf = torch.zeros(self.record_bytes, dtype=torch.uint8)
        gu, dn = self.views(buf)
        gu.copy_(gate_up.detach().to("cpu", self.dtype))
        dn.copy_(down.detach().to("cpu", self.dtype))
        return buf.numpy().tobytes()


def _dtype_from_name(name: str, where: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise StoreError(f"{where}: unknown dtype {name!r}")
    return dt


# ------------------------------------------------------------------------------------------ writer
def build_expert_store(model: nn.Module, out_dir: str | os.PathLike, spec: Any | None = None,
                       dtype: torch.dtype | None = None, model_name: str = "",
                       config_fragment: Any = None) -> Path:
    """Write the routed experts of ``model`` into an expert store at ``out_dir`` (atomically) and return it.

    Every file is fsync'ed so that evicting its pages from the page cache (posix_fadvise DONTNEED, the cold
    storage profile) really forces the next read to go to the device.
    """
    blocks = find_moe_blocks(model, spec)
    if not blocks:
        raise StoreError("model has no MoE layers")
    n, h, i = check_fused_experts(blocks[0].experts, "MoE layer ordinal 0")
    dtype = dtype or blocks[0].experts.gate_up_proj.dtype
    layout = RecordLayout(h, i, dtype)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        layers_meta = []
        for b in tqdm(blocks, desc="expert store", unit="layer", disable=None):
            shape = check_fused_experts(b.experts, f"MoE layer {b.model_layer}")
            if shape != (n, h, i):
                raise StoreError(f"MoE layer {b.model_layer}: experts {shape} differ from layer 0's {(n, h, i)}")
            layers_meta.append(_write_layer(tmp, b, layout))
        manifest = {
            "format": STORE_FORMAT,
            "model": model_name,
            "n_layers": len(blocks),
            "n_experts": n,
            "hidden_size": h,
            "intermediate_size": i,
            "dtype": str(dtype).removeprefix("torch."),
            "alignment": layout.alignment,
            "record_bytes": layout.record_bytes,
            "payload_bytes": layout.payload_bytes,
            "gate_up": {"offset": 0, "shape": [2 * i, h], "bytes": layout.gate_up_bytes},
            "down": {"offset": layout.down_offset, "shape": [h, i], "bytes": layout.down_bytes},
            "moe_layers": [b.model_layer for b in blocks],
            "layers": layers_meta,
            "provenance": provenance(config_fragment),
        }
        write_json_atomic(tmp / MANIFEST, manifest)
    log.info("expert store %s: %d layers x %d experts, %d B per record", out_dir, len(blocks), n,
             layout.record_bytes)
    return out_dir


def _write_layer(out: Path, block: MoEBlock, layout: RecordLayout) -> dict[str, Any]:
    name = f"layer-{block.ordinal:03d}.bin"
    gu, dn = block.experts.gate_up_proj, block.experts.down_proj
    file_hash = hashlib.sha256()
    records = []
    with open(out / name, "wb") as f:
        for e in range(gu.shape[0]):
            rec = layout.pack(gu[e], dn[e])
            f.write(rec)
            file_hash.update(rec)
            records.append(hashlib.sha256(rec).hexdigest())
        f.flush()
        os.fsync(f.fileno())
    return {"file": name, "ordinal": block.ordinal, "model_layer": block.model_layer,
            "bytes": layout.record_bytes * gu.shape[0], "sha256": file_hash.hexdigest(), "records": records}


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
        try:
            self.layout = RecordLayout(int(m["hidden_size"]), int(m["intermediate_size"]),
                                       _dtype_from_name(m["dtype"], str(path)), int(m["alignment"]))
            self.n_layers = int(m["n_layers"])
            self.n_experts = int(m["n_experts"])
            record_bytes = int(m["record_bytes"])
            layers = m["layers"]
        except KeyError as exc:
            raise StoreError(f"{path}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise StoreError(f"{path}: a non-numeric size or count ({exc})") from None
        if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
            raise StoreError(f"{path}: layers must be a list of mappings")
        if self.layout.record_bytes != record_bytes or len(layers) != self.n_layers:
            raise StoreError(f"{path}: record_bytes/layers inconsistent with the shapes it declares")
        self.files = [member(self.root, layer.get("file"), f"expert-store manifest {MANIFEST}") for layer in layers]
        self.record_sha = [list(require(layer, "records", list, f"{path} layer {i}")) for i, layer in enumerate(layers)]
        if any(len(r) != self.n_experts for r in self.record_sha):
            raise StoreError(f"{path}: every layer must list one sha256 per expert ({self.n_experts})")
        for f, layer in zip(self.files, layers):
            if not f.is_file():
                raise StoreError(f"{f}: missing (listed in {path})")
            size = f.stat().st_size
            if size != int(layer["bytes"]) or size != self.layout.record_bytes * self.n_experts:
                raise StoreError(f"{f}: {size} bytes, manifest says {layer['bytes']} (truncated or wrong file)")
        self.record_bytes = self.layout.record_bytes
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
        if getattr(blocks[0].experts, "is_offloaded", False):
            return  # already offloaded (its shapes were checked when it was installed)
        n, h, i = check_fused_experts(blocks[0].experts, "MoE layer ordinal 0")
        if (n, h, i) != (self.n_experts, self.layout.hidden, self.layout.intermediate):
            raise StoreError(f"{self.root}: experts ({self.n_experts}, {self.layout.hidden}, "
                             f"{self.layout.intermediate}) do not match the model's ({n}, {h}, {i})")

    def read_all(self, layer: int) -> Iterator[tuple[int, bytes]]:
        with open(self.files[layer], "rb") as fh:
            for e in range(self.n_experts):
                yield e, fh.read(self.layout.record_bytes)
