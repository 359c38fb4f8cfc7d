"""The simulated budget rule and the simulator's curves, from the window profile alone (beyond the paper).

The paper's window rule (:func:`~specprefetch.runtime.core.budget.derive_m_max`) gives a layer ``floor(W / t)``
prefetches: as many as the storage delivers inside the window ``W`` at ``t`` per expert. It treats a prefetch that
does not land inside the window as lost. In the runtime it is not:

- a prefetch still in flight when layer ``l+1`` starts has already moved part of its expert, so it lands before a
  demand load of that expert, started only then, would have;
- with the runtime's demand-first order a queued prefetch of a needed expert is promoted to a demand load, at no
  loss, and a queued wrong one waits behind the demand loads instead of delaying them;
- the I/O workers overlap their loads' latencies (``io_workers``), so a burst of ``M`` loads takes less than
  ``M t`` with ``t`` the isolated load time.

So the fastest budget lies above ``floor(W / t)`` until the wrong prefetches in flight, and the cache entries they
take from later layers' experts, cost more than the late right ones save. Where that is depends on the predictor's
ranking, the cache and the device: the **simulated rule** asks the trace-driven simulator
(:mod:`~specprefetch.runtime.simulation.simulator`, the runtime's own per-layer loop, cache and I/O order) fed only
the window profile (compute per layer, the device models, the worker hand-off) and the recorded routing and
priorities of the profile's offloaded predicting run, for every budget ``1 .. max(device.sweep_m_max)``, and takes
the fastest (the smaller on a tie). ``device.budget_rule: simulated`` runs the benchmarks at it; the sweep always
measures it beside the window rule's budget, so Figure 4 judges both against the measured optimum.

The same simulations give the curves Figures 4 and 5 draw beside the measurements (``budget_curve.csv``):

- ``budget``: per storage, the simulated throughput of SpecPrefetch at every budget and of OFF;
- ``storage``: per storage, the window-to-transfer ratio ``W/t`` (``t`` the isolated load time);
- ``w_over_t``: OFF and SpecPrefetch (at the window rule's and at the simulated rule's budget) on a device of the
  disk model's shape made slower or faster, on a grid of ``W/t``: where a host's storages fall on that axis says
  what prefetching can gain there, whatever the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from specprefetch.runtime.core.budget import allot_layer_budgets, budget_storages, derive_m_max
from specprefetch.runtime.core.storage import StorageProfile
from specprefetch.runtime.simulation.simrun import disk_model, profile_inputs
from specprefetch.runtime.simulation.simulator import (
    ComputeProfile,
    SimResult,
    SimSequence,
    sequences_from_record,
    simulate,
)

SIM_RULE = ("the fastest M_max = 1..max(device.sweep_m_max) in the trace-driven simulator fed the window profile and "
            "the recorded routing of its offloaded predicting run (ties: the smaller)")
DP_RULE = ("the window rule's per-layer total sum_l floor(W_l / t) allotted across layers by dynamic programming to "
           "the most right prefetches, each layer's first M candidates scored against its demand in the simulated run "
           "at the largest budget")
# W/t on the w_over_t curve: 0.5 (a transfer takes two windows) to 8 (eight fit), evenly on a log axis (x sqrt 2)
W_OVER_T_GRID = tuple(round(0.5 * 2 ** (k / 2), 4) for k in range(9))


class _Sim:
    """The simulations of one profile: the recorded sequences, the cache and the model's shape."""

    def __init__(self, profile: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]):
        self.profile, self.settings = profile, settings
        self.seqs: list[SimSequence] = sequences_from_record(rows, int(profile["n_layers"]))
        self.capacity = int(profile["cache_capacity_experts"])
        self.n_experts, self.top_k = int(profile["n_experts"]), int(profile["top_k"])
        self.workers = int(profile["io_workers"])
        self.budgets = range(1, max(int(m) for m in settings["sweep_m_max"]) + 1)
        self._curves: dict[tuple[Any, ...], tuple[float, dict[int, float], int]] = {}
        self._right: dict[tuple[Any, ...], list[dict[int, float]]] = {}

    def run(self, policy: str, m_max: int, compute: ComputeProfile, device: StorageProfile,
            fixed: float | None) -> SimResult:
        return simulate(self.seqs, policy, m_max, self.capacity, self.n_experts, self.top_k, compute, device,
                        self.workers, True, fixed_transfer_s=fixed)

    def curve(self, compute: ComputeProfile, device: StorageProfile, fixed: float | None
              ) -> tuple[float, dict[int, float], int]:
        """(OFF, SpecPrefetch per budget, the fastest budget); storages of one device model (e.g. emulated ones
        without a delay on a disk faster than their datasheet) are simulated once. The largest budget's run gives
        :meth:`layer_values`."""
        key = (repr(compute), replace(device, name=""), fixed)
        if key not in self._curves:
            off = self.run("off", 0, compute, device, fixed).tokens_per_s
            runs = {m: self.run("specprefetch", m, compute, device, fixed) for m in self.budgets}
            per = {m: r.tokens_per_s for m, r in runs.items()}
            self._curves[key] = (off, per, fastest(per))
            top = max(runs)
            self._right[key] = right_candidates(runs[top].events, len(self.seqs[0].steps[0].topk), top)
        return self._curves[key]

    def layer_values(self, compute: ComputeProfile, device: StorageProfile, fixed: float | None
                     ) -> list[dict[int, float]]:
        """Per layer prefetched into (1..L-1): :func:`right_candidates` of the simulated run at the largest budget."""
        self.curve(compute, device, fixed)
        return self._right[(repr(compute), replace(device, name=""), fixed)]


