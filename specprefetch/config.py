"""Load and validate a pipeline config (one YAML per profile).

Structure is checked against ``workflow/schemas/config.schema.yaml`` with ``snakemake.utils.validate``;
cross-field rules that a JSON schema cannot express are checked here. Every error names the key.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any


from specprefetch.contracts import EXPERIMENTS, POLICIES, SIM_PLATFORMS, STORAGES
from specprefetch.io import SpecPrefetchError

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"

# Model names of the methods, in the paper's order (tables and figures use this order and these names).
METHOD_LABELS = {
    "fate": "FATE",
    "draft_model": "Draft Model",
    "promoe": "ProMoE",
    "single_mlp": "Single MLP",
    "specprefetch": "SpecPrefetch",
    "previous_token": "Naive Prefetch",
    "frequency": "Frequency",
    "oracle": "Oracle",
}
LEARNED_METHODS = ("specprefetch", "single_mlp", "promoe", "draft_model")


class ConfigError(SpecPrefetchError):
    """The config is invalid; the message names the offending key."""


PAPER_EXPERT_MB = 1.94
# Emulated storage: sustained read bandwidth (MB/s) and per-request latency (ms) of phone-class devices.
DEFAULT_PROFILES: dict[str, dict[str, float]] = {
    "nvme": {"bandwidth_mbps": 3500.0, "latency_ms": 0.08},
    "ufs": {"bandwidth_mbps": 1700.0, "latency_ms": 0.15},
    "slow_ufs": {"bandwidth_mbps": 750.0, "latency_ms": 0.30},
    "sdcard": {"bandwidth_mbps": 90.0, "latency_ms": 1.00},
}

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
        raise ConfigError(f"invalid config key 'device.{sorted(unknown)[0]}': unknown key")
    if d["workload"] is None:
        d["workload"] = next(iter(cfg["workloads"]))
    elif d["workload"] not in cfg["workloads"]:
        raise ConfigError(f"invalid config key 'device.workload': {d['workload']!r} is not a workload")
    if d["models"] is None:
        d["models"] = list(cfg["models"])
    for m in d["models"]:
        if m not in cfg["models"]:
            raise ConfigError(f"invalid config key 'device.models': {m!r} is not a model of the profile")
    for key in ("reference_storage", "slow_storage"):
        if d[key] not in STORAGES:
            raise ConfigError(f"invalid config key 'device.{key}': {d[key]!r} (one of {', '.join(STORAGES)})")
    for s in d["storages"]:
        if s not in STORAGES:
            raise ConfigError(f"invalid config key 'device.storages': {s!r} (one of {', '.join(STORAGES)})")
    for e in d["experiments"]:
        if e not in EXPERIMENTS:
            raise ConfigError(f"invalid config key 'device.experiments': {e!r} ({', '.join(EXPERIMENTS)})")
    for m, exps in d["model_experiments"].items():
        if m not in d["models"]:
            raise ConfigError(f"invalid config key 'device.model_experiments.{m}': not one of device.models")
        for e in exps:
            if e not in EXPERIMENTS:
                raise ConfigError(f"invalid config key 'device.model_experiments.{m}': {e!r} "
                                        f"({', '.join(EXPERIMENTS)})")
    for key in ("main_policies", "matched_policies"):
        for p in d[key]:
            if p not in POLICIES:
                raise ConfigError(f"invalid config key 'device.{key}': {p!r} ({', '.join(POLICIES)})")
    if d["m_max"] != "auto" and (not isinstance(d["m_max"], int) or d["m_max"] < 0):
        raise ConfigError(f"invalid config key 'device.m_max': {d['m_max']!r} (auto or an integer >= 0)")
    if d["charge"] not in ("real", "paper", "calibrated"):
        raise ConfigError(f"invalid config key 'device.charge': {d['charge']!r} (real, paper or calibrated)")
    if d["accelerator"] not in ("cpu", "cuda", "auto"):
        raise ConfigError(f"invalid config key 'device.accelerator': {d['accelerator']!r}")
    for key in ("n_prompts", "max_new_tokens", "repeats", "threads", "io_workers"):
        if not isinstance(d[key], int) or d[key] < 1:
            raise ConfigError(f"invalid config key 'device.{key}': {d[key]!r} (an integer >= 1)")
    if d["max_new_tokens"] < 2:
        raise ConfigError("invalid config key 'device.max_new_tokens': decoding throughput needs >= 2 tokens")
    sim = d["simulator"]
    for w in sim["workloads"] or []:
        if w not in cfg["workloads"]:
            raise ConfigError(f"invalid config key 'device.simulator.workloads': {w!r} is not a workload")
    for p in sim["platforms"]:
        if p not in SIM_PLATFORMS:
            raise ConfigError(f"invalid config key 'device.simulator.platforms': {p!r} ({', '.join(SIM_PLATFORMS)})")
    for m in d["models"]:
        mc = cfg["models"][m]
        total, cap = n_moe_layers(mc) * mc["n_experts"], cache_experts(d["cache"], n_moe_layers(mc) * mc["n_experts"])
        if cap < mc["top_k"]:
            raise ConfigError(f"invalid config key 'device.cache': capacity {cap} experts (of {total}) < "
                              f"top_k={mc['top_k']} of model {m}; one token's experts must fit")
    return d


def cache_experts(cache: dict[str, Any], total_experts: int) -> int:
    """The cache capacity in experts: ``capacity_experts``, or ``capacity_fraction`` of all routed experts."""
    return int(cache.get("capacity_experts") or round(float(cache.get("capacity_fraction", 0.125)) * total_experts))


def _schema_error(exc: Exception) -> ConfigError:
    """Turn a jsonschema error (possibly wrapped by snakemake) into one line that names the key."""
    import jsonschema

    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, jsonschema.ValidationError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return ConfigError(f"invalid config: {exc}")
    err = cause
    # Prefer the most specific sub-error (oneOf / additionalProperties give vague top-level ones).
    best = jsonschema.exceptions.best_match([err]) if err.context is None else err
    key = ".".join(str(p) for p in best.absolute_path) or "<top level>"
    msg = best.message
    if best.validator == "additionalProperties":
        extra = re.findall(r"'([^']+)' was unexpected", msg)
        if extra:
            key = ".".join([*map(str, best.absolute_path), extra[0]]) if best.absolute_path else extra[0]
            msg = f"unknown key {extra[0]!r}"
    return ConfigError(f"invalid config key {key!r}: {msg}")


def validate_config(cfg: dict[str, Any], base_dir: Path | None = None) -> dict[str, Any]:
    """Validate ``cfg`` in place (schema, then semantics) and return it. Raises ConfigError."""
    if not isinstance(cfg, dict) or not cfg:
        raise ConfigError("invalid config: empty or not a mapping (pass --configfile config/config.yaml)")
    from snakemake.utils import validate

    try:
        validate(cfg, str(SCHEMA_PATH), set_default=False)
    except Exception as exc:  # snakemake wraps jsonschema's error in a WorkflowError
        raise _schema_error(exc) from None
    check_semantics(cfg, base_dir or REPO_ROOT)
    return cfg


def resolve_budget(expr: int | str, top_k: int) -> int:
    """'K/2' -> K//2, 'K' -> K, 'K+2' -> K+2, an integer -> itself."""
    if isinstance(expr, int):
        return expr
    m = re.fullmatch(r"K(?:(/2)|([+-]\d+))?", expr)
    if not m:
        raise ConfigError(f"invalid budget {expr!r}: use an integer or K, K/2, K+n, K-n")
    if m.group(1):
        return top_k // 2
    return top_k + int(m.group(2) or 0)


