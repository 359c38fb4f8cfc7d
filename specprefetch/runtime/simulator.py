"""Trace-driven discrete-event simulator of the offloaded runtime (same cache, budget and queue logic).

It replays, step by step and layer by layer, the native routing of a token sequence and the predictor's
priorities through the *same* :class:`~specprefetch.runtime.cache.ExpertCache` and the *same* per-layer decisions
as :class:`~specprefetch.runtime.engine.OffloadedRuntime` (:mod:`~specprefetch.runtime.layer`: cancel/promote at
``t_exec``, pin, demand loads, selection and prefetch issue in priority order, accounting), in the runtime's order
of operations (demand loads first, prediction, prefetch, compute, release), with the same
:class:`~specprefetch.runtime.storage.BandwidthModel`, on a virtual clock: compute takes the profiled per-layer
durations, each transfer occupies one of ``io_workers`` servers for its modelled time. It produces the runtime's
own :class:`~specprefetch.runtime.timeline.LayerEvent` records, so counters and ReadyRecall come from the same
``summarize``.

Inputs: a list of :class:`SimSequence` (prefill step + decoding steps, each with the top-K rows of every MoE
layer and, for predicting policies, the priorities the layer's provider produced) from a recorded runtime run
(:func:`sequences_from_events`) or from a routing trace and a predictor (:func:`sequences_from_trace`);
a :class:`ComputeProfile` (profiled on this machine by ``profile_window`` or a platform's published figures).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specprefetch.contracts import POLICIES, POLICY
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.budget import layer_budget
from specprefetch.runtime.cache import ExpertCache, Key
from specprefetch.runtime.layer import acquire, begin_layer, issue_prefetches
from specprefetch.runtime.priority import PreviousTokenPriority
from specprefetch.runtime.storage import BandwidthModel, StorageProfile
from specprefetch.runtime.timeline import LayerEvent, RunStats, summarize

log = logging.getLogger(__name__)

DEMAND, PREFETCH = 0, 1


class SimulationError(SpecPrefetchError):
    """Simulator input is inconsistent (layer counts, missing priorities, impossible capacity)."""


@dataclass
class SimStep:
    topk: list[list[list[int]]]               # [layer][token] -> K experts
    scores: list[Tensor | None] = field(default_factory=list)  # [layer] priorities for layer+1
    weights: list[list[float]] | None = None  # [layer] last token's routing weights (Naive Prefetch ranking)

    @property
    def n_tokens(self) -> int:
        return len(self.topk[0])


@dataclass
class SimSequence:
    steps: list[SimStep]


@dataclass
class ComputeProfile:
    """Per-MoE-layer durations in seconds (decoding, one token)."""

    book_s: list[float]   # t_exec -> compute start without prediction (cache bookkeeping)
    pred_s: list[float]   # t_exec -> t_pred with the predictor running
    post_pred_s: list[float]  # t_pred -> compute start (candidate selection, issuing)
    moe_s: list[float]    # expert computation (all K experts resident)
    gap_s: list[float]    # t_done(l) -> t_exec(l+1): attention, router, shared experts, ...
    head_s: float         # t_done(L-1) -> t_exec(0) of the next step: head, sampling, embedding, dense layers
    io_overhead_s: float = 0.0  # per transfer (worker hand-off)
    cpu_per_prefetch_s: float = 0.0  # host CPU a worker-served transfer takes from the compute thread

    @classmethod
    def from_profile(cls, prof: dict[str, Any], compute_opt: bool, io_overhead_s: float = 0.0,
                     cpu_per_prefetch_s: float = 0.0) -> ComputeProfile:
        base = prof["compute"]["opt" if compute_opt else "loop"]
        return cls.of(base, prof["compute"]["pred"], io_overhead_s, cpu_per_prefetch_s)

    @classmethod
    def of(cls, base: dict[str, Any], pred: dict[str, Any] | None = None, io_overhead_s: float = 0.0,
           cpu_per_prefetch_s: float = 0.0) -> ComputeProfile:
        """From a ``window.compute_profile`` dict (``pred``: the one whose prediction durations to take)."""
        pred = pred or base
        return cls(list(base["book_s"]), list(pred["pred_s"]), list(pred["post_pred_s"]), list(base["moe_s"]),
                   list(base["gap_s"]), float(base["head_s"]), io_overhead_s, cpu_per_prefetch_s)

    def check(self, n_layers: int) -> None:
        for name in ("book_s", "pred_s", "post_pred_s", "moe_s", "gap_s"):
            if len(getattr(self, name)) != n_layers:
                raise SimulationError(f"compute profile {name} has {len(getattr(self, name))} layers, "
                                      f"the routing has {n_layers}")


@dataclass(eq=False)
class _Tr:
    key: Key
    kind: str
    step: int
    seq: int
    cls: int
    t_submit: float
    state: str = "pending"
    t_start: float = 0.0
    t_end: float = 0.0
    unneeded: bool = False
    charged: bool = True


class _SimIO:
    """I/O workers + prioritised queue on the virtual clock (mirrors runtime.transfer.TransferEngine).

    Workers serve prefetches only, sleep when none is queued, and are woken one per prefetch submission; demand
    loads (and promoted prefetches not yet started) are performed by the compute thread itself (``steal``) when the
    layer needs them, as the runtime does.
    """

    def __init__(self, cache: ExpertCache, storage: StorageProfile, n_workers: int, overhead_s: float,
                 fixed_s: float | None) -> None:
        self.cache = cache
        self.model = BandwidthModel(storage) if storage.emulated else None
        self.fixed_s = fixed_s
        self.overhead_s = overhead_s
        self.sleeping = list(range(max(1, n_workers)))
        self.pending: list[_Tr] = []
        self.running: list[tuple[float, int, _Tr, int]] = []
        self.active: dict[Key, _Tr] = {}
        self.log: list[_Tr] = []
        self.now = 0.0
        self._seq = itertools.count()
        self.charge_delays = True  # cleared during prefill steps, as the runtime does

    def _end_of(self, start: float, charged: bool = True, demand: bool = False) -> float:
        if self.model is not None:
            return (self.model.schedule(start, demand=demand) if charged else start) + self.overhead_s
        return start + (self.fixed_s or 0.0) + self.overhead_s

    def _demand_outstanding(self) -> bool:
        return any(tr.cls == DEMAND for tr in self.active.values())

    def _wake(self, t: float) -> None:
        """Workers idle while a demand load was outstanding take the queued prefetches."""
        if self._demand_outstanding():
            return
        while self.sleeping and any(p.cls == PREFETCH and p.t_submit <= t for p in self.pending):
            self._start(self.sleeping.pop(0), t)

    def _start(self, worker: int, t: float) -> None:
        ready = [] if self._demand_outstanding() else [p for p in self.pending
                                                       if p.t_submit <= t and p.cls == PREFETCH]
        if not ready:
            self.sleeping.append(worker)
            return
        tr = min(ready, key=lambda p: p.seq)
        self.pending.remove(tr)
        tr.state, tr.t_start = "running", t
        tr.t_end = self._end_of(t, tr.charged)
        heapq.heappush(self.running, (tr.t_end, tr.seq, tr, worker))

    def submit(self, key: Key, kind: str, step: int, t: float) -> _Tr:
        tr = _Tr(key, kind, step, next(self._seq), DEMAND if kind == "demand" else PREFETCH, t,
                 charged=self.charge_delays)
        self.pending.append(tr)
        self.active[key] = tr
        self.log.append(tr)
        if kind != "demand" and self.sleeping:
            self._start(self.sleeping.pop(0), t)
        return tr

    def _finish_next(self) -> float:
        t, _, tr, worker = heapq.heappop(self.running)
        tr.state = "done"
        del self.active[tr.key]
        self.cache.fill(tr.key)
        if tr.unneeded:
            self.cache.demote(tr.key)
        self.now = max(self.now, t)
        self._start(worker, t)
        if tr.cls == DEMAND:
            self._wake(t)
        return t

    def advance(self, until: float) -> None:
        """Process every completion at or before ``until``, in time order."""
        while self.running and self.running[0][0] <= until:
            self._finish_next()
        self.now = max(self.now, until)

    def steal(self, key: Key, t: float) -> float | None:
        """The compute thread performs ``key``'s queued transfer from ``t``; returns its end (None: not queued)."""
        tr = self.active.get(key)
        if tr is None or tr.state != "pending":
            return None
        self.pending.remove(tr)
        tr.state, tr.t_start = "running", t
        tr.t_end = self._end_of(t, tr.charged, demand=True)
        self.advance(tr.t_end)
        tr.state = "done"
        del self.active[tr.key]
        self.cache.fill(tr.key)
        self._wake(tr.t_end)
        return tr.t_end

    def wait_for(self, key: Key, t: float) -> float:
        """Make ``key`` resident (waiting for its worker, or performing it); returns the time it is."""
        self.advance(t)
        while not self.cache.is_resident(key):
            end = self.steal(key, t)
            if end is not None:
                return end
            if key not in self.active:
                raise SimulationError(f"waiting for expert {key} that is neither resident nor in flight")
            t = max(t, self._finish_next())
        return t

    def wait_any(self, t: float) -> float:
        """Progress: the next running transfer finishes, or the compute thread performs the best queued one."""
        self.advance(t)
        if self.running:
            return max(t, self._finish_next())
        if self.pending:
            tr = min(self.pending, key=lambda p: (p.cls, p.seq))
            return self.steal(tr.key, t) or t
        return t

    def drain(self, t: float) -> float:
        while self.active:
            t = self.wait_any(t)
        return t

    def inflight(self, key: Key) -> _Tr | None:
        return self.active.get(key)

    def promote(self, key: Key) -> None:
        tr = self.active.get(key)
        if tr is not None:
            tr.cls = DEMAND

    def cancel_pending(self, layer: int, keep: set[int]) -> list[_Tr]:
        out = []
        for tr in list(self.pending):
            if tr.key[0] == layer and tr.cls == PREFETCH and tr.key[1] not in keep:
                self.pending.remove(tr)
                tr.state = "cancelled"
                del self.active[tr.key]
                self.cache.cancel(tr.key)
                out.append(tr)
        return out