def right_candidates(events: Sequence[Any], n_layers: int, top: int) -> list[dict[int, float]]:
    """Per layer prefetched into (1..L-1) and budget ``M = 1..top``: the mean over decoding steps of how many of the
    first ``M`` prefetch candidates (the absent experts in priority order, as the run selected them at budget
    ``top``) the layer then needed. Non-decreasing in ``M`` by construction: what the ``M``-th prefetch into a
    layer is worth, with the cache as the run had it."""
    by = {(ev.step, ev.layer): ev for ev in events if ev.decode}
    sums = [[0.0] * (top + 1) for _ in range(n_layers)]
    counts = [0] * n_layers
    for (step, layer), ev in by.items():
        nxt = by.get((step, layer + 1))
        if nxt is None or ev.t_pred is None:
            continue
        need = set(nxt.required)
        right = 0
        for m in range(1, top + 1):
            if m <= len(ev.candidates) and ev.candidates[m - 1] in need:
                right += 1
            sums[layer + 1][m] += right
        counts[layer + 1] += 1
    return [{m: sums[layer][m] / counts[layer] if counts[layer] else 0.0 for m in range(1, top + 1)}
            for layer in range(1, n_layers)]


def dp_layer_budgets(values: Sequence[Mapping[int, float]], window_layers: Sequence[int]) -> list[int]:
    """The DP rule's per-layer budgets (beyond the paper): the window rule's per-layer total
    ``sum_l floor(W_l / t)`` transfers per token allotted across the layers
    (:func:`~specprefetch.runtime.core.budget.allot_layer_budgets`) to the most right prefetches, each layer's worth at
    a budget from :func:`right_candidates` (separable, as AdapMoE's per-layer allotment from per-layer accuracies:
    a layer's candidates are taken as not depending on the other layers' budgets, and the total, not each layer's
    window, bounds the transfers)."""
    return list(allot_layer_budgets(values, int(sum(int(m) for m in window_layers))))


def fastest(per_budget: Mapping[int, float]) -> int:
    """The budget of the highest throughput, the smaller on a tie (NaNs never win)."""
    finite = {m: v for m, v in per_budget.items() if math.isfinite(v)}
    if not finite:
        raise ValueError("no budget has a finite simulated throughput")
    return min(finite, key=lambda m: (-finite[m], m))


