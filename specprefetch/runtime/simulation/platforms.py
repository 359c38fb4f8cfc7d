"""Platform profiles for the simulator: platforms that are not here, described by the paper's own figures.

Snapdragon 8 Elite (paper §4.1, §4.4, Figure 1a, Table 4), running 4-bit DeepSeek-VL2-Tiny:

- 12 decoder layers, the first dense, 11 MoE layers of 64 routed experts, top-6; one expert = 1.94 MB;
- OFF decodes 3.753 tok/s on cold-cache NVMe (Table 4) -> 266.5 ms per token;
- exposed expert loading is 52% of the per-layer latency under mobile cold cache (Figure 1a) -> compute is
  48% of 266.5 ms = 127.9 ms per token, i.e. 10.66 ms per decoder layer;
- the MoE computation is taken as half of a layer's compute (Figure 1a shows it as a "substantial fraction";
  the paper gives no number: an assumption, documented here), the rest (attention, router, shared experts) is the
  gap to the next layer; the dense first layer and the LM head form the per-token head;
- PRED0 costs -0.53% throughput (Table 4) -> ~0.13 ms of prediction per MoE layer;
- NVMe latency 0.1 ms; its effective bandwidth is the one unknown and is fitted so that the simulated OFF
  throughput on the model's routing trace equals Table 4's 3.753 tok/s (:func:`calibrate_bandwidth`); the
  emulated slower profiles use ``runtime.core.storage``'s table at 1.94 MB per expert.

Every other number the simulator reports for this platform (PRED0, SpecPrefetch, Naive, the M_max sweep, the
storage profiles, ReadyRecall) is a prediction, to be compared with Tables 4-5 and Figures 4-5.

Its budget (:func:`platform_m_max`) is ``device.simulator.m_max``: an integer, or ``auto`` -- the window rule of
:mod:`~specprefetch.runtime.core.budget` applied to the platform itself, as ``profile_window`` applies it to this
machine: the window ``W_l = t_exec(l+1) - t_pred(l) - stall_l`` of the compute profile above (the time from the end
of prediction to the next layer: post-prediction, MoE compute and the gap, 10.66 ms per layer) over each storage's
per-expert transfer time in the simulator's device model (latency + 1.94 MB / bandwidth; the fitted bandwidth on
NVMe). The paper's phone runs at M_max = 8 (Table 5), which the rule does not give with the fitted NVMe: an
expert takes a few milliseconds there (on synthetic routing at the default geometry the fit gives 340-840 MB/s,
so ``auto`` gives 1-4), so the profiles keep 8 as ``device.simulator.m_max``.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from specprefetch.contracts import EMULATED
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.budget import AUTO, budget_storages, is_auto, sourced_budgets, window_budgets
from specprefetch.runtime.core.storage import StorageProfile, delayed_device, make_profile
from specprefetch.runtime.simulation.simulator import ComputeProfile, SimSequence, simulate

log = logging.getLogger(__name__)

SNAPDRAGON_8_ELITE: dict[str, Any] = {
    "name": "snapdragon_8_elite",
    "archs": ["deepseek_vl2_standin", "deepseek_vl2", "deepseek_v2"],
    "expert_mb": 1.94,
    "off_tokens_per_s": 3.753,          # Table 4, OFF, cold-cache NVMe
    "pred0_gain": -0.0053,              # Table 4
    "exposed_load_fraction": 0.52,      # Figure 1a, mobile cold cache
    "n_decoder_layers": 12,
    "moe_fraction_of_layer": 0.5,       # assumption (see module docstring)
    "book_ms": 0.02,
    "nvme_latency_ms": 0.1,
    "io_workers": 4,
}
PLATFORMS = {"snapdragon_8_elite": SNAPDRAGON_8_ELITE}


def platform_profile(name: str) -> dict[str, Any]:
    if name not in PLATFORMS:
        raise SpecPrefetchError(f"unknown platform {name!r}; known: {', '.join(PLATFORMS)}")
    return dict(PLATFORMS[name])


def compute_profile_of(p: dict[str, Any], n_layers: int) -> ComputeProfile:
    """Per-layer durations implied by the platform's published figures (see the module docstring)."""
    per_token_s = 1.0 / p["off_tokens_per_s"]
    compute_s = (1.0 - p["exposed_load_fraction"]) * per_token_s
    layer_s = compute_s / p["n_decoder_layers"]
    moe = p["moe_fraction_of_layer"] * layer_s
    gap = layer_s - moe
    head = max(compute_s - n_layers * layer_s, 0.1 * layer_s)  # dense layer(s) + LM head
    pred = -p["pred0_gain"] * per_token_s / max(1, n_layers - 1)
    book = p["book_ms"] * 1e-3
    return ComputeProfile(book_s=[book] * n_layers, pred_s=[book + pred] * n_layers, post_pred_s=[0.0] * n_layers,
                          moe_s=[moe] * n_layers, gap_s=[gap] * n_layers, head_s=head)