@dataclass
class SimResult:
    stats: RunStats
    tokens_per_s: float
    events: list[LayerEvent]
    n_tokens: int
    decode_s: float


def simulate(sequences: Sequence[SimSequence], policy: str, m_max: int, capacity: int, n_experts: int,
             top_k: int, compute: ComputeProfile, storage: StorageProfile, io_workers: int = 4,
             compute_opt: bool = True, sync: bool = False, fixed_transfer_s: float | None = None,
             preload: bool = False, layer_m_max: Sequence[int] = ()) -> SimResult:
    """Replay ``sequences`` under ``policy`` (see the module docstring); returns counters and throughput.
    ``layer_m_max``: per-layer budgets (index: the layer prefetched into), as the runtime's option."""
    if policy not in POLICIES:
        raise SimulationError(f"unknown policy {policy!r}")
    if not sequences or not sequences[0].steps:
        raise SimulationError("nothing to simulate: no sequences")
    n_layers = len(sequences[0].steps[0].topk)
    compute.check(n_layers)
    preload = preload or policy == "resident"
    cap = n_layers * n_experts if preload else min(capacity, n_layers * n_experts)
    if cap < top_k:
        raise SimulationError(f"cache capacity {cap} < top_k {top_k}")
    cache = ExpertCache(cap)
    if preload:
        cache.preload((l, e) for l in range(n_layers) for e in range(n_experts))
    io = _SimIO(cache, storage, io_workers, compute.io_overhead_s, fixed_transfer_s)
    pol = POLICY[policy]
    predicting = pol.predicts
    naive = PreviousTokenPriority(n_layers, n_experts) if pol.predicts and pol.provider is None else None
    events: list[LayerEvent] = []
    issued: dict[tuple[int, int], list[_Tr]] = defaultdict(list)
    t = 0.0
    step = -1
    n_tok, dec_s = 0, 0.0
    for seq in sequences:
        if naive is not None:
            naive.reset()
        ends = []
        for st in seq.steps:
            step += 1
            for l in range(n_layers):
                budget = layer_budget(m_max, layer_m_max, l + 1)
                t = _layer(l, st, step, t, io, cache, events, issued, policy, predicting, naive, budget,
                           n_experts, n_layers, compute, compute_opt, sync)
                t += compute.gap_s[l] if l + 1 < n_layers else compute.head_s
            ends.append(t)
        if len(ends) > 1:
            n_tok += len(ends) - 1
            dec_s += ends[-1] - ends[0]
    stats = summarize(events, top_k)
    stats.peak_cache_experts = cache.peak_used
    return SimResult(stats, n_tok / dec_s if dec_s > 0 else float("nan"), events, n_tok, dec_s)