def shaped_device(disk: StorageProfile, emulation: str, transfer_ms: float,
                  base_ms: float | None = None) -> StorageProfile:
    """The device of the W/t axis whose isolated load of one record takes ``transfer_ms``, given that the disk model
    (:func:`~specprefetch.runtime.simulation.simrun.disk_model`) stands for a disk whose isolated load takes
    ``base_ms`` (default: the model's own load time): under the ``delay`` emulation a device no faster than the disk is
    the disk plus a per-load delay of the difference (loads overlap their delays), as the runtime emulates one;
    otherwise (faster than the disk, or the ``bandwidth`` emulation) the disk's latency and transfer time scaled by
    ``transfer_ms / base_ms``."""
    base_ms = disk.transfer_s() * 1e3 if base_ms is None else base_ms
    dev = replace(disk, name="w/t", emulation="bandwidth")
    if emulation == "delay" and transfer_ms >= base_ms:
        return replace(dev, latency_ms=disk.latency_ms + transfer_ms - base_ms)
    scale = transfer_ms / base_ms
    return replace(dev, latency_ms=disk.latency_ms * scale, bandwidth_mbps=disk.bandwidth_mbps / scale)


def isolated_ms(profile: Mapping[str, Any], storage: str) -> float:
    """The profile's isolated load time of one record on ``storage`` (its ``transfer_ms`` table)."""
    return float(profile["transfer_ms"][storage]["transfer_ms"])


def budget_curves(profile: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The simulated rule's budget per storage (profile.json's ``m_max_simulated_per_storage``, with the rule's
    text and the simulated throughputs) and the rows of ``budget_curve.csv`` (module docstring)."""
    sim = _Sim(profile, rows, settings)
    w = float(profile["window_ms_median"])
    emulation, io_order = str(settings["emulation"]), str(settings["io_order"])
    head = {"platform": profile["platform"], "model": profile["model"], "emulation": emulation, "io_order": io_order}
    window_rule = profile["m_max_per_storage"]
    chosen: dict[str, int] = {}
    dp: dict[str, list[int]] = {}
    out: list[dict[str, Any]] = []
    storages = budget_storages(settings)
    for st in tqdm(storages, desc="simulated budgets", disable=None):
        compute, device, fixed = profile_inputs(dict(profile), st, dict(settings))
        off, per, best = sim.curve(compute, device, fixed)
        chosen[st] = best
        dp[st] = dp_layer_budgets(sim.layer_values(compute, device, fixed), profile["m_max_per_layer"][st])
        x = w / isolated_ms(profile, st)
        common = {**head, "storage": st, "w_over_t": x, "transfer_ms": isolated_ms(profile, st),
                  "off_tokens_per_s": off, "m_max_window": int(window_rule[st]), "m_max_simulated": best}
        out.append({**common, "curve": "storage", "rule": "", "m_max": best, "tokens_per_s": per[best],
                    "gain_pct": _gain(per[best], off)})
        out += [{**common, "curve": "budget", "rule": "", "m_max": m, "tokens_per_s": v, "gain_pct": _gain(v, off)}
                for m, v in per.items()]
    ref = settings["reference_storage"]
    compute, _, _ = profile_inputs(dict(profile), ref, dict(settings))
    disk, disk_ms = disk_model(profile, settings), isolated_ms(profile, ref)
    for x in tqdm(W_OVER_T_GRID, desc="simulated W/t axis", disable=None):
        t = w / x
        device = shaped_device(disk, emulation, t, disk_ms)
        off, per, best = sim.curve(compute, device, None)
        by_window = derive_m_max(w, t, sim.n_experts)
        for rule, m in (("window", min(by_window, max(sim.budgets))), ("simulated", best)):
            out.append({**head, "curve": "w_over_t", "storage": "", "rule": rule, "w_over_t": x, "transfer_ms": t,
                        "m_max": m, "off_tokens_per_s": off, "tokens_per_s": per[m], "gain_pct": _gain(per[m], off),
                        "m_max_window": by_window, "m_max_simulated": best})
    keys = {"m_max_simulated_per_storage": chosen, "m_max_simulated_rule": SIM_RULE,
            "m_max_dp_per_layer": dp, "m_max_dp_rule": DP_RULE,
            "simulated_budget_source": "the offloaded predicting run's recorded routing (window profiling)"}
    return keys, out


def _gain(tps: float, off: float) -> float:
    return (tps / off - 1.0) * 100.0 if off > 0 and math.isfinite(off) else float("nan")


__all__ = ["DP_RULE", "SIM_RULE", "W_OVER_T_GRID", "budget_curves", "dp_layer_budgets", "fastest",
           "right_candidates", "shaped_device"]
