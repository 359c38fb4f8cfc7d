"""The ``device`` section of a profile (runtime benchmarks), with defaults for every key.

The section is optional: a profile without it runs the runtime with these defaults (the embedded default's
numbers). ``config_fragment.yaml`` next to this file holds the YAML and JSON-schema fragment of the section.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.constants import DEFAULT_PROFILES, EXPERIMENTS, POLICIES, STORAGES

DEVICE_DEFAULTS: dict[str, Any] = {
    "platform": None,              # label in runs.csv; None: "local-cpu" / "local-cuda"
    "accelerator": "cpu",          # cpu, cuda or auto
    "models": None,                # None: every model of the profile
    "workload": None,              # prompts for decoding; None: the profile's first workload
    "n_prompts": 4,
    "max_prompt_tokens": 128,
    "max_new_tokens": 32,
    "repeats": 3,
    "threads": 1,                  # torch intra-op threads of the measured process
    "io_workers": 4,
    "io_retries": 2,
    "cache": {"capacity_experts": None, "capacity_fraction": 0.125},
    "reference_storage": "nvme_cold",
    "slow_storage": "slow_ufs",
    "storages": ["nvme_cold", "nvme", "ufs", "slow_ufs", "sdcard"],
    "storage_profiles": copy.deepcopy(DEFAULT_PROFILES),
    "cold_each_read": True,
    "charge": "calibrated",        # real, paper or calibrated (see runtime.storage)
    "paper_expert_mb": 1.94,
    "calibrate_ratio": 8.0,        # calibrated: profiled window / emulated-NVMe transfer (paper: M_max = 8)
    "m_max": "auto",               # auto: from the profiled window, or an integer
    "sweep_m_max": [1, 2, 4, 6, 8, 12, 16],
    "experiments": list(EXPERIMENTS),
    "model_experiments": {},       # model -> its own experiments (e.g. only "main" for a model no table shows)
    "main_policies": ["off", "pred0", "specprefetch", "naive", "fate", "resident"],
    "matched_policies": ["off", "naive", "specprefetch", "fate"],
    "window": {"n_prompts": 2, "demand_m": [2, 4, 8], "transfer_samples": 64},
    "simulator": {"platforms": ["snapdragon_8_elite"], "workloads": None, "max_samples": 16},
    "accuracy": {"policies": ["off", "pred0", "specprefetch", "naive", "fate", "resident"], "limit": 8,
                 "tasks": None, "max_gen_toks": 32},
    "external_logs": [],
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def device_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The profile's ``device`` section over the defaults, checked (errors name the key)."""
    d = _merge(DEVICE_DEFAULTS, cfg.get("device") or {})
    unknown = set(d) - set(DEVICE_DEFAULTS)
    if unknown:
        raise SpecPrefetchError(f"invalid config key 'device.{sorted(unknown)[0]}': unknown key")
    if d["workload"] is None:
        d["workload"] = next(iter(cfg["workloads"]))
    elif d["workload"] not in cfg["workloads"]:
        raise SpecPrefetchError(f"invalid config key 'device.workload': {d['workload']!r} is not a workload")
    if d["models"] is None:
        d["models"] = list(cfg["models"])
    for m in d["models"]:
        if m not in cfg["models"]:
            raise SpecPrefetchError(f"invalid config key 'device.models': {m!r} is not a model of the profile")
    for key in ("reference_storage", "slow_storage"):
        if d[key] not in STORAGES:
            raise SpecPrefetchError(f"invalid config key 'device.{key}': {d[key]!r} (one of {', '.join(STORAGES)})")
    for s in d["storages"]:
        if s not in STORAGES:
            raise SpecPrefetchError(f"invalid config key 'device.storages': {s!r} (one of {', '.join(STORAGES)})")
    for e in d["experiments"]:
        if e not in EXPERIMENTS:
            raise SpecPrefetchError(f"invalid config key 'device.experiments': {e!r} ({', '.join(EXPERIMENTS)})")
    for m, exps in d["model_experiments"].items():
        if m not in d["models"]:
            raise SpecPrefetchError(f"invalid config key 'device.model_experiments.{m}': not one of device.models")
        for e in exps:
            if e not in EXPERIMENTS:
                raise SpecPrefetchError(f"invalid config key 'device.model_experiments.{m}': {e!r} "
                                        f"({', '.join(EXPERIMENTS)})")
    for key in ("main_policies", "matched_policies"):
        for p in d[key]:
            if p not in POLICIES:
                raise SpecPrefetchError(f"invalid config key 'device.{key}': {p!r} ({', '.join(POLICIES)})")
    if d["m_max"] != "auto" and (not isinstance(d["m_max"], int) or d["m_max"] < 0):
        raise SpecPrefetchError(f"invalid config key 'device.m_max': {d['m_max']!r} (auto or an integer >= 0)")
    if d["charge"] not in ("real", "paper", "calibrated"):
        raise SpecPrefetchError(f"invalid config key 'device.charge': {d['charge']!r} (real, paper or calibrated)")
    if d["accelerator"] not in ("cpu", "cuda", "auto"):
        raise SpecPrefetchError(f"invalid config key 'device.accelerator': {d['accelerator']!r}")
    for key in ("n_prompts", "max_new_tokens", "repeats", "threads", "io_workers"):
        if not isinstance(d[key], int) or d[key] < 1:
            raise SpecPrefetchError(f"invalid config key 'device.{key}': {d[key]!r} (an integer >= 1)")
    if d["max_new_tokens"] < 2:
        raise SpecPrefetchError("invalid config key 'device.max_new_tokens': decoding throughput needs >= 2 tokens")
    return d


def resolve_accelerator(d: dict[str, Any], override: str | None = None) -> str:
    """'cpu' or 'cuda' (auto: cuda when available)."""
    import torch

    want = override or d["accelerator"]
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise SpecPrefetchError("device.accelerator is 'cuda' but torch sees no CUDA device")
    return want


def platform_label(d: dict[str, Any], accelerator: str) -> str:
    return d["platform"] or f"local-{accelerator}"


def cache_capacity(d: dict[str, Any], total_experts: int, top_k: int) -> int:
    """Cache capacity in experts: ``capacity_experts`` or ``capacity_fraction`` of all routed experts."""
    c = d["cache"]
    cap = c.get("capacity_experts") or int(round(float(c.get("capacity_fraction", 0.125)) * total_experts))
    if cap < top_k:
        raise SpecPrefetchError(f"invalid config key 'device.cache': capacity {cap} experts < top_k={top_k}")
    return min(int(cap), total_experts)


def experiments_for(d: Mapping[str, Any], model: str) -> list[str]:
    """The benchmark experiments of ``model``: ``device.model_experiments[model]``, else ``device.experiments``."""
    return list(d["model_experiments"].get(model, d["experiments"]))