def budgets_for(cfg: dict[str, Any], model: str) -> list[int]:
    """The candidate budgets M evaluated for ``model`` (paper: {K/2, K, K+2}), plus extra budgets."""
    k = cfg["models"][model]["top_k"]
    out = [resolve_budget(b, k) for b in cfg["recall"]["budgets"]]
    out += [int(b) for b in cfg["recall"].get("extra_budgets", [])]
    return sorted(dict.fromkeys(out))


def n_moe_layers(model_cfg: dict[str, Any]) -> int:
    return model_cfg["num_hidden_layers"] - model_cfg.get("first_dense_layers", 0)


def trains_online(cfg: dict[str, Any]) -> bool:
    """Predictors learn with the frozen model in the loop (source: online), not from stored corpus traces."""
    return cfg["predictors"]["training"].get("source", "traces") == "online"


def check_semantics(cfg: dict[str, Any], base_dir: Path) -> None:
    """Cross-field checks: each failure names its key."""
    for name, m in cfg["models"].items():
        key = f"models.{name}"
        if m["top_k"] > m["n_experts"]:
            raise ConfigError(
                f"invalid config key '{key}.top_k': top_k={m['top_k']} is larger than n_experts={m['n_experts']}"
            )
        if n_moe_layers(m) < 2:
            raise ConfigError(
                f"invalid config key '{key}.first_dense_layers': leaves {n_moe_layers(m)} MoE layers; "
                "next-layer prediction needs at least 2"
            )
        if m["source"] == "stand_in":
            if "pretrain" not in m:
                raise ConfigError(f"invalid config key '{key}.pretrain': a stand_in model needs a pretrain section")
            if "tokenizer" not in cfg:
                raise ConfigError("invalid config key 'tokenizer': stand_in models need a tokenizer section")
            if m["arch"] not in ("qwen3_vl_moe", "deepseek_vl2_standin"):
                raise ConfigError(
                    f"invalid config key '{key}.arch': stand-ins exist for qwen3_vl_moe and deepseek_vl2_standin, "
                    f"not {m['arch']!r}"
                )
        if m["source"] == "hub" and "hub_id" not in m:
            raise ConfigError(f"invalid config key '{key}.hub_id': required when source is 'hub'")
        if m["source"] == "local":
            _check_path(m.get("path"), f"{key}.path", base_dir)
        if m["arch"] == "deepseek_vl2" and not m.get("trust_remote_code"):
            raise ConfigError(
                f"invalid config key '{key}.trust_remote_code': DeepSeek-VL2 runs its own repository code; "
                "opt in with trust_remote_code: true and a pinned revision"
            )
        if m.get("trust_remote_code") and not re.fullmatch(r"[0-9a-f]{40}", str(m.get("revision", ""))):
            raise ConfigError(
                f"invalid config key '{key}.revision': trust_remote_code runs the checkpoint repository's code, so "
                f"its revision must be a full 40-hex commit hash, not {m.get('revision')!r} (a branch or tag can "
                "move to other code)"
            )
        for i, b in enumerate(cfg["recall"]["budgets"]):
            value = resolve_budget(b, m["top_k"])
            if value < 1:
                raise ConfigError(
                    f"invalid config key 'recall.budgets[{i}]': {b!r} gives M={value} for model {name} (M must be >= 1)"
                )
            if value > m["n_experts"]:
                raise ConfigError(
                    f"invalid config key 'recall.budgets[{i}]': {b!r} gives M={value} > n_experts={m['n_experts']} "
                    f"for model {name}"
                )
        for i, b in enumerate(cfg["recall"].get("extra_budgets", [])):
            if not 1 <= b <= m["n_experts"]:
                raise ConfigError(
                    f"invalid config key 'recall.extra_budgets[{i}]': M={b} must be in [1, n_experts={m['n_experts']}]"
                )
    for name, w in cfg["workloads"].items():
        key = f"workloads.{name}"
        if w["generator"] == "hub" and "dataset" not in w:
            raise ConfigError(f"invalid config key '{key}.dataset': required when generator is 'hub'")
        if w["generator"] == "local":
            _check_path(w.get("path"), f"{key}.path", base_dir)
        if w["generator"] not in ("hub", "local") and "n_samples" not in w:
            raise ConfigError(f"invalid config key '{key}.n_samples': required for generator {w['generator']!r}")
        scatter = int(cfg["traces"].get("scatter", 1))
        if w.get("n_samples") is not None and scatter > int(w["n_samples"]):
            raise ConfigError(f"invalid config key 'traces.scatter': {scatter} shards for {w['n_samples']} samples "
                              f"of workload {name} (workloads.{name}.n_samples); each shard needs a sample")
    device = device_settings(cfg)
    for i, log_path in enumerate(device["external_logs"]):
        _check_path(log_path, f"device.external_logs[{i}]", base_dir)
    ds = cfg["predictors"]["training"].get("deepspeed_config")
    if ds:
        _check_path(ds, "predictors.training.deepspeed_config", base_dir)
    dm = cfg["predictors"].get("draft_model")
    if dm and dm["d_model"] % dm["num_heads"]:
        raise ConfigError(
            "invalid config key 'predictors.draft_model.num_heads': must divide d_model "
            f"({dm['d_model']} % {dm['num_heads']} != 0)"
        )


def _check_path(value: str | None, key: str, base_dir: Path) -> None:
    if not value:
        raise ConfigError(f"invalid config key '{key}': a path is required")
    p = Path(value)
    if not p.is_absolute():
        p = base_dir / p
    if not p.exists():
        raise ConfigError(f"invalid config key '{key}': file not found: {value}")


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and validate a config YAML file (duplicate keys, encodings and parse errors are one line)."""
    from specprefetch.contracts import ContractError, read_doc

    try:
        cfg = read_doc(path, None, "config file", kind="yaml")
    except ContractError as exc:
        raise ConfigError(str(exc)) from None
    return validate_config(cfg, REPO_ROOT)
