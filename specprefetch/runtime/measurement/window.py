"""Window profiling (paper §3.3, Figure 1): W_l, the per-expert transfer time, M_max, and per-layer latency.

Measured on the current platform with the real runtime:

- per-expert transfer time of every storage profile: isolated loads (one at a time, cold for ``nvme_cold``),
  plus the concurrent throughput of the physical disk (the simulator's device model);
- the prefetch window ``W_l = t_exec(l+1) - t_pred(l) - stall_l`` per decoding event, as the runtime experiences
  it: in the offloaded run on the reference storage with the predictor running (PRED0: the whole control path, no
  transfer issued), less the time layer ``l`` stalled for its own demand loads (no prefetch starts while they are
  outstanding). On a shared CPU host the offloaded runtime computes more slowly than with every expert resident,
  so this window is longer than the resident one (``window_ms_median_resident``, reported next to it);
- event-level candidate demand (Figure 1b): in the same run (bounded cache, reference storage), the number of the
  top-M predicted experts not available at ``t_pred`` times the per-expert transfer time, paired with the
  same event's window;
- ``M_max = max(1, floor(median W_l / t_transfer))`` per storage (or the configured integer; the rule and every
  other budget decision are :mod:`specprefetch.runtime.core.budget`'s): as many experts as the storage delivers within
  the window. ``t_transfer`` is the per-expert transfer time *inside the runtime*
  (:func:`service_transfer_ms`: in a prefetching run at M = K, the time the storage was serving some transfer in a
  decoding step divided by the transfers it served, median over steps), which includes the runtime's concurrency
  (its I/O workers' requests overlap on a device that serves several at once), queueing, I/O-thread wake-ups and
  the host CPU the transfers take from compute; the isolated read time (one request at a time) is recorded next to
  it;
- per-layer latency by component (attention, router, expert_load, moe_compute, other) with all experts
  resident and with on-demand loading (Figure 1a), from forward hooks that time the modules without
  changing them;
- the compute profile of the trace-driven simulator (per-layer durations, with and without compute_opt);
- with the caller's budget model (:mod:`specprefetch.runtime.simulation.budget_model`), the simulated rule's budget
  per storage and the simulator's curves, from this profile and the offloaded predicting run's recorded routing.

Outputs (``profile_window``): ``profile.json``, ``window.csv``, ``window_events.csv``, ``latency.csv``, ``host.csv``
and, with a budget model, ``budget_curve.csv``.
"""

from __future__ import annotations

import csv
import logging
import math
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specprefetch.contracts import BUDGET_CURVE_COLUMNS, EMULATED, LATENCY_PARTS
from specprefetch.io import atomic_path, provenance, write_json_atomic
from specprefetch.runtime.core.budget import (
    BATCH_KEY,
    BATCH_WINDOW_KEY,
    PRE_ATTENTION_KEY,
    RULE,
    budget_storages,
    derive_m_max,
    is_auto,
    window_budgets,
)
from specprefetch.runtime.core.storage import ExpertReader, host_buffer, measure_transfer_ms
from specprefetch.runtime.core.timeline import LayerEvent, busy_s, routing_rows, window_ms
from specprefetch.runtime.measurement.session import Harness, RunResult

log = logging.getLogger(__name__)

WINDOW_COLUMNS = ["platform", "model", "layer", "window_ms", "transfer_ms", "m_max"]
EVENT_COLUMNS = ["platform", "model", "layer", "M", "demand_ms", "window_ms"]
HOST_COLUMNS = ["platform", "model", "storage", "compute_ms", "window_ms", "transfer_ms", "w_over_t", "m_max",
                "emulation", "delay_ms"]
LATENCY_COLUMNS = ["platform", "model", "mode", "layer", "component", "ms"]


