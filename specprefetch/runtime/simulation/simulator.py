"""Trace-driven discrete-event simulator of the offloaded runtime (same cache, budget and queue logic).

It replays, step by step and layer by layer, the native routing of a token sequence and the predictor's
priorities through the runtime's own per-layer loop (:class:`~specprefetch.runtime.core.layer.LayerLoop`: cancel/promote
at ``t_exec``, pin, demand loads, selection and prefetch issue in priority order, waits, release, accounting) and
the *same* :class:`~specprefetch.runtime.core.cache.ExpertCache`, with the same
:class:`~specprefetch.runtime.core.storage.BandwidthModel`, over a discrete-event I/O backend (``_SimIO``, an
:class:`~specprefetch.runtime.core.iobackend.IOBackend`): compute takes the profiled per-layer durations
(:class:`ComputeProfile`, charged by ``_SimWork``: the whole layer at once on the ``compute_opt`` path, an equal
share per expert on the eager loop), each transfer occupies one of ``io_workers`` servers for its modelled time.
It produces the runtime's own :class:`~specprefetch.runtime.core.timeline.LayerEvent` records, so counters and
ReadyRecall come from the same ``summarize``.

Inputs: a list of :class:`SimSequence` (prefill step + decoding steps, each with the top-K rows of every MoE
layer and, for predicting policies, the priorities the layer's provider produced) from recorded routing -- a
benchmark's routing record or a runtime's events (:func:`sequences_from_record`) -- or from a routing trace and a
predictor (:func:`sequences_from_trace`); a :class:`ComputeProfile` (profiled on this machine by
``profile_window`` or a platform's published figures). Naive Prefetch's priorities, when not recorded, come from
the provider the runtime runs (:func:`~specprefetch.runtime.core.priority.builtin_provider`), fed the replayed routing.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specprefetch.contracts import POLICIES, POLICY
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.budget import EwmaBudget, layer_budget, online_budget
from specprefetch.runtime.core.cache import ExpertCache, Key
from specprefetch.runtime.core.layer import LayerLoop
from specprefetch.runtime.core.priority import PriorityProvider, builtin_provider
from specprefetch.runtime.core.storage import BandwidthModel, StorageProfile
from specprefetch.runtime.core.timeline import LayerEvent, RunStats, summarize
from specprefetch.runtime.core.transfer import DEMAND, PREFETCH, overtakes, queue_order, worker_ready

log = logging.getLogger(__name__)


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
    cpu_per_prefetch_s: float = 0.0  # host CPU a worker-served transfer takes from the compute thread (when it starts)
    cpu_per_issue_s: float = 0.0  # ... a layer that issues prefetches (its workers woken beside the compute)
    cpu_per_demand_s: float = 0.0  # ... a load the compute thread performs itself (a demand load)
    wake_s: float = 0.0  # the hand-off back to the compute thread after a worker finished a load it waited for
    start_s: float = 0.0  # the hand-off to a sleeping worker: its wake-up before it starts a load offered to it

    @classmethod
    def from_profile(cls, prof: dict[str, Any], compute_opt: bool, io_overhead_s: float = 0.0,
                     cpu_per_prefetch_s: float = 0.0, cpu_per_issue_s: float = 0.0,
                     cpu_per_demand_s: float = 0.0, wake_s: float = 0.0, start_s: float = 0.0) -> ComputeProfile:
        comp = prof.get("compute_lockstep") or prof["compute"]  # as the benchmark's lockstep blocks compute
        return cls.of(comp["opt" if compute_opt else "loop"], comp["pred"], io_overhead_s, cpu_per_prefetch_s,
                      cpu_per_issue_s, cpu_per_demand_s, wake_s, start_s)

    def issue_cpu_s(self, issued: Sequence[int]) -> float:
        """The host CPU a prediction step's issue of ``issued`` takes from the compute thread (the prefetches' own
        CPU is charged as workers serve them: a queued prefetch cancelled before it starts costs none)."""
        return self.cpu_per_issue_s if issued else 0.0

    @classmethod
    def of(cls, base: dict[str, Any], pred: dict[str, Any] | None = None, io_overhead_s: float = 0.0,
           cpu_per_prefetch_s: float = 0.0, cpu_per_issue_s: float = 0.0,
           cpu_per_demand_s: float = 0.0, wake_s: float = 0.0, start_s: float = 0.0) -> ComputeProfile:
        """From a ``window.compute_profile`` dict (``pred``: the one whose prediction durations to take)."""
        pred = pred or base
        return cls(list(base["book_s"]), list(pred["pred_s"]), list(pred["post_pred_s"]), list(base["moe_s"]),
                   list(base["gap_s"]), float(base["head_s"]), io_overhead_s, cpu_per_prefetch_s, cpu_per_issue_s,
                   cpu_per_demand_s, wake_s, start_s)

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

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled")


class _SimIO:
    """I/O workers + prioritised queue on the virtual clock: the simulator's
    :class:`~specprefetch.runtime.core.iobackend.IOBackend` (mirrors runtime.core.transfer.TransferEngine).

    ``clock`` is the compute thread's time: it moves when compute is charged (``account``), when the compute
    thread waits for a transfer, and when it performs one itself. Workers serve prefetches (under FIFO also a demand
    load queued behind them), sleep when none is queued, and are woken one per prefetch submission; demand loads at
    the head of the queue (and promoted prefetches not yet started; under FIFO once the loads issued before them
    have started, also while the compute thread waits) are performed by the compute thread itself (``steal`` +
    ``execute``) when the layer needs them, as the runtime does. The two thread hand-offs the runtime
    measures take time here too: a worker woken for a load starts it ``start_s`` later, and the compute thread runs
    ``wake_s`` after a load a worker finished while it waited.
    """

    def __init__(self, cache: ExpertCache, storage: StorageProfile, n_workers: int, overhead_s: float,
                 fixed_s: float | None, load_cpu_s: float = 0.0, worker_cpu_s: float = 0.0,
                 wake_s: float = 0.0, start_s: float = 0.0) -> None:
        self.cache = cache
        self.wake_s = wake_s  # a load a worker finished while the compute thread waited: its hand-off back
        self.start_s = start_s  # a load offered to a sleeping worker: that worker's wake-up before the read starts
        self.load_cpu_s = load_cpu_s  # the compute a load it performs itself costs the compute thread after it
        self.worker_cpu_s = worker_cpu_s  # ... and a load a worker serves, from when it starts
        self.owed_s = 0.0  # the workers' loads' CPU not yet charged to the compute thread
        self.model = BandwidthModel(storage) if storage.emulated else None
        self.fifo = not storage.demand_first  # device.io_order (runtime.core.transfer)
        self.fixed_s = fixed_s
        self.overhead_s = overhead_s
        self.sleeping = list(range(max(1, n_workers)))
        self.pending: list[_Tr] = []
        self.running: list[tuple[float, int, _Tr, int]] = []
        self.active: dict[Key, _Tr] = {}
        self.log: list[_Tr] = []
        self.clock = 0.0
        self._seq = itertools.count()
        self.charge_delays = True  # cleared during prefill steps, as the runtime does

    # -------------------------------------------------------------- the clock
    def now(self) -> float:
        return self.clock

    def account(self, seconds: float) -> None:
        """The compute thread spent ``seconds``, and the CPU the loads workers started since took from it: the clock
        moves (completions are settled by ``poll``)."""
        self.clock += seconds + self.owed_s
        self.owed_s = 0.0

    def poll(self) -> None:
        self.advance(self.clock)

    # -------------------------------------------------------------- the queue
    def _end_of(self, start: float, charged: bool = True, demand: bool = False) -> float:
        if self.model is not None:
            return (self.model.schedule(start, demand=demand) if charged else start) + self.overhead_s
        return start + (self.fixed_s or 0.0) + self.overhead_s

    def _demand_outstanding(self) -> bool:
        return any(tr.cls == DEMAND for tr in self.active.values())

    def _wake(self, t: float) -> None:
        """Workers idle while a demand load was outstanding take the queued prefetches."""
        if self._demand_outstanding() and not self.fifo:
            return
        while self.sleeping and worker_ready([p for p in self.pending if p.t_submit <= t], self.fifo,
                                             self._demand_outstanding()):
            self._start(self.sleeping.pop(0), t, woken=True)

    def _start(self, worker: int, t: float, woken: bool = False) -> None:
        """``worker`` takes the best ready transfer at ``t`` (``woken``: it was asleep, and starts ``start_s`` later),
        or sleeps."""
        ready = worker_ready([p for p in self.pending if p.t_submit <= t], self.fifo, self._demand_outstanding())
        if not ready:
            self.sleeping.append(worker)
            return
        tr = min(ready, key=lambda p: p.seq)
        self.pending.remove(tr)
        t += self.start_s if woken else 0.0
        tr.state, tr.t_start = "running", t
        tr.t_end = self._end_of(t, tr.charged, demand=tr.cls == DEMAND)
        if tr.charged:
            self.owed_s += self.worker_cpu_s
        heapq.heappush(self.running, (tr.t_end, tr.seq, tr, worker))

    def submit(self, key: Key, kind: str, step: int) -> _Tr:
        t = self.clock
        tr = _Tr(key, kind, step, next(self._seq), DEMAND if kind == "demand" else PREFETCH, t,
                 charged=self.charge_delays)
        self.pending.append(tr)
        self.active[key] = tr
        self.log.append(tr)
        if kind != "demand" and self.sleeping:
            self._start(self.sleeping.pop(0), t, woken=True)
        return tr

    def _finish_next(self) -> float:
        t, _, tr, worker = heapq.heappop(self.running)
        tr.state = "done"
        del self.active[tr.key]
        self.cache.fill(tr.key)
        if tr.unneeded:
            self.cache.demote(tr.key)
        self.clock = max(self.clock, t)
        self._start(worker, t)
        if tr.cls == DEMAND:
            self._wake(t)
        return t

    def advance(self, until: float) -> None:
        """Process every completion at or before ``until``, in time order."""
        while self.running and self.running[0][0] <= until:
            self._finish_next()
        self.clock = max(self.clock, until)

    def steal(self, key: Key) -> _Tr | None:
        """The compute thread claims ``key``'s queued transfer from now (None: not queued)."""
        tr = self.active.get(key)
        at = None if tr is None else self._claimable_at(tr)
        if at is None or at > self.clock:
            return None
        self.pending.remove(tr)
        tr.state, tr.t_start = "running", self.clock
        return tr

    def execute(self, tr: _Tr) -> None:
        """The compute thread performs the claimed ``tr``: the clock moves to its end."""
        tr.t_end = self._end_of(tr.t_start, tr.charged, demand=True)
        self.advance(tr.t_end)
        tr.state = "done"
        del self.active[tr.key]
        self.cache.fill(tr.key)
        self._wake(tr.t_end)
        self.clock = tr.t_end + (self.load_cpu_s if tr.charged else 0.0)

    def _claimable_at(self, tr: _Tr) -> float | None:
        """When the compute thread may claim the queued ``tr`` (``steal``): now, or under FIFO once every load
        issued before it has started (a worker woken for one starts it ``start_s`` after it was offered); None while
        one of them is still queued, or ``tr`` is not (``TransferEngine.claimable``)."""
        if tr.state != "pending" or (self.fifo and overtakes(tr, self.pending)):
            return None
        if not self.fifo:
            return self.clock
        return max([self.clock] + [r.t_start for _, _, r, _ in self.running if r.seq < tr.seq])

    def wait(self, tr: _Tr) -> None:
        """The compute thread waits for ``tr``: completions are settled in time order until it has finished, or,
        queued under FIFO, until the loads issued before it have started (then the caller claims it); it runs again
        ``wake_s`` after (the runtime's measured hand-off, ``TransferEngine.wait``)."""
        blocked = not tr.finished
        while not tr.finished:
            at = self._claimable_at(tr) if self.fifo else None
            if at is not None and (not self.running or at < self.running[0][0]):
                self.advance(at)
                self.clock += self.wake_s
                return
            if not self.running:
                raise SimulationError(f"waiting for the transfer of expert {tr.key}, which no worker serves")
            self._finish_next()
        if blocked and tr.state == "done":
            self.clock += self.wake_s

    def wait_any(self, timeout: float = 5.0) -> bool:
        """Progress: the next running transfer finishes, or the compute thread performs the best queued one
        (``timeout``: the engine's, moot on the virtual clock). False when nothing is queued or running."""
        self.advance(self.clock)
        if self.running:
            self._finish_next()
            return True
        if self.pending:
            tr = min(self.pending, key=lambda p: queue_order(p, self.fifo))
            if self.steal(tr.key) is tr:
                self.execute(tr)
            return True
        return False

    def drain(self) -> None:
        while self.wait_any():
            pass

    def inflight(self, key: Key) -> _Tr | None:
        return self.active.get(key)

    def promote(self, key: Key) -> None:
        tr = self.active.get(key)
        if tr is not None and not self.fifo:
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


