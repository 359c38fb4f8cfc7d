"""The ``device`` section of a profile (runtime benchmarks) as the runtime uses it.

Its defaults and checks are :func:`specprefetch.config.device_settings` (run by ``validate_config``, so
``validate-config``, the Snakefile and every job reject the same sections); this module adds what needs the machine
(the accelerator) or a model's size (the cache capacity).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specprefetch.config import cache_experts, device_settings, experiments_for
from specprefetch.io import SpecPrefetchError

__all__ = ["cache_capacity", "device_settings", "experiments_for", "platform_label",
           "resolve_accelerator", "variant_settings", "variants_for"]

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
    cap = cache_experts(d["cache"], total_experts)
    if cap < top_k:
        raise SpecPrefetchError(f"invalid config key 'device.cache': capacity {cap} experts < top_k={top_k}")
    return min(int(cap), total_experts)


def variant_settings(d: dict[str, Any], variant: str | None) -> dict[str, Any]:
    """The ``device`` section as variant ``variant`` of ``device.variants`` measures it (its emulation, I/O order and
    experiments over the default's); ``d`` itself for None."""
    if not variant:
        return d
    if variant not in d["variants"]:
        raise SpecPrefetchError(f"unknown device variant {variant!r}; device.variants has "
                                f"{', '.join(d['variants']) or 'none'}")
    return {**d, **d["variants"][variant]}


def variants_for(d: Mapping[str, Any], model: str) -> list[str]:
    """The variants that measure something of ``model``: those with an experiment among the model's own."""
    mine = set(experiments_for(d, model))
    return [name for name, v in d["variants"].items() if mine & set(v["experiments"])]


def variant_experiments(d: Mapping[str, Any], model: str, variant: str | None) -> list[str]:
    """The experiments ``model`` runs in ``variant`` (None: the default): the variant's, among the model's own."""
    mine = experiments_for(d, model)
    if not variant:
        return mine
    return [e for e in d["variants"][variant]["experiments"] if e in mine]
