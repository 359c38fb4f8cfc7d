"""Offloaded MoE runtime with window-aware expert prefetching (paper §3.3, §4.4), its measurement and simulator.

Three groups, each a sub-package whose docstring lists its modules, importing downward only
(``tests/test_architecture.py``):

- :mod:`.core`: the runtime itself (expert store, storage, cache, transfer engine, priorities, the budget, the one
  per-layer loop, :class:`OffloadedRuntime`);
- :mod:`.measurement`: decoding with timestamps, the benchmark harness, the window profile, paired benchmarks, external
  device logs;
- :mod:`.simulation`: the trace-driven discrete-event simulator, the simulated platforms, validation against runs;

and beside them :mod:`.lm_eval_model`, the lm-eval client (model ``specprefetch-offloaded``) that runs a task's
generations through the runtime.
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
_MODULES = {**{k: f"{__name__}.core.{v}" for k, v in _EXPORTS.items()},
            "POLICIES": "specprefetch.contracts", "STORAGES": "specprefetch.contracts"}
__getattr__, __all__ = lazy_exports(__name__, _MODULES)