class ReplayPriority(PriorityProvider):
    """A predicting policy's priorities in a replay: the step's recorded ones (what the runtime's provider
    produced), else those of ``live`` -- the provider the runtime runs, fed the replayed routing (Naive Prefetch's,
    :func:`~specprefetch.runtime.core.priority.builtin_provider`). ``empty_when_zero`` is the producing provider's."""

    def __init__(self, policy: str, live: PriorityProvider | None, empty_when_zero: bool,
                 lookahead: int = 1, stage: str = "router") -> None:
        self.policy = policy
        self.stage = stage  # where the runtime asked the producing provider (before attention: "pre_attention")
        self.live = live
        self.lookahead = int(lookahead)  # the recorded priorities of layer l are for layer l + lookahead
        self.name = live.name if live is not None else policy
        self.empty_when_zero = empty_when_zero
        self.step = -1
        self.current: SimStep | None = None

    def at(self, step: int, st: SimStep) -> None:
        """The step being replayed."""
        self.step, self.current = step, st

    def reset(self) -> None:
        if self.live is not None:
            self.live.reset()

    def scores(self, layer: int, x: Tensor | None) -> Any:
        st = self.current
        s = st.scores[layer] if st is not None and layer < len(st.scores) else None
        if s is None and self.live is not None:
            s = self.live.scores(layer, x)
        elif s is None:
            raise SimulationError(f"policy {self.policy!r}: step {self.step} layer {layer} has no recorded "
                                  "priorities")
        return s

    def observe(self, layer: int, top_k_index: Tensor, top_k_weights: Tensor) -> None:
        if self.live is not None:
            self.live.observe(layer, top_k_index, top_k_weights)


