"""Batches of whole samples for predictor training and evaluation, from stored traces or a live model.

Every batch follows the trace contract's batch layout (``x``/``logits``/``topk`` lists over MoE layer
ordinals plus ``token_ids``, ``sample_index``, ``position``, ``is_image``, ``is_prompt``) and holds whole
samples, contiguous and in order: the draft model and Naive Prefetch look at a sample's earlier tokens,
so a token-shuffled batch (``TraceReader.iter_batches(shuffle=True)``) would be wrong for them.

- ``iter_trace_batches``: in order, for evaluation and statistics;
- ``TraceChunks``: a shuffled stream for training (a window of shards at a time, bounded memory);
- ``OnlineChunks``: the frozen model runs in the loop (paper setting: no trace stored); items are
  lightweight plans that ``materialize`` turns into a batch, so with several processes each one only
  runs the forwards of the items it keeps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor
from torch.utils.data import IterableDataset

from specprefetch.io import SpecPrefetchError
from specprefetch.predictors.base import PredictorError
from specprefetch.traces.store import PRE_KEY, layer_keys

log = logging.getLogger(__name__)
TOKEN_KEYS = ("token_ids", "sample_index", "position", "is_image", "is_prompt")


# --------------------------------------------------------------------------------------------- batch utilities


def shard_to_batch(shard: Mapping[str, Tensor], n_layers: int) -> dict[str, Any]:
    """A shard's flat tensors (``x.0`` ...) -> the batch layout (``x: [x.0, ...]``; ``pre`` too where the trace
    stores the pre-attention inputs)."""
    try:
        batch: dict[str, Any] = {k: [shard[f"{k}.{i}"] for i in range(n_layers)]
                                 for k in layer_keys(f"{PRE_KEY}.0" in shard)}
        batch.update({k: shard[k] for k in TOKEN_KEYS})
    except KeyError as exc:
        raise PredictorError(f"trace shard lacks tensor {exc.args[0]!r}") from None
    return batch


def slice_batch(batch: Mapping[str, Any], start: int, end: int) -> dict[str, Any]:
    return {k: ([t[start:end] for t in v] if isinstance(v, list) else v[start:end]) for k, v in batch.items()}


def concat_batches(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    first = batches[0]
    out: dict[str, Any] = {}
    for k, v in first.items():
        if isinstance(v, list):
            out[k] = [torch.cat([b[k][i] for b in batches]) for i in range(len(v))]
        else:
            out[k] = torch.cat([b[k] for b in batches])
    return out


def batch_to(batch: Mapping[str, Any], device: torch.device | str) -> dict[str, Any]:
    return {k: ([t.to(device) for t in v] if isinstance(v, list) else v.to(device)) for k, v in batch.items()}


def chunk_spans(sample_index: Tensor, batch_tokens: int) -> list[tuple[int, int]]:
    """Pack consecutive whole samples into [start, end) spans of at most ``batch_tokens`` tokens
    (a sample longer than that gets a span of its own)."""
    if batch_tokens < 1:
        raise SpecPrefetchError(f"invalid batch_tokens {batch_tokens}: must be >= 1")
    _, counts = torch.unique_consecutive(sample_index, return_counts=True)
    spans: list[tuple[int, int]] = []
    start = end = 0
    for c in counts.tolist():
        if end > start and end - start + c > batch_tokens:
            spans.append((start, end))
            start = end
        end += c
    if end > start:
        spans.append((start, end))
    return spans


def iter_trace_batches(reader: Any, batch_tokens: int) -> Iterator[dict[str, Any]]:
    """Whole-sample batches of a trace in stored order (shards are verified by the reader)."""
    for shard in reader.iter_shards():
        batch = shard_to_batch(shard, reader.n_layers)
        for s, e in chunk_spans(batch["sample_index"], batch_tokens):
            yield slice_batch(batch, s, e)


# --------------------------------------------------------------------------------------------- traces


def _load_shard(reader: Any, j: int) -> dict[str, Tensor]:
    """Shard ``j`` of a trace, checked (size, sha256, shapes); training reads shards in a shuffled order."""
    return reader.read_shard(j)


def _shard_plan(reader: Any, batch_tokens: int) -> tuple[list[list[tuple[int, int]]], int]:
    """Per shard, its whole-sample chunk spans; and the largest token id (read lazily, no hashing:
    only the plan comes from here, the data itself is verified when the shard is loaded)."""
    plan: list[list[tuple[int, int]]] = []
    max_id = -1
    for entry in reader.manifest["shards"]:
        path = reader.path_of(entry)
        try:
            with safe_open(str(path), framework="pt") as st:
                sidx = st.get_tensor("sample_index")
                ids = st.get_tensor("token_ids")
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types
            raise PredictorError(f"{path}: unreadable trace shard ({exc})") from None
        if sidx.numel() != int(entry["n_tokens"]):
            raise PredictorError(f"{path}: {sidx.numel()} tokens, manifest says {entry['n_tokens']}")
        plan.append(chunk_spans(sidx, batch_tokens))
        if ids.numel():
            max_id = max(max_id, int(ids.max()))
    return plan, max_id


class TraceChunks(IterableDataset):
    """Training stream over a trace: whole-sample chunks of <= ``batch_tokens`` tokens, shuffled.

    Per epoch (seed + epoch) the shard order is permuted and the chunks of ``window`` shards at a time
    are pooled and permuted: a stream shuffle whose memory is ``window`` shards. Same seed, same order.
    """

    def __init__(self, reader: Any, batch_tokens: int, seed: int = 0, shuffle: bool = True, window: int = 4) -> None:
        super().__init__()
        self.reader = reader
        self.batch_tokens = int(batch_tokens)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.window = max(1, int(window))
        self.epoch = 0
        self.plan, self.max_token_id = _shard_plan(reader, self.batch_tokens)
        self.n_chunks = sum(len(p) for p in self.plan)
        self.n_tokens = int(reader.n_tokens)
        if self.n_chunks == 0:
            raise PredictorError(f"trace {reader.dir} has no tokens to train on")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        n = len(self.plan)
        order = torch.randperm(n, generator=gen).tolist() if self.shuffle else list(range(n))
        for w in range(0, n, self.window):
            group = order[w:w + self.window]
            batches = {j: shard_to_batch(_load_shard(self.reader, j), self.reader.n_layers) for j in group}
            items = [(j, s, e) for j in group for s, e in self.plan[j]]
            perm = torch.randperm(len(items), generator=gen).tolist() if self.shuffle else range(len(items))
            for i in perm:
                j, s, e = items[i]
                yield slice_batch(batches[j], s, e)
            del batches


# --------------------------------------------------------------------------------------------- online


class OnlineChunks(IterableDataset):
    """Training stream that runs the frozen model on corpus samples and captures its routing.

    Each sample is routed exactly as trace extraction does it (``encode_sample``, the ``traces.mode``
    continuation, one forward under ``RouterCapture``, ``route_captured`` with the ``traces`` dtypes), so
    ``source: online`` trains on the same data ``source: traces`` would read from disk. The frozen model's
    parameters never get gradients (``requires_grad_(False)``, forwards under ``torch.inference_mode``);
    only the predictor is trained. Items are lists of sample ordinals; ``materialize`` (the DataLoader's
    collate function) runs the forwards, so with several processes each one only runs the forwards of the
    items it keeps. Per epoch (seed + epoch) the chunk order is permuted.
    """

    def __init__(self, bundle: Any, samples: Sequence[Any], root: Path, batch_tokens: int,
                 traces_cfg: Mapping[str, Any], seed: int = 0, shuffle: bool = True) -> None:
        super().__init__()
        from specprefetch.models import encode_sample
        from specprefetch.traces.store import INPUT_DTYPES, LOGITS_DTYPES, dtype_from_name

        self.bundle = bundle
        self.samples = list(samples)
        self.root = Path(root)
        self.batch_tokens = int(batch_tokens)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.mode = traces_cfg["mode"]
        self.pre_attention = bool(traces_cfg.get("pre_attention", False))
        self.max_new_tokens = int(traces_cfg["max_new_tokens"])
        self.input_dtype = dtype_from_name(traces_cfg["input_dtype"], INPUT_DTYPES,
                                           "traces.input_dtype")
        self.logits_dtype = dtype_from_name(traces_cfg["logits_dtype"], LOGITS_DTYPES,
                                            "traces.logits_dtype")
        self._encode = encode_sample
        for p in bundle.model.parameters():
            p.requires_grad_(False)
        bundle.model.eval()
        # Plan from the encoded lengths (generate mode adds at most max_new_tokens per sample).
        extra = self.max_new_tokens if self.mode == "generate" else 0
        lengths = [int(encode_sample(bundle, s, self.root).valid.sum()) + extra for s in self.samples]
        self.n_tokens = int(sum(lengths))
        self.chunks: list[list[int]] = []
        cur: list[int] = []
        cur_t = 0
        for i, t in enumerate(lengths):
            if t == 0:
                continue
            if cur and cur_t + t > self.batch_tokens:
                self.chunks.append(cur)
                cur, cur_t = [], 0
            cur.append(i)
            cur_t += t
        if cur:
            self.chunks.append(cur)
        self.n_chunks = len(self.chunks)
        if self.n_chunks == 0:
            raise PredictorError(f"online training: no valid tokens in the {len(self.samples)} corpus samples")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n_chunks, generator=gen).tolist() if self.shuffle else range(self.n_chunks)
        for i in order:
            yield self.chunks[i]

    def materialize(self, items: Sequence[list[int]]) -> dict[str, Any]:
        """Collate: run the frozen model on the item's samples and return their routing batch."""
        batches = [self.sample_batch(i) for item in items for i in item]
        return concat_batches([b for b in batches if b["token_ids"].numel()])

    def sample_batch(self, i: int) -> dict[str, Any]:
        """One sample's valid tokens in the trace layout (CPU tensors, trace dtypes)."""
        from specprefetch.traces.extract import traced_forward, with_continuation

        bundle = self.bundle
        with torch.inference_mode():
            enc = self._encode(bundle, self.samples[i], self.root).to(bundle.device)
            if self.mode == "generate":
                enc = with_continuation(bundle, enc, self.max_new_tokens)
            layers = traced_forward(bundle.model, bundle.routing, enc.kwargs, enc.valid, self.input_dtype,
                                    self.logits_dtype, pre_attention=self.pre_attention)
        valid = enc.valid.cpu()
        t = int(valid.sum())
        # inference tensors cannot be saved for backward: clone them into normal tensors
        return {
            **{k: [v.clone() for v in seq] for k, seq in layers.items()},
            "token_ids": enc.input_ids.cpu()[valid].clone(),
            "sample_index": torch.full((t,), i, dtype=torch.long),
            "position": torch.arange(valid.shape[0], dtype=torch.int32)[valid],
            "is_image": enc.is_image.cpu()[valid].to(torch.uint8),
            "is_prompt": enc.is_prompt.cpu()[valid].to(torch.uint8),
        }


def steps_for(n_chunks: int, epochs: float, world_size: int = 1) -> int:
    """Optimizer steps for ``epochs`` passes over ``n_chunks`` items split over ``world_size`` processes."""
    return max(1, math.ceil(n_chunks * float(epochs) / max(1, world_size)))