def _layer(l: int, st: SimStep, step: int, t: float, io: _SimIO, cache: ExpertCache, events: list[LayerEvent],
           issued: dict[tuple[int, int], list[_Tr]], policy: str, predicting: bool,
           naive: PreviousTokenPriority | None, m_max: int, n_experts: int, n_layers: int,
           compute: ComputeProfile, compute_opt: bool, sync: bool) -> float:
    rows = st.topk[l]
    required = sorted({e for r in rows for e in r if 0 <= e < n_experts})
    keys = [(l, e) for e in required]
    io.advance(t)
    io.charge_delays = len(rows) == 1
    t_exec = t
    ev = begin_layer(cache, io, issued, step, l, t_exec, rows, required)
    events.append(ev)
    protect = set(keys)
    j = acquire(cache, io, keys, 0, protect, step, t)
    # prediction and prefetch
    if predicting and l + 1 < n_layers and len(rows) == 1:  # decoding steps only, as the runtime
        t += compute.pred_s[l]
        ev.t_pred = t
        s = st.scores[l] if l < len(st.scores) else None
        if s is None and naive is not None:
            s = naive.scores(l, None)
        if s is None and naive is None:
            raise SimulationError(f"policy {policy!r}: step {step} layer {l} has no recorded priorities")
        if s is not None:
            io.advance(t)
            issue_prefetches(cache, io, issued, ev, step, l, s, m_max, naive is not None, POLICY[policy].issues,
                             protect, t)
        t += compute.post_pred_s[l] + compute.cpu_per_prefetch_s * len(ev.issued)
    else:
        t += compute.book_s[l]
    # compute
    per_expert = compute.moe_s[l] / max(1, len(keys)) if not (compute_opt and len(rows) == 1) else 0.0
    stall = 0.0
    ev.t_compute = ev.t_ready = t
    if compute_opt and len(rows) == 1:
        t0 = t
        while j < len(keys):
            t = io.wait_any(t)
            j = acquire(cache, io, keys, j, protect, step, t)
        for k in keys:
            t = io.wait_for(k, t)
        stall = t - t0
        ev.t_ready = t
        for k in keys:
            cache.unpin(k)
        t += compute.moe_s[l]
    else:
        for i, k in enumerate(keys):
            t0 = t
            waited = j <= i or not cache.is_resident(k)
            while j <= i:
                t = io.wait_any(t)
                j = acquire(cache, io, keys, j, protect, step, t)
            t = io.wait_for(k, t)
            if waited:
                ev.t_ready = t
            stall += t - t0
            t += per_expert
            cache.unpin(k)
            protect.discard(k)
            io.advance(t)
            j = acquire(cache, io, keys, j, protect, step, t)
    ev.stall_s = stall
    if sync:
        t = io.drain(t)
    for k in keys:
        cache.touch(k)
    if naive is not None:
        w = (st.weights[l] if st.weights is not None else [1.0] * len(rows[-1]))
        naive.observe(l, torch.tensor([rows[-1]]), torch.tensor([w], dtype=torch.float32))
    ev.t_done = t
    io.advance(t)
    return t