def replay_provider(policy: str, n_layers: int, n_experts: int, lookahead: int = 1) -> ReplayPriority | None:
    """The simulator's provider of ``policy`` (None: it does not predict) ``lookahead`` layers ahead: recorded
    priorities, else the runtime's built-in provider; ``empty_when_zero`` from the provider that produced them (the
    built-in one, or the trained predictor's class)."""
    pol = POLICY[policy]
    if not pol.predicts:
        return None
    live = builtin_provider(policy, n_layers, n_experts, lookahead)
    if live is not None:
        return ReplayPriority(policy, live, live.empty_when_zero, lookahead)
    from specprefetch.predictors.base import predictor_class

    cls = predictor_class(str(pol.provider))
    return ReplayPriority(policy, None, bool(cls.empty_when_zero), lookahead, cls.stage)


class _SimWork:
    """The simulator's compute (a :class:`~specprefetch.runtime.core.layer.LayerWork`): the profiled durations of
    :class:`ComputeProfile` charged to the virtual clock; the provider observes the replayed routing."""

    def __init__(self, io: _SimIO, compute: ComputeProfile, replay: ReplayPriority | None) -> None:
        self.io = io
        self.compute = compute
        self.replay = replay
        self.layer = 0
        self.st: SimStep | None = None
        self.per_expert = 0.0

    def at(self, layer: int, st: SimStep) -> _SimWork:
        self.layer, self.st = layer, st
        return self

    def scores(self, provider: PriorityProvider, layer: int) -> Any:
        self.io.account(self.compute.pred_s[layer])
        return provider.scores(layer, None)

    def prepared(self, ev: LayerEvent, predicted: bool, batched: bool) -> None:
        c, l = self.compute, self.layer
        if predicted:
            self.io.account(c.post_pred_s[l] + c.issue_cpu_s(ev.issued))
        else:
            self.io.account(c.book_s[l])
        self.per_expert = c.moe_s[l] / max(1, len(ev.required))

    def expert(self, key: Key, slot: int) -> None:
        self.io.account(self.per_expert)

    def batched(self, keys: list[Key], slots: list[int], release: Callable[[], None]) -> None:
        release()
        self.io.account(self.compute.moe_s[self.layer])

    def issued(self, ev: LayerEvent) -> None:
        """A pre-attention prediction's selection and issue, after its priorities (``scores``)."""
        self.io.account(self.compute.post_pred_s[ev.layer] + self.compute.issue_cpu_s(ev.issued))

    def finish(self, provider: PriorityProvider | None) -> None:
        if provider is None or self.replay is None or self.replay.live is None:
            return  # nothing observes the routing: skip building its tensors
        last = self.st.topk[self.layer][-1]  # the step's last token is the "previous" one next step
        w = self.st.weights[self.layer] if self.st.weights is not None else [1.0] * len(last)
        provider.observe(self.layer, torch.tensor([last]), torch.tensor([w], dtype=torch.float32))