# ------------------------------------------------------------------------------------------ timing hooks
class LayerTimer:
    """Forward hooks timing each MoE layer's decoder layer, attention, router and shared experts per step."""

    def __init__(self, model: nn.Module, blocks: list[Any], sync: bool = False) -> None:
        self.sync = sync
        self.rt: Any = None
        self.step = -1
        self.times: dict[tuple[int, int, str], float] = defaultdict(float)
        self._t0: dict[int, float] = {}
        self.handles: list[Any] = []
        parents: dict[int, nn.Module] = {}
        for _, module in model.named_modules():
            for child in module.children():
                parents.setdefault(id(child), module)
        for b in blocks:
            layer = parents.get(id(b.block))
            parts = {"layer": layer, "attention": getattr(layer, "self_attn", None), "router": b.gate,
                     "shared": getattr(b.block, "shared_experts", None)}
            for name, mod in parts.items():
                if isinstance(mod, nn.Module):
                    self._hook(mod, b.ordinal, name)

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _hook(self, mod: nn.Module, ordinal: int, name: str) -> None:
        def pre(_m: nn.Module, _a: Any) -> None:
            if name == "layer" and ordinal == 0:
                self.step += 1  # counts forwards exactly as the runtime's step (first MoE layer starts one)
            self._t0[id(mod)] = self._now()

        def post(_m: nn.Module, _a: Any, _o: Any) -> None:
            t = self._now()
            self.times[(self.step, ordinal, name)] += t - self._t0.pop(id(mod), t)

        self.handles.append(mod.register_forward_pre_hook(pre))
        self.handles.append(mod.register_forward_hook(post))

    def attach(self, rt: Any) -> None:
        """Start of a run (called with its runtime): steps are counted from -1, as the runtime counts them."""
        self.rt = rt
        self.step = -1
        self.times.clear()

    def remove(self) -> None:
        for harness in self.handles:
            harness.remove()
        self.handles = []

    def components(self, events: list[LayerEvent]) -> dict[tuple[int, str], list[float]]:
        """Per (layer, component) the ms of every decoding event."""
        out: dict[tuple[int, str], list[float]] = defaultdict(list)
        for ev in events:
            if not ev.decode:
                continue
            key = (ev.step, ev.layer)
            total = self.times.get((*key, "layer"))
            if total is None:
                continue
            attn = self.times.get((*key, "attention"), 0.0)
            router = self.times.get((*key, "router"), 0.0)
            load = ev.stall
            moe = max(0.0, ev.t_done - ev.t_ready) + self.times.get((*key, "shared"), 0.0)
            other = max(0.0, total - attn - router - load - moe)
            for name, v in zip(LATENCY_PARTS, (attn, router, load, moe, other)):
                out[(ev.layer, name)].append(v * 1e3)
        return out


