"""Timeline instrumentation of the offloaded runtime and the metrics derived from it.

Per decoding step and MoE layer the runtime records a :class:`LayerEvent`: ``t_exec`` (the layer's routed
expert computation is due: the native router has decided), ``t_pred`` (the layer's prediction for the next layer
is available), ``t_compute`` (the compute phase starts), ``stall_s`` (time spent waiting for loads) and
``t_done``; the experts that were available at ``t_exec`` (hits), in flight, or absent; and the prefetches it
issued. Each transfer is recorded with its submit/start/end times.

ReadyRecall (paper §4.1) = mean over tokens (and target layers l+1 = 1..L-1) of |T ∩ A(t_exec)| / K, where A is
the set of experts resident in the cache when the layer's expert computation is due.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LayerEvent:
    step: int
    layer: int
    n_tokens: int
    t_exec: float
    required: list[int]
    hits: int                 # required experts resident at t_exec
    inflight: int             # required experts being transferred at t_exec
    misses: int               # required experts neither resident nor in flight (demand loads)
    ready_pairs: int          # sum over tokens of |T_t ∩ A(t_exec)|
    t_pred: float | None = None
    t_compute: float = 0.0    # the compute phase starts (after prediction and prefetch issue)
    t_ready: float = 0.0      # the last wait for a load ended (= t_compute when nothing was waited for)
    stall_s: float = 0.0      # total time spent waiting for expert loads in this layer
    t_done: float = 0.0
    issued: list[int] = field(default_factory=list)     # prefetches issued for layer+1
    candidates: list[int] = field(default_factory=list)  # P^{l+1} (also recorded for PRED0, which issues none)
    topm_absent: dict[int, int] = field(default_factory=dict)  # M -> top-M candidates not available at t_pred
    scores: Any = None        # priorities for layer+1 (kept when recording routing for the simulator)
    topk: Any = None          # [T, K] executed experts (kept when recording routing)
    prefetch_used: int = 0    # prefetches issued for this layer that it needed
    prefetch_wasted: int = 0  # prefetches issued for this layer that it did not need (transferred anyway)
    prefetch_cancelled: int = 0  # prefetches for this layer dropped before they started (not needed)
    m_max: int | None = None  # the budget of its prediction step (None: it predicted nothing)
    early: bool = False       # its prediction came after the layer, before the next one's attention (pre-attention)
    decode: bool | None = None  # a decoding step (one new token per sequence); None: one token (batch 1)

    def __post_init__(self) -> None:
        if self.decode is None:
            self.decode = self.n_tokens == 1

    @property
    def stall(self) -> float:
        return self.stall_s


def window_ms(ev: LayerEvent, nxt: LayerEvent) -> float:
    """The prefetch window ``ev`` gave layer ``nxt`` (the next layer of the same step): t_exec(l+1) - t_pred(l) in ms,
    less the time layer l then stalled for its own experts (in an offloaded run its demand loads occupy the device
    then, and a prefetch starts only after them: that time is no window for layer l+1's transfers; 0 with every
    expert resident). A pre-attention prediction (``early``) comes after that stall: its window is layer l+1's
    attention. NaN when ``ev`` predicted nothing."""
    if ev.t_pred is None:
        return float("nan")
    return (nxt.t_exec - ev.t_pred - (0.0 if ev.early else ev.stall_s)) * 1e3


def busy_s(transfers: Iterable[Any]) -> float:
    """The time some of ``transfers`` was running: the union of their ``[t_start, t_end)`` intervals, in s."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted((tr.t_start, tr.t_end) for tr in transfers):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy


def routing_rows(events: Iterable[LayerEvent]) -> list[dict[str, Any]]:
    """The recorded routing of a run's events (``record_routing``): one ``{step, layer, topk, scores}`` row per
    layer call, the form of a benchmark's routing record and the simulator's input
    (:func:`~specprefetch.runtime.simulation.simulator.sequences_from_record`)."""
    return [{"step": ev.step, "layer": ev.layer, "topk": ev.topk, "scores": ev.scores} for ev in events]


def ready_recall_of(topk_rows: Sequence[Sequence[int]], available: Iterable[int], k: int) -> float:
    """Mean over tokens of |T_t ∩ A| / K for one layer event (the definition, for scripted checks)."""
    avail = set(available)
    if not topk_rows:
        return 0.0
    return sum(len(set(row) & avail) / k for row in topk_rows) / len(topk_rows)


@dataclass
class RunStats:
    """Counters of one run (decoding steps only unless ``include_prefill``)."""

    n_tokens: int = 0
    hits: int = 0
    inflight: int = 0
    misses: int = 0
    prefetched: int = 0
    wasted: int = 0
    cancelled: int = 0
    stall_ms: float = 0.0
    ready_recall: float = float("nan")
    io_errors: int = 0
    peak_cache_experts: int = 0
    demand_loads: int = 0


def summarize(events: Sequence[LayerEvent], top_k: int, decode_only: bool = True) -> RunStats:
    """Counters and ReadyRecall over the events (decoding steps: one new token per sequence of the batch)."""
    st = RunStats()
    ready, denom = 0, 0
    steps = set()
    for ev in events:
        if decode_only and not ev.decode:
            continue
        if ev.layer == 0:
            steps.add(ev.step)
        st.hits += ev.hits
        st.inflight += ev.inflight
        st.misses += ev.misses + ev.inflight
        st.demand_loads += ev.misses
        st.stall_ms += ev.stall * 1e3
        st.prefetched += ev.prefetch_used + ev.prefetch_wasted
        st.wasted += ev.prefetch_wasted
        st.cancelled += ev.prefetch_cancelled
        if ev.layer >= 1:  # target layers l+1 of the definition
            ready += ev.ready_pairs
            denom += ev.n_tokens * top_k
    st.n_tokens = len(steps)
    st.ready_recall = ready / denom if denom else float("nan")
    return st