def _transfer_lost(key: Key) -> SimulationError:
    return SimulationError(f"expert {key} is neither resident nor in flight (its transfer was lost)")


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
             preload: bool = False, layer_m_max: Sequence[int] = (), lookahead: int = 1,
             ewma: EwmaBudget | None = None) -> SimResult:
    """Replay ``sequences`` under ``policy`` (see the module docstring); returns counters and throughput.
    ``layer_m_max``: per-layer budgets (index: the layer prefetched into), ``lookahead`` (layer l prefetches into
    l + lookahead) and ``ewma`` (the online budget rule, seeded), as the runtime's options."""
    if policy not in POLICIES:
        raise SimulationError(f"unknown policy {policy!r}")
    if not sequences or not sequences[0].steps:
        raise SimulationError("nothing to simulate: no sequences")
    n_layers = len(sequences[0].steps[0].topk)
    compute.check(n_layers)
    pol = POLICY[policy]
    preload = preload or pol.preload
    cap = n_layers * n_experts if preload else min(capacity, n_layers * n_experts)
    if cap < top_k:
        raise SimulationError(f"cache capacity {cap} < top_k {top_k}")
    cache = ExpertCache(cap)
    if preload:
        cache.preload((l, e) for l in range(n_layers) for e in range(n_experts))
    io = _SimIO(cache, storage, io_workers, compute.io_overhead_s, fixed_transfer_s, compute.cpu_per_demand_s,
                compute.cpu_per_prefetch_s, compute.wake_s, compute.start_s)
    replay = replay_provider(policy, n_layers, n_experts, lookahead)
    loop = LayerLoop(cache, io, replay, pol.issues, n_layers, n_experts,
                     lambda layer: layer_budget(m_max, layer_m_max, layer),
                     compute_opt=compute_opt, sync=sync, load_error=_transfer_lost,
                     online=online_budget(policy, ewma))
    work = _SimWork(io, compute, replay)
    step = -1
    n_tok, dec_s = 0, 0.0
    for seq in sequences:
        if replay is not None:
            replay.reset()
        ends = []
        for st in seq.steps:
            step += 1
            if replay is not None:
                replay.at(step, st)
            for l in range(n_layers):
                loop.run(step, l, st.topk[l], work.at(l, st))
                if l + 1 < n_layers:  # a pre-attention provider predicts layer l+1 before its attention
                    loop.pre_attention(step, l + 1, work)
                io.account(compute.gap_s[l] if l + 1 < n_layers else compute.head_s)
            ends.append(io.now())
        if len(ends) > 1:
            n_tok += len(ends) - 1
            dec_s += ends[-1] - ends[0]
    stats = summarize(loop.events, top_k)
    stats.peak_cache_experts = cache.peak_used
    return SimResult(stats, n_tok / dec_s if dec_s > 0 else float("nan"), loop.events, n_tok, dec_s)