# ------------------------------------------------------------------------------------------ inputs
def sequences_from_events(events: Sequence[LayerEvent], n_layers: int) -> list[SimSequence]:
    """Recorded runtime events (``record_routing``) -> sequences; a multi-token step starts a new sequence."""
    steps: dict[int, dict[int, LayerEvent]] = defaultdict(dict)
    for ev in events:
        if ev.topk is None:
            raise SimulationError("events were not recorded with record_routing=True")
        steps[ev.step][ev.layer] = ev
    seqs: list[SimSequence] = []
    for s in sorted(steps):
        layers = steps[s]
        if len(layers) != n_layers:
            raise SimulationError(f"step {s} has {len(layers)} layer events, expected {n_layers}")
        st = SimStep(topk=[layers[l].topk.tolist() for l in range(n_layers)],
                     scores=[layers[l].scores for l in range(n_layers)])
        if st.n_tokens > 1 or not seqs:
            seqs.append(SimSequence([]))
        seqs[-1].steps.append(st)
    return seqs


def sequences_from_trace(reader: Any, provider: Any | None, max_samples: int | None = None,
                         prefill_prompt: bool = True) -> list[SimSequence]:
    """A routing trace (``TraceReader``) -> sequences: each sample's prompt tokens are one prefill step, each
    later token one decoding step. ``provider`` (a PriorityProvider or None) gives the priorities from the
    stored router inputs; the routing weights for Naive Prefetch come from the stored logits."""
    seqs: list[SimSequence] = []
    n_layers = reader.n_layers
    for shard in reader.iter_shards():
        sidx = shard["sample_index"]
        is_prompt = shard["is_prompt"].bool()
        bounds = torch.nonzero(torch.diff(sidx, prepend=sidx[:1] - 1)).flatten().tolist() + [len(sidx)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            if max_samples is not None and len(seqs) >= max_samples:
                return seqs
            topk = [shard[f"topk.{l}"][a:b].long() for l in range(n_layers)]
            logits = [shard[f"logits.{l}"][a:b].float() for l in range(n_layers)]
            xs = [shard[f"x.{l}"][a:b].float() for l in range(n_layers)]
            n_prompt = int(is_prompt[a:b].sum()) if prefill_prompt else 1
            n_prompt = max(1, min(n_prompt, b - a - 1)) if b - a > 1 else 1
            groups = [(0, n_prompt)] + [(i, i + 1) for i in range(n_prompt, b - a)]
            steps = []
            for ga, gb in groups:
                scores = []
                for l in range(n_layers):
                    if provider is not None and l + 1 < n_layers:
                        scores.append(provider.scores(l, xs[l][ga:gb]))
                    else:
                        scores.append(None)
                w = [torch.softmax(logits[l][gb - 1], -1)[topk[l][gb - 1]].tolist() for l in range(n_layers)]
                steps.append(SimStep(topk=[topk[l][ga:gb].tolist() for l in range(n_layers)], scores=scores,
                                     weights=w))
            seqs.append(SimSequence(steps))
    return seqs


def relative_error(sim: float, measured: float) -> float:
    if not (math.isfinite(sim) and math.isfinite(measured)) or measured == 0:
        return float("nan")
    return (sim - measured) / measured
