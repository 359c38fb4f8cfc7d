"""How much a model's routing looks like a real MoE's, measured on its routing traces (the stand-in realism table).

FATE is training-free: its recall measures only how predictable a model's routing is from one MoE layer to the next,
so comparing a stand-in's FATE ExpertRecall@K with the paper's (Table 1) says how far the miniature is from the real
models before any learned predictor enters. Two model properties explain that number:

- ``input_cosine``: the cosine similarity of adjacent MoE layers' router inputs ``x^l``, ``x^{l+1}`` (FATE's premise:
  the residual stream changes little between layers, so ``W^{l+1} x^l`` approximates ``W^{l+1} x^{l+1}``), the mean
  over tokens and over the L-1 adjacent pairs;
- ``load_entropy``: the entropy of the executed expert load (each expert's share of the top-K slots) of a layer,
  normalised by ``log(n_experts)`` (1 = perfectly balanced, 0 = one expert takes every slot), averaged over layers.

Each is measured over all tokens and split by token type (the traces' ``is_image`` flag: image tokens vs the rest).
FATE's candidates are scored exactly like the FATE predictor scores them (``predictors.fate``: the next layer's gate
on this layer's router input, softmax or sigmoid + correction bias, top-M with ties to the lower id), so the ``all``
row's FATE recall equals Table 1's FATE cell at M = K. Everything is a sum over tokens, so the scatter shards of one
trace set are measured together and the result equals that of the gathered trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from specprefetch.contracts import REALISM_COLUMNS, REALISM_TOKEN_TYPES, check_csv
from specprefetch.io import SpecPrefetchError, atomic_path
from specprefetch.traces.store import MANIFEST, TraceReader

TOKEN_TYPES = REALISM_TOKEN_TYPES


@dataclass
class _Sums:
    """Per token type: token count, summed per-token FATE recall and adjacent cosine (each already averaged over the
    L-1 pairs), and the executed load per layer and expert."""

    n_layers: int
    n_experts: int
    n_tokens: int = 0
    fate_hits: float = 0.0
    cosine: float = 0.0
    load: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.load = torch.zeros(self.n_layers, self.n_experts, dtype=torch.float64)

    def add(self, other: _Sums) -> None:
        self.n_tokens += other.n_tokens
        self.fate_hits += other.fate_hits
        self.cosine += other.cosine
        self.load += other.load


def normalised_entropy(load: Tensor) -> float:
    """Mean over layers of H(p_l) / log(n) with p_l the layer's share of executed slots per expert ([L, n] counts)."""
    n = load.shape[-1]
    if n < 2:
        raise SpecPrefetchError(f"load entropy needs >= 2 experts, got {n}")
    p = load / load.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    h = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(dim=-1)
    return float((h / math.log(n)).mean())


def _top_m(scores: Tensor, m: int) -> Tensor:
    """Top-M expert ids, stable (ties to the lower id), the convention of ``metrics.select_candidates``."""
    return torch.sort(scores, dim=-1, descending=True, stable=True)[1][..., :m]


def _hit_share(topk: Tensor, cand: Tensor) -> Tensor:
    """[T] |executed ∩ candidates| / K (the per-token ExpertRecall)."""
    hit = (topk.long().unsqueeze(-1) == cand.unsqueeze(1)).any(dim=-1)
    return hit.sum(dim=-1).double() / topk.shape[1]


