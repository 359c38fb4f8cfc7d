"""Offloaded MoE runtime with window-aware expert prefetching (paper §3.3, §4.4), its benchmarks and simulator.

Modules (each docstring has the details):

- :mod:`.store`: the expert store (one aligned record per expert, manifest with sizes and sha256),
  :func:`build_expert_store`, :class:`ExpertStore`, :func:`find_moe_blocks`;
- :mod:`.storage`: storage profiles (cold physical disk, RAM, emulated NVMe/UFS/slow UFS/SD card),
  :class:`ExpertReader`, :class:`BandwidthModel`, :class:`FaultInjector`;
- :mod:`.cache`: :class:`ExpertCache` (bounded, LRU, pins, in-flight reservations) and :class:`SlotPool` (its bytes,
  RAM or GPU memory);
- :mod:`.transfer`: :class:`TransferEngine` (prioritised background I/O workers; CUDA side streams);
- :mod:`.priority`: next-layer priorities at run time (trained predictors, FATE, Naive Prefetch) and
  :func:`select_prefetch` (Top-M_max of the experts neither available nor in flight);
- :mod:`.engine`: :class:`OffloadedRuntime` / :class:`OffloadedExperts` (the router decides; outputs unchanged);
- :mod:`.timeline`: per-layer events, counters, ReadyRecall;
- :mod:`.decode`, :mod:`.session`: greedy decoding with token timestamps, the benchmark harness;
- :mod:`.window`: ``profile_window`` (W_l, transfer time, M_max, Figure 1 data);
- :mod:`.bench`: ``bench_runtime`` (paired, interleaved experiments -> runs CSV);
- :mod:`.simulator`, :mod:`.platforms`, :mod:`.simrun`: the trace-driven discrete-event simulator, the
  Snapdragon 8 Elite profile, validation against measured runs;
- :mod:`.external`: external device logs (schema, validation, merge into runs.csv);
- :mod:`.lm_eval_model`: lm-eval model ``specprefetch-offloaded`` and the accuracy check;
- :mod:`.settings`: the ``device`` config section as the runtime uses it (its CLI is :mod:`specprefetch.stages.device`).
"""

from specprefetch._lazy import lazy_exports

_EXPORTS = {
    "ExpertCache": "cache", "SlotPool": "cache",
    "OffloadedExperts": "engine", "OffloadedRuntime": "engine", "RuntimeOptions": "engine",
    "PredictorPriority": "priority", "PreviousTokenPriority": "priority", "PriorityProvider": "priority",
    "fate_from_model": "priority", "provider_factories": "priority", "select_prefetch": "priority",
    "BandwidthModel": "storage", "ExpertReader": "storage", "FaultInjector": "storage", "make_profile": "storage",
    "ExpertStore": "store", "build_expert_store": "store", "find_moe_blocks": "store",
    "LayerEvent": "timeline", "RunStats": "timeline", "ready_recall_of": "timeline", "summarize": "timeline",
}

# Lazy exports: importing the package (e.g. for its config defaults) does not import torch.
_MODULES = {**{k: f"{__name__}.{v}" for k, v in _EXPORTS.items()},
            "POLICIES": "specprefetch.contracts", "STORAGES": "specprefetch.contracts"}
__getattr__, __all__ = lazy_exports(__name__, _MODULES)