def nvme_profile(p: dict[str, Any], bandwidth_mbps: float) -> StorageProfile:
    return StorageProfile("nvme_cold", "emulated", bandwidth_mbps, p["nvme_latency_ms"], p["expert_mb"] * 1e6)


def calibrate_bandwidth(p: dict[str, Any], sequences: Sequence[SimSequence], capacity: int, n_experts: int,
                        top_k: int, compute: ComputeProfile, iters: int = 18,
                        progress: Callable[[int], None] | None = None) -> float:
    """The NVMe bandwidth (MB/s) at which simulated OFF decodes ``off_tokens_per_s`` (bisection, log scale)."""
    target = p["off_tokens_per_s"]
    lo, hi = math.log(5.0), math.log(2e5)

    def tps(bw_log: float) -> float:
        return simulate(sequences, "off", 0, capacity, n_experts, top_k, compute,
                        nvme_profile(p, math.exp(bw_log)), p["io_workers"]).tokens_per_s

    if tps(hi) < target:
        raise SpecPrefetchError(f"{p['name']}: even at {math.exp(hi):.0f} MB/s the simulated OFF throughput is below "
                                f"{target} tok/s: the compute profile alone is too slow")
    for i in range(iters):
        mid = (lo + hi) / 2
        if tps(mid) < target:
            lo = mid
        else:
            hi = mid
        if progress:
            progress(i)
    return math.exp((lo + hi) / 2)


def platform_storage(p: dict[str, Any], name: str, settings: dict[str, Any], bandwidth_mbps: float) -> StorageProfile:
    """The platform's device model of storage ``name``: its NVMe at the fitted bandwidth for ``nvme_cold``, the
    emulated profiles at its expert size, RAM (no transfer time) otherwise."""
    nvme = nvme_profile(p, bandwidth_mbps)
    if name == "nvme_cold":
        return nvme
    if name in EMULATED:  # the delay emulation adds to the platform's own NVMe read of one expert
        prof = make_profile(name, settings, int(p["expert_mb"] * 1e6), nvme.transfer_s() * 1e3)
        return delayed_device(nvme, prof) if prof.delayed else prof
    return StorageProfile(name, "ram")


def platform_windows_ms(compute: ComputeProfile) -> dict[int, float]:
    """W_l (ms) of every layer that prefetches (all but the last) in the simulator on this compute profile:
    t_exec(l+1) - t_pred(l) - stall_l = post-prediction + MoE compute + the gap to the next layer."""
    n = len(compute.moe_s)
    return {l: (compute.post_pred_s[l] + compute.moe_s[l] + compute.gap_s[l]) * 1e3 for l in range(n - 1)}


def platform_m_max(p: dict[str, Any], settings: dict[str, Any], bandwidth_mbps: float, compute: ComputeProfile,
                   n_experts: int) -> int | dict[str, int]:
    """The simulated platform's budget: ``device.simulator.m_max`` when an integer, else per storage the window rule
    on the platform's median window and the per-expert transfer time in the device model (see the module docstring)
    of the storage whose budget it runs at (``device.budget_scope``, :func:`~specprefetch.runtime.core.budget.
    budget_source`: the platform's NVMe, its reference, on every storage; or each storage's own)."""
    setting = settings["simulator"]["m_max"]
    if not is_auto(setting, "device.simulator.m_max"):
        return int(setting)
    windows = platform_windows_ms(compute)
    ref = {**settings, "reference_storage": "nvme_cold"}
    storages = budget_storages(ref)
    transfer_ms = {st: platform_storage(p, st, settings, bandwidth_mbps).transfer_s() * 1e3 for st in storages}
    window_ms = statistics.median(windows.values()) if windows else float("nan")
    own, _ = window_budgets(AUTO, window_ms, windows, transfer_ms, n_experts)
    per_storage = sourced_budgets(ref, own, storages, "window-rule M_max")
    log.info("%s: window %.2f ms, per-expert transfer %s ms -> M_max %s", p["name"], window_ms,
             {st: round(t, 3) for st, t in transfer_ms.items()}, per_storage)
    return per_storage