# ------------------------------------------------------------------------------------------ inputs
def sequences_from_record(rows: Sequence[Mapping[str, Any]], n_layers: int) -> list[SimSequence]:
    """Recorded routing -> sequences; a multi-token step starts a new sequence. ``rows``: one mapping per layer
    call with ``step``, ``layer``, ``topk`` ([tokens, K] expert ids) and ``scores`` (the priorities for ``layer+1``
    or None): a benchmark's routing record, or a runtime's events (``record_routing``) through
    :func:`~specprefetch.runtime.core.timeline.routing_rows`."""
    steps: dict[int, dict[int, Mapping[str, Any]]] = defaultdict(dict)
    for row in rows:
        if row.get("topk") is None:
            raise SimulationError("the routing was not recorded (record_routing=True): an event has no top-k")
        steps[int(row["step"])][int(row["layer"])] = row
    seqs: list[SimSequence] = []
    for s in sorted(steps):
        layers = steps[s]
        if len(layers) != n_layers:
            raise SimulationError(f"recorded step {s} has {len(layers)} layers, expected {n_layers}")
        st = SimStep(topk=[torch.as_tensor(layers[l]["topk"]).long().tolist() for l in range(n_layers)],
                     scores=[layers[l].get("scores") for l in range(n_layers)])
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