class RealismMeter:
    """Accumulates one model's trace set (one or more scatter shards of the same model and workload)."""

    def __init__(self, model: str, workload: str, reader: TraceReader) -> None:
        self.model, self.workload = model, workload
        self.n_layers, self.n_experts, self.top_k = reader.n_layers, reader.n_experts, reader.top_k
        self.hidden_size = reader.hidden_size
        self.scoring = str(reader.manifest["scoring"])
        if self.n_layers < 2:
            raise SpecPrefetchError(f"{reader.dir / MANIFEST}: {self.n_layers} MoE layer(s); realism compares "
                                    "adjacent layers and needs >= 2")
        self.sums = {t: _Sums(self.n_layers, self.n_experts) for t in ("text", "image")}
        self._gates: list[tuple[Tensor, Tensor | None, Tensor | None]] | None = None
        self._routers_of: Path | None = None

    def _check_same_set(self, reader: TraceReader) -> None:
        m = reader.manifest
        where = reader.dir / MANIFEST
        got = (m.get("model"), m.get("workload"), reader.n_layers, reader.n_experts, reader.top_k, reader.hidden_size,
               str(m.get("scoring")))
        want = (self.model, self.workload, self.n_layers, self.n_experts, self.top_k, self.hidden_size, self.scoring)
        if got != want:
            raise SpecPrefetchError(f"{where}: (model, workload, layers, experts, K, hidden, scoring) = {got}, but "
                                    f"another shard of this set has {want}")

    def _set_gates(self, reader: TraceReader) -> None:
        routers = reader.routers()
        gates = []
        for i in range(1, self.n_layers):
            w = routers[f"gate.{i}.weight"].float()
            b = routers.get(f"gate.{i}.bias")
            c = routers.get(f"gate.{i}.e_score_correction_bias")
            gates.append((w, None if b is None else b.float(), None if c is None else c.float()))
        if self._gates is not None and any(not torch.equal(a[0], g[0]) for a, g in zip(self._gates, gates)):
            raise SpecPrefetchError(f"{reader.dir / MANIFEST}: router weights differ from {self._routers_of} "
                                    "(shards of different checkpoints?)")
        self._gates, self._routers_of = gates, reader.dir

    def add_trace(self, reader: TraceReader) -> None:
        """Measure every token of ``reader`` (a verified trace, read shard by shard: memory stays at one shard)."""
        self._check_same_set(reader)
        self._set_gates(reader)
        for shard in reader.iter_shards():
            image = shard["is_image"].bool()
            for kind, mask in (("text", ~image), ("image", image)):
                if bool(mask.any()):
                    self.sums[kind].add(self._measure({k: v[mask] for k, v in shard.items()}))

    def _measure(self, t: dict[str, Tensor]) -> _Sums:
        assert self._gates is not None
        n = int(t["token_ids"].shape[0])
        out = _Sums(self.n_layers, self.n_experts, n_tokens=n)
        pairs = self.n_layers - 1
        hits = torch.zeros(n, dtype=torch.float64)
        cos = torch.zeros(n, dtype=torch.float64)
        for l in range(pairs):
            x, x_next = t[f"x.{l}"].float(), t[f"x.{l + 1}"].float()
            hits += self._fate_hits(t, x, l)
            cos += F.cosine_similarity(x, x_next, dim=-1, eps=1e-12).double()
        for l in range(self.n_layers):
            out.load[l] += torch.bincount(t[f"topk.{l}"].long().flatten(), minlength=self.n_experts).double()
        out.fate_hits = float(hits.sum()) / pairs
        out.cosine = float(cos.sum()) / pairs
        return out

    def _fate_hits(self, t: dict[str, Tensor], x: Tensor, layer: int) -> Tensor:
        """[T] FATE's per-token recall of layer ``layer + 1``'s experts from ``x`` = x^layer (scored as the FATE
        predictor scores: that layer's gate, softmax, or sigmoid + correction bias)."""
        assert self._gates is not None
        w, b, c = self._gates[layer]
        logits = F.linear(x, w, b)
        if self.scoring == "sigmoid":  # DeepSeek-V3 style: selection adds the correction bias
            scores = torch.sigmoid(logits) + (c if c is not None else 0.0)
        else:
            scores = F.softmax(logits, dim=-1)
        return _hit_share(t[f"topk.{layer + 1}"], _top_m(scores, self.top_k))

    def rows(self) -> list[dict[str, Any]]:
        """One row per token type with tokens (``all``, then ``text``/``image``): the REALISM_COLUMNS."""
        total = _Sums(self.n_layers, self.n_experts)
        for s in self.sums.values():
            total.add(s)
        out = []
        for kind, s in (("all", total), *self.sums.items()):
            if s.n_tokens == 0:
                continue
            out.append({"model": self.model, "workload": self.workload, "tokens": kind, "M": self.top_k,
                        "n_tokens": s.n_tokens, "fate_recall": s.fate_hits / s.n_tokens,
                        "input_cosine": s.cosine / s.n_tokens, "load_entropy": normalised_entropy(s.load)})
        if not out:
            raise SpecPrefetchError(f"realism: trace set {self.model}/{self.workload} has no tokens")
        return out


def measure_realism(trace_dirs: Iterable[str | Path], models: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Realism rows of every trace set among ``trace_dirs`` (scatter shards of one set are joined by their manifests'
    model and workload), in the order the sets first appear. ``models``: when given, a trace of another model is an
    error naming its manifest (a stale directory must not enter the table)."""
    meters: dict[tuple[str, str], RealismMeter] = {}
    for d in trace_dirs:
        reader = TraceReader(d, verify=True)
        key = (str(reader.manifest["model"]), str(reader.manifest["workload"]))
        if models is not None and key[0] not in models:
            raise SpecPrefetchError(f"{Path(d) / MANIFEST}: trace of model {key[0]!r}, not one of the config's "
                                    f"models ({', '.join(models)})")
        meter = meters.setdefault(key, RealismMeter(*key, reader))
        meter.add_trace(reader)
    if not meters:
        raise SpecPrefetchError("measure-realism: no trace directories given")
    return [row for m in meters.values() for row in m.rows()]


def write_realism(rows: Sequence[dict[str, Any]], out: str | Path) -> pd.DataFrame:
    """Write the rows as the realism CSV (contract ``realism``, atomically) and return them as a frame."""
    df = pd.DataFrame(list(rows), columns=REALISM_COLUMNS)
    with atomic_path(Path(out)) as tmp:
        df.to_csv(tmp, index=False, float_format="%.6f")
        read_realism(tmp)  # what the renderer accepts: a value out of range leaves no file behind
    return df


def read_realism(path: str | Path) -> pd.DataFrame:
    """The realism CSV, checked against its contract (columns, types, ranges; one line naming file, column, line)."""
    return check_csv(path, "realism")