# ------------------------------------------------------------------------------------------ measurements
def concurrent_throughput(reader: ExpertReader, n_workers: int, n: int = 64, seed: int = 0) -> float:
    """Bytes/s of ``n`` random expert loads issued by ``n_workers`` threads at once (cold for nvme_cold)."""
    import random

    rng = random.Random(seed)
    st = reader.store
    keys = [(rng.randrange(st.n_layers), rng.randrange(st.n_experts)) for _ in range(n)]
    reader.prepare_run()
    lock = threading.Lock()

    def work() -> None:
        slot = host_buffer(st.record_bytes)
        while True:
            with lock:
                if not keys:
                    return
                layer, expert = keys.pop()
            reader.load(layer, expert, slot)

    threads = [threading.Thread(target=work) for _ in range(max(1, n_workers))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return n * st.layout.payload_bytes / (time.perf_counter() - t0)


def transfer_table(harness: Harness, storages: list[str], n: int) -> dict[str, dict[str, float]]:
    """Per storage: isolated per-expert load times (one at a time, cold for ``nvme_cold``), measured; for an emulated
    device also its modelled time and the measured overshoot over it (mean and p95, ms and % of the model)."""
    out = {}
    order = dict.fromkeys([*storages, harness.settings["reference_storage"], "ram"])
    for storage in sorted(order, key=lambda st: st != "nvme_cold"):  # the physical read first: the delays add to it
        reader = harness.reader(storage)
        ms = measure_transfer_ms(reader, n=n)
        if storage == "nvme_cold":
            harness.use_physical_ms(statistics.median(ms))
        row: dict[str, Any] = {"transfer_ms": statistics.median(ms), "transfer_ms_mean": statistics.fmean(ms),
                               "transfer_ms_p95": _quantile(ms, 0.95), "n": len(ms), "source": "measured"}
        if reader.profile.emulated:  # the emulation's intended time: the datasheet's, or the physical read + delay
            prof = reader.profile
            model = harness.physical_ms() + prof.delay_ms if prof.delayed else prof.transfer_s() * 1e3
            over = [m - model for m in ms]
            row.update(model_ms=model, overshoot_ms_mean=statistics.fmean(over), overshoot_ms_p95=_quantile(over, 0.95),
                       overshoot_pct_mean=100.0 * statistics.fmean(over) / model if model > 0 else float("nan"))
        if storage == "nvme_cold":
            row["cold_read_mode"] = reader.cold_read_mode
        out[storage] = row
    return out


def _quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else float("nan")


def transfer_cpu_ms(harness: Harness, storage: str, batches: int = 16) -> float:
    """Host CPU time (all threads) per expert transfer served by the I/O workers, in batches of K prefetches:
    the compute a prefetch takes away from the model on this host (GIL, copies, syscalls)."""
    from specprefetch.runtime.core.cache import ExpertCache, SlotPool
    from specprefetch.runtime.core.transfer import TransferEngine

    reader = harness.reader(storage)
    reader.prepare_run()
    k = int(harness.spec.top_k)
    n = min(batches * k, harness.store.total_experts)
    cache = ExpertCache(n)
    eng = TransferEngine(reader, cache, SlotPool(n, harness.store.layout, "cpu"),
                         int(harness.settings["io_workers"]), 0)
    keys = [(l, e) for l in range(harness.store.n_layers) for e in range(harness.store.n_experts)][:n]
    try:
        t0 = time.process_time()
        for i in range(0, n, k):
            for key in keys[i:i + k]:
                with cache.lock:
                    cache.reserve(key)
                    eng.submit(key, "prefetch", 0)
            eng.drain()
        return (time.process_time() - t0) / n * 1e3
    finally:
        eng.shutdown()


def read_fluctuation(reader: ExpertReader, batches: int = 24, per_batch: int = 16) -> dict[str, Any]:
    """How the physical disk's read time moves on the time scale of a few decoded tokens: ``batches`` x ``per_batch``
    isolated cold reads in a row, the median of each batch (``batch_s``: how long a batch took) and their spread
    (``cv_pct``: sd / mean of the batch medians). Two runs of one lockstep block decode a token each a few hundred ms
    apart, so this part of the disk's noise does not pair out: it sets the floor of a cold-disk gain's CI."""
    ms = measure_transfer_ms(reader, n=batches * per_batch, seed=1)
    med = [statistics.median(ms[i:i + per_batch]) for i in range(0, len(ms), per_batch)]
    mean = statistics.fmean(med)
    return {"batches": batches, "reads_per_batch": per_batch, "batch_s": sum(ms) / batches / 1e3,
            "batch_median_ms": med, "cv_pct": 100.0 * statistics.stdev(med) / mean if mean > 0 else float("nan"),
            "min_ms": min(med), "max_ms": max(med), "read_p99_ms": _quantile(ms, 0.99), "read_max_ms": max(ms)}


def physical_device_model(harness: Harness, isolated_ms: float) -> dict[str, float]:
    """Fit (latency, bandwidth) of the physical disk for the simulator from isolated and concurrent loads."""
    reader = harness.reader("nvme_cold")
    bw = concurrent_throughput(reader, int(harness.settings["io_workers"]),
                               n=4 * int(harness.settings["window"]["transfer_samples"]))
    payload = harness.store.layout.payload_bytes
    latency_ms = max(0.0, isolated_ms - payload / bw * 1e3)
    return {"bandwidth_mbps": bw / 1e6, "latency_ms": latency_ms, "payload_bytes": payload}


def per_layer_windows(events: list[LayerEvent]) -> dict[tuple[int, int], float]:
    """W_l per decoding event, keyed (step, l) (:func:`~specprefetch.runtime.core.timeline.window_ms`)."""
    by = {(ev.step, ev.layer): ev for ev in events if ev.decode}
    out = {}
    for (step, layer), ev in by.items():
        nxt = by.get((step, layer + 1))
        if nxt is not None and ev.t_pred is not None:
            out[(step, layer)] = window_ms(ev, nxt)
    return out


def pre_attention_windows(events: list[LayerEvent]) -> list[float]:
    """The window a pre-attention prediction gives layer l+1 (beyond the paper), per decoding event l: from layer l's
    end to layer l+1's router, ``t_exec(l+1) - t_done(l)`` in ms -- layer l+1's attention with its norms and router,
    which a prediction before that attention overlaps (the prediction itself comes out of it)."""
    by = {(ev.step, ev.layer): ev for ev in events if ev.decode}
    return [(nxt.t_exec - ev.t_done) * 1e3 for (step, layer), ev in sorted(by.items())
            if (nxt := by.get((step, layer + 1))) is not None]


def compute_profile(events: list[LayerEvent], n_layers: int) -> dict[str, Any]:
    """Mean per-layer durations (s) of a run's events with every expert resident: the simulator's compute model. A
    pre-attention prediction (``early``) came after its layer, before the next one's attention: it is part of the
    gap to the next layer, not of the layer's own prediction durations."""
    evs = [ev for ev in events if ev.decode]
    by = {(ev.step, ev.layer): ev for ev in evs}
    book, pred, post, moe, gap = (defaultdict(list) for _ in range(5))
    head = []
    for (step, layer), ev in by.items():
        if ev.t_pred is not None and not ev.early:
            pred[layer].append(ev.t_pred - ev.t_exec)
            post[layer].append(ev.t_compute - ev.t_pred)
        book[layer].append(ev.t_compute - ev.t_exec)
        moe[layer].append(ev.t_done - ev.t_compute - ev.stall_s)
        nxt = by.get((step, layer + 1))
        if nxt is not None:
            gap[layer].append(nxt.t_exec - ev.t_done)
        if layer == n_layers - 1:
            first = by.get((step + 1, 0))
            if first is not None:
                head.append(first.t_exec - ev.t_done)

    def mean(d: dict[int, list[float]], layer: int) -> float:
        return statistics.fmean(d[layer]) if d.get(layer) else 0.0

    return {
        "book_s": [mean(book, i) for i in range(n_layers)],
        "pred_s": [mean(pred, i) for i in range(n_layers)],
        "post_pred_s": [mean(post, i) for i in range(n_layers)],
        "moe_s": [mean(moe, i) for i in range(n_layers)],
        "gap_s": [mean(gap, i) for i in range(n_layers)],
        "head_s": statistics.fmean(head) if head else 0.0,
    }


def _total_s(comp: Mapping[str, Any]) -> float:
    """A compute profile's time per decoding step (s): bookkeeping and prediction, experts, gaps and the head."""
    return sum(comp["book_s"]) + sum(comp["moe_s"]) + sum(comp["gap_s"]) + comp["head_s"]


def step_load(res: RunResult, comp: Mapping[str, Any]) -> dict[str, float]:
    """What a run's decoding steps cost its compute thread and what they asked of the I/O, per decoding step: the
    compute (``compute_ms``: bookkeeping and prediction, the experts without their stalls, the gaps between layers
    and the head, from the run's :func:`compute_profile` ``comp``), demand loads, prefetches the I/O workers served
    (a queued prefetch cancelled before it started costs the compute nothing), layers that issued at least one
    prefetch, the thread hand-offs (:func:`hand_offs`: how many per step and their mean, in ms) and, in a run that
    transferred an expert while decoding, the storage's per-expert service time (``service_ms``,
    :func:`service_transfer_ms`; absent in a run without one: profile.json holds finite numbers only)."""
    dec = [ev for ev in res.events if ev.decode]
    steps = max(1, sum(1 for ev in dec if ev.layer == 0))
    out = {"compute_ms": _total_s(comp) * 1e3,
           "demand": sum(ev.misses for ev in dec) / steps,
           "prefetches": sum(1 for tr in decoding_transfers(res) if not tr.inline) / steps,
           "issues": sum(1 for ev in dec if ev.issued) / steps}
    service = service_transfer_ms(res)
    if math.isfinite(service):
        out["service_ms"] = service
    for ms, got in hand_offs(res).items():
        out |= {HAND_OFFS[ms]: len(got) / steps, ms: statistics.fmean(got) if got else 0.0}
    return out


HAND_OFFS = {"wake_ms": "waits", "start_ms": "starts"}  # a hand-off's mean (ms) -> its count's key in step_load


def hand_offs(res: RunResult) -> dict[str, list[float]]:
    """The thread hand-offs of a run's decoding transfers that a worker served, in ms: ``wake_ms``, back to the compute
    thread that blocked on the load (``t_woken - t_end``, :meth:`TransferEngine.wait`), and ``start_ms``, to a worker
    asleep when the load was offered to the workers (``t_start - t_offered``: its wake-up, before the disk sees the
    read). Neither is in the storage's service time (:func:`service_transfer_ms` counts from the read's start)."""
    served = [tr for tr in decoding_transfers(res) if not tr.inline]
    return {"wake_ms": [(tr.t_woken - tr.t_end) * 1e3 for tr in served if getattr(tr, "t_woken", 0.0) > 0],
            "start_ms": [(tr.t_start - tr.t_offered) * 1e3 for tr in served
                         if getattr(tr, "woke", False) and tr.t_offered > 0]}


def pooled_hand_offs(loads: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each hand-off's mean over several runs (:func:`step_load`'s means weighted by their counts); 0 where none
    happened."""
    out = {}
    for ms, count in HAND_OFFS.items():
        n = sum(r.get(count, 0.0) for r in loads)
        out[ms] = sum(r.get(count, 0.0) * r.get(ms, 0.0) for r in loads) / n if n > 0 else 0.0
    return out


def fit_interference(resident: Mapping[str, float], off: Mapping[str, float], predicting: Mapping[str, float],
                     prefetching: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The host CPU the I/O takes from the model's compute, per decoding step, from :func:`step_load` of four kinds of
    run on one storage: all resident, OFF (demand loads only), predicting without issuing, and prefetching at two
    budgets. On a small host a load does not only cost its own CPU: the compute slows while loads run beside it.

    - ``cpu_per_demand_ms``: OFF's extra compute over all-resident, per demand load.
    - ``cpu_per_issue_ms`` and ``cpu_per_prefetch_ms``: a prefetching run's extra compute over the predicting run
      (less the demand loads' share), as a cost per layer that issues prefetches (the I/O workers woken beside the
      compute) plus one per prefetch a worker served, fitted exactly to the two budgets (least squares, both >= 0).
    Each is >= 0; a quantity the runs cannot separate (no demand loads, no prefetches) is 0."""
    demand = max(0.0, (off["compute_ms"] - resident["compute_ms"]) / off["demand"]) if off["demand"] > 0 else 0.0
    rows = [(r["issues"], r["prefetches"],
             r["compute_ms"] - predicting["compute_ms"] - demand * (r["demand"] - predicting["demand"]))
            for r in prefetching if r["prefetches"] > 0]
    issue = per = 0.0
    if rows:
        a = np.array([[i, p] for i, p, _ in rows], dtype=float)
        y = np.array([v for _, _, v in rows], dtype=float)
        if len(rows) >= 2 and abs(np.linalg.det(a[:2].T @ a[:2])) > 1e-9:
            issue, per = (float(v) for v in np.linalg.lstsq(a, y, rcond=None)[0])
        if len(rows) < 2 or issue < 0 or per < 0:  # one cost only: the one that fits the runs best alone
            fits = [(float(np.sum((y - a[:, j] * c) ** 2)), j, c)
                    for j in (0, 1) for c in [max(0.0, float(a[:, j] @ y) / max(float(a[:, j] @ a[:, j]), 1e-12))]]
            _, j, c = min(fits)
            issue, per = (c, 0.0) if j == 0 else (0.0, c)
    return {"cpu_per_demand_ms": demand, "cpu_per_issue_ms": issue, "cpu_per_prefetch_ms": per}


CACHED_INTERFERENCE = "io_interference_cached"  # the profile's fit on a storage whose loads read the page cache


def page_cache_storage(settings: Mapping[str, Any]) -> str | None:
    """The storage the profile fits the I/O's interference on for loads that read the page cache, not the disk: under
    the ``bandwidth`` emulation, the first emulated storage the benchmark runs (its loads are page-cache reads paced
    by the device model); None when every benchmarked storage reads the disk (the ``delay`` emulation) or none is
    emulated."""
    if settings.get("emulation") != "bandwidth":
        return None
    return next((st for st in settings.get("storages", []) if st in EMULATED), None)


def lockstep_compute(harness: Harness, policy: str, prompts: list[Any], storage: str | None = None) -> dict[str, Any]:
    """The compute as the benchmark's lockstep blocks see it (runs taking turns token by token, each finding the
    CPU's caches holding another's state), from one lockstep block of five runs on ``storage`` (default: the
    reference storage): OFF, all-resident, ``policy`` predicting with every expert resident (nothing to issue), and
    ``policy`` prefetching at M = 1 and at M = K. Gives the simulator's all-resident and predicting compute (``opt``,
    ``pred``; ``loop``, the compute without compute_opt, is the single run's scaled by the block's all-resident over
    the single one's, as the block has no such run) and :func:`fit_interference` with the loads it was fitted to and
    the pooled thread hand-offs (``io_interference``)."""
    ref = storage or harness.settings["reference_storage"]
    k = int(harness.spec.top_k)
    runs = {"off": {"policy": "off", "storage": ref}, "resident": {"policy": "resident", "storage": "ram"},
            "predicting": {"policy": policy, "storage": "ram", "m_max": k, "preload": True},
            "prefetching_m1": {"policy": policy, "storage": ref, "m_max": 1},
            f"prefetching_m{k}": {"policy": policy, "storage": ref, "m_max": k}}
    log.info("timing the compute in a lockstep block (%s)", ", ".join(runs))
    res = dict(zip(runs, harness.run_lockstep(list(runs.values()), seed="profile", prompts=prompts), strict=True))
    comps = {name: compute_profile(r.events, len(harness.blocks)) for name, r in res.items()}
    loads = {name: step_load(r, comps[name]) for name, r in res.items()}
    fit = fit_interference(loads["resident"], loads["off"], loads["predicting"],
                           [loads["prefetching_m1"], loads[f"prefetching_m{k}"]])
    handed = pooled_hand_offs([loads["off"], loads["prefetching_m1"], loads[f"prefetching_m{k}"]])
    return {"opt": comps["resident"], "pred": comps["predicting"],
            "io_interference": {**fit, **handed, "runs": loads}}


def decoding_transfers(res: RunResult) -> list[Any]:
    """The run's completed, charged transfers of decoding steps (prefetches and demand loads): what its storage
    served while it decoded."""
    decoding = {ev.step for ev in res.events if ev.decode}
    return [tr for tr in res.transfers
            if tr.state == "done" and tr.charged and tr.step in decoding and tr.t_end > tr.t_start > 0]


def service_transfer_ms(res: RunResult) -> float:
    """Per-expert transfer time as the runtime experiences it: in each decoding step, the time its storage was
    serving some transfer (:func:`busy_s`) divided by the number it served, i.e. what one expert costs the storage
    with the runtime's concurrency (its I/O workers' overlapping requests), queueing, thread wake-ups and the host
    CPU the transfers share with compute included; the median over steps (robust to a background burst). NaN if
    the run transferred nothing while decoding."""
    by_step: dict[int, list[Any]] = defaultdict(list)
    for tr in decoding_transfers(res):
        by_step[tr.step].append(tr)
    per_step = [busy_s(trs) / len(trs) for trs in by_step.values()]
    return statistics.median(per_step) * 1e3 if per_step else float("nan")


# ------------------------------------------------------------------------------------------ the profile
BudgetModel = Callable[[dict[str, Any], list[dict[str, Any]]], tuple[dict[str, Any], list[dict[str, Any]]]]


def profile_window(harness: Harness, model_name: str, platform: str, out_dir: str | Path,
                   config_fragment: Any = None, budget_model: BudgetModel | None = None) -> dict[str, Any]:
    """Measure everything above and write the outputs into ``out_dir`` (atomically). ``budget_model`` (the
    simulation layer's :func:`~specprefetch.runtime.simulation.budget_model.budget_curves`, given by the caller:
    measurement does not import simulation) is called with the profile and the recorded routing of the offloaded
    predicting run; its keys join profile.json and its rows are ``budget_curve.csv``."""
    settings = harness.settings
    wcfg = settings["window"]
    prompts = harness.prompts[: int(wcfg["n_prompts"])]
    demand_m = tuple(int(m) for m in wcfg["demand_m"])

    harness.run("resident", "ram", prompts=prompts[:1], max_new_tokens=4)  # warm-up (allocator, lazy inits)
    lat = _time_layers(harness, prompts)
    win = _measure_windows(harness, prompts, demand_m, lat.resident)
    xfer = _measure_transfers(harness, prompts)
    n_experts = harness.store.n_experts
    per_storage, per_layer = window_budgets(settings["m_max"], win.median_ms, win.layer_median_ms, xfer.used_ms,
                                            n_experts)
    ref = settings["reference_storage"]
    t_ref = xfer.used_ms[ref]
    pre_ms = pre_attention_windows(win.candidates.events)
    pre_median = statistics.median(pre_ms) if pre_ms else float("nan")
    batch_ms = _batch_windows(harness, win.policy, model_name, demand_m)
    cpu_ms = {st: transfer_cpu_ms(harness, st) for st in ("nvme_cold", "ram")}
    window_rows = [{"platform": platform, "model": model_name, "layer": layer + 1,
                    "window_ms": statistics.fmean(ws), "transfer_ms": t_ref,
                    "m_max": derive_m_max(win.layer_median_ms[layer], t_ref, n_experts)}
                   for layer, ws in sorted(win.per_layer.items())]
    event_rows = _event_rows(win, demand_m, t_ref, platform, model_name)
    latency_rows = [{"platform": platform, "model": model_name, "mode": mode, "layer": layer, "component": comp,
                     "ms": statistics.fmean(vals)}
                    for mode, comps in (("resident", lat.resident_parts), ("on_demand", lat.on_demand_parts))
                    for (layer, comp), vals in sorted(comps.items())]
    profile = {
        "format": "specprefetch-window-profile/1",
        "platform": platform, "model": model_name, "reference_storage": ref,
        "n_layers": len(harness.blocks), "n_experts": n_experts, "top_k": int(harness.spec.top_k),
        "record_bytes": harness.store.record_bytes, "payload_bytes": harness.store.layout.payload_bytes,
        "cache_capacity_experts": lat.capacity, "io_workers": int(settings["io_workers"]),
        "expert_store": {k: harness.store.manifest.get(k) for k in
                         ("hidden_size", "intermediate_size", "model_hidden_size", "quant", "dtype", "group_size",
                          "paper_scale")},
        **win.describe(ref),
        "transfer_ms": xfer.table, "transfer_ms_isolated": xfer.table[ref]["transfer_ms"],
        "transfer_ms_in_runtime": xfer.runtime_ms, "transfer_ms_used": xfer.used_ms, "m_max": per_storage[ref],
        "m_max_per_storage": per_storage, "m_max_per_layer": per_layer,
        "m_max_source": "profiled" if is_auto(settings["m_max"]) else "config", "m_max_rule": RULE,
        "window_ms_median_pre_attention": pre_median, "window_pre_attention_samples": len(pre_ms),
        PRE_ATTENTION_KEY: {st: derive_m_max(pre_median, t, n_experts) for st, t in xfer.used_ms.items()},
        BATCH_WINDOW_KEY: {str(b): ms for b, ms in batch_ms.items()},
        BATCH_KEY: {str(b): {st: derive_m_max(ms, t, n_experts) for st, t in xfer.used_ms.items()}
                    for b, ms in batch_ms.items()},
        "predictor_for_window": win.policy, "emulation": settings["emulation"], "io_order": settings["io_order"],
        "emulated_profiles": {
            name: harness.profile(name).describe() for name in EMULATED},
        "emulation_overshoot_ms": {st: {"mean_ms": row["overshoot_ms_mean"], "p95_ms": row["overshoot_ms_p95"],
                                        "pct_of_model": row["overshoot_pct_mean"]}
                                   for st, row in xfer.table.items() if "overshoot_ms_mean" in row},
        "transfer_cpu_ms": cpu_ms, "physical_model": xfer.physical, "disk_fluctuation": xfer.fluctuation,
        "compute": {"opt": compute_profile(lat.resident.events, len(harness.blocks)),
                    "loop": compute_profile(lat.resident_loop.events, len(harness.blocks)),
                    "pred": compute_profile(win.window_run.events, len(harness.blocks))},
        "demand_fraction_over_window": {
            str(m): (sum(1 for r in event_rows if r["M"] == m and r["demand_ms"] > r["window_ms"])
                     / max(1, sum(1 for r in event_rows if r["M"] == m))) for m in demand_m},
        "provenance": provenance(config_fragment),
    }
    block = lockstep_compute(harness, prefetching_policy(harness), prompts)
    single = profile["compute"]
    scale = _total_s(block["opt"]) / max(_total_s(single["opt"]), 1e-12)
    profile["compute_lockstep"] = {"opt": block["opt"], "pred": block["pred"],
                                   "loop": {k: ([v * scale for v in val] if isinstance(val, list) else val * scale)
                                            for k, val in single["loop"].items()},
                                   "loop_scale": scale}
    profile["io_interference"] = block["io_interference"]
    cached = page_cache_storage(settings)
    if cached is not None:  # loads from the page cache take the compute other CPU than the disk's direct reads
        fit = lockstep_compute(harness, prefetching_policy(harness), prompts, cached)["io_interference"]
        profile[CACHED_INTERFERENCE] = {**fit, "storage": cached}
    curve_rows = None
    if budget_model is not None:
        keys, curve_rows = budget_model(profile, routing_rows(win.candidates.events))
        profile.update(keys)
    with atomic_path(Path(out_dir), is_dir=True) as tmp:
        if curve_rows is not None:
            _write_csv(tmp / "budget_curve.csv", BUDGET_CURVE_COLUMNS, curve_rows)
        _write_csv(tmp / "window.csv", WINDOW_COLUMNS, window_rows)
        _write_csv(tmp / "window_events.csv", EVENT_COLUMNS, event_rows)
        _write_csv(tmp / "host.csv", HOST_COLUMNS, host_rows(profile))
        _write_csv(tmp / "latency.csv", LATENCY_COLUMNS, latency_rows)
        write_json_atomic(tmp / "profile.json", profile)
    log.info("window %.3f ms (median %.3f), transfer %.3f ms on %s -> M_max = %d; per storage %s", win.mean_ms,
             win.median_ms, t_ref, ref, per_storage[ref], per_storage)
    return profile


def host_rows(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """What this host gave the benchmarks, per storage the budget is decided for (``host.csv``, printed with every
    device table so runs on different hosts can be read side by side): the all-resident compute per MoE layer
    (decoding, compute-optimized: bookkeeping, experts and the gap to the next layer), the window W (median), the
    per-expert transfer time the budget used, W/t, the budget, and the storage's emulation and per-load delay."""
    comp = profile["compute"]["opt"]
    n = max(1, len(comp["moe_s"]))
    compute_ms = sum(b + m + g for b, m, g in zip(comp["book_s"], comp["moe_s"], comp["gap_s"])) / n * 1e3
    w = float(profile["window_ms_median"])
    emulated = profile.get("emulated_profiles") or {}
    rows = []
    for storage, t in profile["transfer_ms_used"].items():
        em = emulated.get(storage) or {}
        rows.append({"platform": profile["platform"], "model": profile["model"], "storage": storage,
                     "compute_ms": compute_ms, "window_ms": w, "transfer_ms": t,
                     "w_over_t": w / t if t > 0 else float("nan"), "m_max": profile["m_max_per_storage"][storage],
                     "emulation": em.get("emulation") or "none", "delay_ms": em.get("delay_ms") or 0.0})
    return rows


@dataclass
class _Layers:
    """Per-layer latency by component (Figure 1a), resident and on demand, and the all-resident runs."""

    resident: RunResult
    resident_loop: RunResult
    resident_parts: dict[tuple[int, str], list[float]]
    on_demand_parts: dict[tuple[int, str], list[float]]
    capacity: int


def _time_layers(harness: Harness, prompts: list[Any]) -> _Layers:
    """Time every layer's components with every expert resident and with on-demand loads from the reference
    storage (forward hooks), then the all-resident run without compute_opt (the simulator's ``loop`` compute)."""
    log.info("timing resident and on-demand layers")
    timer = LayerTimer(harness.model, harness.blocks, sync=harness.device.type == "cuda")
    try:
        resident = harness.run("resident", "ram", compute_opt=True, prompts=prompts, on_runtime=timer.attach)
        lat_res = timer.components(resident.events)
        timer.times.clear()
        capacity = harness.capacity
        on_demand = harness.run("off", harness.settings["reference_storage"], compute_opt=True, prompts=prompts,
                                on_runtime=timer.attach)
        lat_dem = timer.components(on_demand.events)
    finally:
        timer.remove()
    resident_loop = harness.run("resident", "ram", compute_opt=False, prompts=prompts)
    return _Layers(resident, resident_loop, lat_res, lat_dem, capacity)


@dataclass
class _Windows:
    """The prefetch windows W_l of the offloaded run on the reference storage (and of the resident one)."""

    policy: str                                  # the predicting policy the windows were measured with
    window_run: RunResult                        # every expert resident
    candidates: RunResult                        # offloaded, reference storage, Top-M absent recorded
    windows: dict[tuple[int, int], float]        # (step, layer) -> W in ms, offloaded run
    per_layer: dict[int, list[float]]            # layer -> its events' W
    resident_ms: list[float]                     # W of the resident run's events

    @property
    def all_ms(self) -> list[float]:
        return [w for ws in self.per_layer.values() for w in ws]

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.all_ms) if self.all_ms else float("nan")

    @property
    def median_ms(self) -> float:
        """The budget's window: the median, robust to background load."""
        return statistics.median(self.all_ms) if self.all_ms else float("nan")

    @property
    def layer_median_ms(self) -> dict[int, float]:
        return {layer: statistics.median(ws) for layer, ws in self.per_layer.items()}

    def describe(self, ref: str) -> dict[str, Any]:
        """profile.json's window keys."""
        return {
            "window_ms_mean": self.mean_ms, "window_ms_median": self.median_ms, "window_samples": len(self.all_ms),
            "window_measured_in": f"{self.policy} on {ref} (t_exec(l+1) - t_pred(l) - stall(l))",
            "window_ms_median_resident": statistics.median(self.resident_ms) if self.resident_ms else float("nan"),
            "window_ms_per_layer": {str(k + 1): statistics.fmean(v) for k, v in self.per_layer.items()},
            "window_ms_per_layer_median": {str(k + 1): v for k, v in self.layer_median_ms.items()},
        }


def _measure_windows(harness: Harness, prompts: list[Any], demand_m: tuple[int, ...],
                     resident: RunResult) -> _Windows:
    """W_l as the runtime experiences it: in the offloaded run on the reference storage with the predictor running
    (its compute is the offloaded runtime's, slower on a shared host than with every expert resident); the resident
    run's windows are reported next to it. Both must decode the resident run's tokens."""
    log.info("measuring the prefetch window")
    policy = "pred0" if "specprefetch" in harness.providers else "naive"
    ref = harness.settings["reference_storage"]
    window_run = harness.run(policy, "ram", m_max=max(demand_m), preload=True, prompts=prompts)
    candidates = harness.run(policy, ref, m_max=max(demand_m), topm_absent=demand_m, prompts=prompts, record=True)
    if window_run.tokens() != resident.tokens() or candidates.tokens() != resident.tokens():
        raise RuntimeError("window profiling runs decoded different tokens: the runtime changed the outputs")
    windows = per_layer_windows(candidates.events)
    per_layer: dict[int, list[float]] = defaultdict(list)
    for (_step, layer), w in windows.items():
        per_layer[layer].append(w)
    return _Windows(policy, window_run, candidates, windows, per_layer,
                    list(per_layer_windows(window_run.events).values()))


def _batch_windows(harness: Harness, policy: str, model: str, demand_m: tuple[int, ...]) -> dict[int, float]:
    """The median prefetch window decoding a batch of B (each size > 1 of ``device.batch.sizes``, when ``model`` runs
    the batch experiment): measured as the one-sequence window is (``policy`` predicting, offloaded, reference
    storage), on the batch the benchmark decodes. Empty when the experiment is not configured."""
    from specprefetch.runtime.core.settings import experiments_for

    settings = harness.settings
    if "batch" not in experiments_for(settings, model):
        return {}
    out = {}
    for b in sorted(int(b) for b in settings["batch"]["sizes"] if int(b) > 1):
        log.info("measuring the prefetch window of a batch of %d", b)
        run = harness.run(policy, settings["reference_storage"], m_max=max(demand_m), prompts=harness.batch_prompts(b))
        ws = list(per_layer_windows(run.events).values())
        out[b] = statistics.median(ws) if ws else float("nan")
    return out


@dataclass
class _Transfers:
    """Per-expert transfer times of every storage: isolated (``table``), in the runtime, and the one the budget
    uses (in the runtime when measured, else isolated); the physical disk's model and fluctuation."""

    table: dict[str, dict[str, Any]]
    runtime_ms: dict[str, float]
    used_ms: dict[str, float]
    physical: dict[str, float] | None
    fluctuation: dict[str, Any] | None


def prefetching_policy(harness: Harness) -> str:
    """The policy the profile prefetches with: SpecPrefetch where its predictor is given, else FATE, else Naive."""
    return next(p for p in ("specprefetch", "fate", "naive") if p == "naive" or p in harness.providers)


def _measure_transfers(harness: Harness, prompts: list[Any]) -> _Transfers:
    """Isolated loads on every storage, then each storage's service time in a prefetching run at M = K."""
    log.info("measuring per-expert transfer times")
    settings = harness.settings
    storages = budget_storages(settings)
    table = transfer_table(harness, storages, int(settings["window"]["transfer_samples"]))
    policy = prefetching_policy(harness)
    runtime_ms = {st: service_transfer_ms(harness.run(policy, st, m_max=int(harness.spec.top_k), prompts=prompts))
                  for st in storages}
    used_ms = {st: (runtime_ms[st] if math.isfinite(runtime_ms[st]) else table[st]["transfer_ms"]) for st in storages}
    cold = "nvme_cold" in table
    phys = physical_device_model(harness, table["nvme_cold"]["transfer_ms"]) if cold else None
    fluct = read_fluctuation(harness.reader("nvme_cold")) if cold else None
    return _Transfers(table, runtime_ms, used_ms, phys, fluct)


def _event_rows(win: _Windows, demand_m: tuple[int, ...], t_ref: float, platform: str,
                model: str) -> list[dict[str, Any]]:
    """Figure 1(b): per decoding event and M, the transfer time of the Top-M experts absent at t_pred vs W."""
    rows = []
    for ev in win.candidates.events:
        w = win.windows.get((ev.step, ev.layer))
        if not ev.decode or w is None:
            continue
        for m in demand_m:
            if m in ev.topm_absent:
                rows.append({"platform": platform, "model": model, "layer": ev.layer + 1, "M": m,
                             "demand_ms": ev.topm_absent[m] * t_ref, "window_ms": w})
    return rows


def _write_csv(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
