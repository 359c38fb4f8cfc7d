"""Words for captions: which profile and which models produced a table or figure.

A reader of a table must never mistake the embedded default's CPU stand-ins for the paper's checkpoints, so every
caption and comparison says where its numbers come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specprefetch.config import n_moe_layers

PROFILE_NAMES = {"embedded": "embedded default", "smoke": "smoke test", "paper": "paper"}


def profile_name(cfg: Mapping[str, Any]) -> str:
    return PROFILE_NAMES.get(cfg["profile"], str(cfg["profile"]))


def model_display(cfg: Mapping[str, Any], model: str) -> str:
    return str(cfg["models"][model]["display_name"])


def model_shape(m: Mapping[str, Any]) -> str:
    """E.g. '64 routed + 2 shared experts, top-6, 11 MoE layers, hidden 128'."""
    experts = f"{m['n_experts']} routed + {m['n_shared_experts']} shared experts" if m.get("n_shared_experts") \
        else f"{m['n_experts']} experts"
    return f"{experts}, top-{m['top_k']}, {n_moe_layers(dict(m))} MoE layers, hidden {m['hidden_size']}"


def models_phrase(cfg: Mapping[str, Any], models: list[str] | None = None) -> str:
    """What produced the numbers, e.g. 'tiny stand-ins mirroring Qwen3-VL-30B-A3B (...) / DeepSeek-VL2-Tiny (...)'."""
    names = models if models is not None else list(cfg["models"])
    stand_ins = [m for m in names if cfg["models"][m]["source"] == "stand_in"]
    parts = []
    for m in names:
        mc = cfg["models"][m]
        if mc["source"] == "stand_in":
            parts.append(f"{mc['display_name']} ({model_shape(mc)})")
        elif mc["source"] == "hub":
            rev = f"@{mc['revision']}" if mc.get("revision") else ""
            parts.append(f"{mc.get('hub_id', m)}{rev}")
        else:
            parts.append(f"{mc['display_name']} (local checkpoint {mc.get('path', m)})")
    joined = " / ".join(parts)
    if stand_ins and len(stand_ins) == len(names):
        return f"tiny stand-ins mirroring {joined}, trained by the pipeline"
    return joined


def profile_sentence(cfg: Mapping[str, Any], models: list[str] | None = None) -> str:
    """One plain-text sentence for captions and reports (escape it for LaTeX)."""
    text = f"Profile: {profile_name(cfg)}: {models_phrase(cfg, models)}."
    if cfg["profile"] == "smoke":
        text += " Seconds-scale models: the numbers test the pipeline, not the method."
    elif cfg["profile"] != "paper":
        text += " Not the paper's checkpoints: compare directions, not values."
    return text
