"""Load and validate a pipeline config (one YAML per profile).

Structure is checked against ``workflow/schemas/config.schema.yaml`` (jsonschema, defaults filled in), its
vocabulary enums (methods, storages, policies, platforms, workload generators) filled from ``specprefetch.registry``
so an installed predictor plugin is accepted; cross-field rules that a JSON schema cannot express are checked here.
Every error names the key.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from specprefetch import registry
from specprefetch.contracts import EXPERIMENTS
from specprefetch.io import SpecPrefetchError
from specprefetch.registry import NameView, TableView

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"

# Display names of the methods (tables and figures use this order and these names) and the trained ones: live views
# of specprefetch.registry, plugins included.
METHOD_LABELS: Mapping[str, str] = TableView(lambda: {n: m.label for n, m in registry.methods().items()},
                                             "predictor method")
LEARNED_METHODS: Sequence[str] = NameView(lambda: [n for n, m in registry.methods().items() if m.learned],
                                          "learned method")


class ConfigError(SpecPrefetchError):
    """The config is invalid; the message names the offending key."""


def device_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``device`` section, resolved: the schema's defaults are in (``validate_config``), ``models`` and
    ``workload`` name the profile's when left null, and the cross-field rules hold (errors name the key).

    Resolving is idempotent, so a job that validates the resolved config the Snakefile wrote gets the same section.
    """
    d = cfg["device"]
    if d["workload"] is None:
        d["workload"] = next(iter(cfg["workloads"]))
    elif d["workload"] not in cfg["workloads"]:
        raise ConfigError(f"invalid config key 'device.workload': {d['workload']!r} is not a workload")
    if d["models"] is None:
        d["models"] = list(cfg["models"])
    for m in d["models"]:
        if m not in cfg["models"]:
            raise ConfigError(f"invalid config key 'device.models': {m!r} is not a model of the profile")
    for m, exps in d["model_experiments"].items():
        if m not in d["models"]:
            raise ConfigError(f"invalid config key 'device.model_experiments.{m}': not one of device.models")
        for e in exps:
            if e not in EXPERIMENTS:
                raise ConfigError(f"invalid config key 'device.model_experiments.{m}': {e!r} "
                                  f"({', '.join(EXPERIMENTS)})")
    for st in d["sweep_storages"] or []:
        if st not in d["storages"] and st != d["reference_storage"]:
            raise ConfigError(f"invalid config key 'device.sweep_storages': {st!r} is not one of device.storages "
                              "(a storage is swept at its own profiled budget)")
    if d["extra_rules"] and (d["m_max"] != "auto" or d["budget_rule"] != "window"):
        raise ConfigError("invalid config key 'device.extra_rules': the extra rules start from the window "
                          f"rule's budgets, so they need device.m_max: auto and device.budget_rule: window (got "
                          f"{d['m_max']!r} and {d['budget_rule']!r})")
    ahead = d["lookahead"]
    for st in ahead["storages"]:
        if st not in d["storages"] and st not in (d["reference_storage"], d["slow_storage"]):
            raise ConfigError(f"invalid config key 'device.lookahead.storages': {st!r} is not one of device.storages "
                              "(each storage prefetches d layers ahead at its own profiled window)")
    if any("lookahead" in exps for exps in [d["experiments"], *d["model_experiments"].values()]):
        trained = cfg["predictors"].get("lookahead") or {}
        missing = [dd for dd in ahead["distances"] if dd != 1 and dd not in (trained.get("distances") or [])]
        if missing or (set(ahead["distances"]) - {1} and "specprefetch" not in (trained.get("methods") or [])):
            raise ConfigError("invalid config key 'device.lookahead.distances': the lookahead experiment runs "
                              f"SpecPrefetch at d = {ahead['distances']}, but predictors.lookahead does not train "
                              f"specprefetch at d = {missing or sorted(set(ahead['distances']) - {1})}")
    for st in d["batch"]["storages"]:
        if st not in d["storages"] and st not in (d["reference_storage"], d["slow_storage"]):
            raise ConfigError(f"invalid config key 'device.batch.storages': {st!r} is not one of device.storages "
                              "(each storage decodes a batch at its own profiled window)")
    pre = [m for m, mc in d["model_experiments"].items() if "pre_attention" in mc] + \
        (["every model"] if "pre_attention" in d["experiments"] else [])
    if pre and "pre_attention" not in cfg["predictors"]["methods"]:
        raise ConfigError(f"invalid config key 'device.experiments': the pre_attention experiment ({', '.join(pre)}) "
                          "prefetches with the pre_attention predictor, which predictors.methods does not train")
    for name, v in d["variants"].items():
        if all(v.get(k, d[k]) == d[k] for k in ("emulation", "io_order")):
            raise ConfigError(f"invalid config key 'device.variants.{name}': it measures what the default does "
                              f"(emulation {d['emulation']!r}, io_order {d['io_order']!r}); give another emulation "
                              "or io_order")
    for m, sc in d["paper_scale"].items():
        if m not in cfg["models"]:
            raise ConfigError(f"invalid config key 'device.paper_scale.{m}': {m!r} is not a model of the profile")
        mc = cfg["models"][m]
        if mc.get("hidden_size") and int(mc["hidden_size"]) > sc["hidden_size"]:
            raise ConfigError(f"invalid config key 'device.paper_scale.{m}.hidden_size': {sc['hidden_size']} is "
                              f"narrower than the model's hidden_size {mc['hidden_size']}")
    if d["max_repeats"] is not None and d["max_repeats"] < d["repeats"]:
        raise ConfigError(f"invalid config key 'device.max_repeats': {d['max_repeats']} is fewer than "
                          f"device.repeats ({d['repeats']}), the repeats every block measures")
    sim = d["simulator"]
    for w in sim["workloads"] or []:
        if w not in cfg["workloads"]:
            raise ConfigError(f"invalid config key 'device.simulator.workloads': {w!r} is not a workload")
    for m in d["models"]:
        mc = cfg["models"][m]
        total, cap = n_moe_layers(mc) * mc["n_experts"], cache_experts(d["cache"], n_moe_layers(mc) * mc["n_experts"])
        if cap < mc["top_k"]:
            raise ConfigError(f"invalid config key 'device.cache': capacity {cap} experts (of {total}) < "
                              f"top_k={mc['top_k']} of model {m}; one token's experts must fit")
    return d


def device_experiments(cfg: Mapping[str, Any]) -> set[str]:
    """The runtime experiments some model of ``device.models`` runs: its ``device.model_experiments`` entry, else
    ``device.experiments`` (``runtime.core.settings.experiments_for`` per model), the schema's defaults for keys a
    config leaves out (a bare ``{}`` runs the default's). Decides the figures that exist only with an experiment
    beyond the default (``render.targets.figure_names``); reads the config without resolving it."""
    d = {**section_defaults("device"), **(cfg.get("device") or {})}
    d["model_experiments"] = d["model_experiments"] or {}
    models = d["models"] or list(cfg.get("models") or {}) or [*d["model_experiments"], None]  # None: no own list
    return {e for m in models for e in experiments_for(d, m)}


def experiments_for(d: Mapping[str, Any], model: str | None) -> list[str]:
    """The benchmark experiments of ``model``: ``device.model_experiments[model]``, else ``device.experiments``."""
    return list(d["model_experiments"].get(model, d["experiments"]))


def cache_experts(cache: dict[str, Any], total_experts: int) -> int:
    """The cache capacity in experts: ``capacity_experts``, or ``capacity_fraction`` of all routed experts."""
    return int(cache["capacity_experts"] or round(float(cache["capacity_fraction"]) * total_experts))


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
    """Validate ``cfg`` in place and return it, resolved: the schema (which fills in every default it declares),
    then the semantics (which also resolves the device section). Raises ConfigError naming the key.

    After this, code reads ``cfg[...]`` directly: every optional key has its value, from the file or the schema.
    """
    if not isinstance(cfg, dict) or not cfg:
        raise ConfigError("invalid config: empty or not a mapping (pass --configfile config/config.yaml)")
    try:
        schema = _schema()
    except registry.RegistryError as exc:  # an installed plugin that cannot be registered
        raise ConfigError(f"invalid predictor plugin: {exc}") from None
    _check_with_defaults(cfg, schema)
    check_semantics(cfg, base_dir or REPO_ROOT)
    return cfg


def section_defaults(name: str, value: dict[str, Any] | None = None) -> dict[str, Any]:
    """``value`` (default: empty) validated against the schema's ``$defs/<name>`` with its defaults filled in:
    a section as a job sees it, for code and tests that build one without a whole config (e.g. ``device``)."""
    schema = _schema()
    out = copy.deepcopy(value) if value is not None else {}
    _check_with_defaults(out, {"$defs": schema["$defs"], "$ref": f"#/$defs/{name}"})
    return out


# Where each vocabulary's enum sits in the schema (a path of keys); config._schema fills them from the registry and
# tests/test_registry.py checks that the file's literal enums are the registry's built-ins.
SCHEMA_ENUMS: dict[str, tuple[tuple[str, ...], ...]] = {
    "methods": (("properties", "predictors", "properties", "methods", "items", "enum"),),
    "storages": (("$defs", "storage", "enum"),),
    "policies": (("$defs", "policy", "enum"),),
    "platforms": (("$defs", "device", "properties", "simulator", "properties", "platforms", "items", "enum"),),
    "workload_generators": (("$defs", "workload", "properties", "generator", "enum"),),
    "corpus_sources": (("properties", "train_corpus", "properties", "mixture", "propertyNames", "enum"),),
    "experiments": (("$defs", "device", "properties", "experiments", "items", "enum"),
                    ("$defs", "device", "properties", "model_experiments", "additionalProperties", "items", "enum")),
    "budget_rules": (("$defs", "device", "properties", "extra_rules", "items", "enum"),),
}
STORAGE_PROFILES_PATH = ("$defs", "device", "properties", "storage_profiles", "properties")


def vocabularies(plugins: bool = True) -> dict[str, list[str]]:
    """The registry's names for each schema enum (``plugins=False``: the built-ins the schema file spells out)."""
    methods = list(registry.method_names()) if plugins else [m.name for m in registry.BUILTIN_METHODS]
    policies = list(registry.policies()) if plugins else [p.name for p in registry.BUILTIN_POLICIES]
    return {"methods": methods, "storages": list(registry.storages()), "policies": policies,
            "platforms": list(registry.PLATFORMS), "workload_generators": list(registry.WORKLOAD_GENERATORS),
            "corpus_sources": list(registry.CORPUS_SOURCES), "experiments": list(EXPERIMENTS),
            "budget_rules": list(registry.EXTRA_BUDGET_RULES)}


def storage_profile_defaults() -> dict[str, Any]:
    """The schema's ``device.storage_profiles`` properties: one per emulated storage, its registry numbers the
    default."""
    return {s.name: {"$ref": "#/$defs/storage_profile",
                     "default": {"bandwidth_mbps": s.bandwidth_mbps, "latency_ms": s.latency_ms}}
            for s in registry.storages().values() if s.emulated}


def schema_node(schema: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = schema
    for key in path:
        node = node[key]
    return node


def _schema() -> dict[str, Any]:
    """The schema file with its vocabulary enums filled from the registry (plugins included): rebuilt when the
    registry is refreshed."""
    key = registry._generation  # noqa: SLF001 - the registry's cache generation keys this derived table
    if _SCHEMA_CACHE.get("generation") != key:
        schema = copy.deepcopy(_schema_file())
        for name, names in vocabularies().items():
            for path in SCHEMA_ENUMS[name]:
                schema_node(schema, path[:-1])[path[-1]] = list(names)
        schema_node(schema, STORAGE_PROFILES_PATH[:-1])[STORAGE_PROFILES_PATH[-1]] = storage_profile_defaults()
        section = schema_node(schema, ("properties", "predictors", "properties"))
        for name in registry.method_names():  # a plugin's own config block: its predictor checks its keys
            section.setdefault(name, {"type": "object"})
        _SCHEMA_CACHE.update(generation=key, schema=schema)
    return _SCHEMA_CACHE["schema"]


_SCHEMA_CACHE: dict[str, Any] = {}


@functools.cache
def _schema_file() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _check_with_defaults(instance: Any, schema: dict[str, Any]) -> None:
    """jsonschema validation that also sets each absent property's ``default`` (a copy) before descending, so
    nested sections get theirs: the standard extension of the ``properties`` keyword."""
    import jsonschema
    from jsonschema import Draft202012Validator, validators

    def set_defaults(validator: Any, properties: dict[str, Any], inst: Any, sub: dict[str, Any]) -> Any:
        if isinstance(inst, dict):
            for prop, subschema in properties.items():
                if isinstance(subschema, dict) and "default" in subschema:
                    inst.setdefault(prop, copy.deepcopy(subschema["default"]))
        yield from Draft202012Validator.VALIDATORS["properties"](validator, properties, inst, sub)

    filling = validators.extend(Draft202012Validator, {"properties": set_defaults})
    try:
        filling(schema).validate(instance)
    except jsonschema.ValidationError as exc:
        raise _schema_error(exc) from None


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
    out += [int(b) for b in cfg["recall"]["extra_budgets"]]
    return sorted(dict.fromkeys(out))


def n_moe_layers(model_cfg: dict[str, Any]) -> int:
    return model_cfg["num_hidden_layers"] - model_cfg["first_dense_layers"]


def trains_online(cfg: dict[str, Any]) -> bool:
    """Predictors learn with the frozen model in the loop (source: online), not from stored corpus traces."""
    return cfg["predictors"]["training"]["source"] == "online"


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
        for i, b in enumerate(cfg["recall"]["extra_budgets"]):
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
        scatter = int(cfg["traces"]["scatter"])
        if w.get("n_samples") is not None and scatter > int(w["n_samples"]):
            raise ConfigError(f"invalid config key 'traces.scatter': {scatter} shards for {w['n_samples']} samples "
                              f"of workload {name} (workloads.{name}.n_samples); each shard needs a sample")
    if cfg["traces"]["mode"] == "generate" and cfg["traces"]["max_new_tokens"] < 1:
        raise ConfigError("invalid config key 'traces.max_new_tokens': generate mode decodes at least one token")
    for i, run in enumerate(cfg["render"].get("kept_runs", [])):
        _check_path(str(Path(run) / "comparison.json"), f"render.kept_runs[{i}]", base_dir)
    device = device_settings(cfg)
    for i, log_path in enumerate(device["external_logs"]):
        _check_path(log_path, f"device.external_logs[{i}]", base_dir)
    ds = cfg["predictors"]["training"].get("deepspeed_config")
    if ds:
        _check_path(ds, "predictors.training.deepspeed_config", base_dir)
    for method in LEARNED_METHODS:  # <key>_per_model: {model: value} overrides <key> for the models it names
        for key, table in (cfg["predictors"].get(method) or {}).items():
            unknown = sorted(set(table) - set(cfg["models"])) if key.endswith("_per_model") else []
            if unknown:
                raise ConfigError(f"invalid config key 'predictors.{method}.{key}': unknown model(s) "
                                  f"{', '.join(unknown)} (models: {', '.join(cfg['models'])})")
    ahead = cfg["predictors"]["lookahead"]["methods"]
    if set(ahead) - set(cfg["predictors"]["methods"]):
        raise ConfigError(f"invalid config key 'predictors.lookahead.methods': "
                          f"{', '.join(m for m in ahead if m not in cfg['predictors']['methods'])} not in "
                          f"predictors.methods (a look-ahead method's d = 1 is its Table 1 predictor)")
    if "pre_attention" in cfg["predictors"]["methods"] and not cfg["traces"]["pre_attention"]:
        raise ConfigError("invalid config key 'traces.pre_attention': the pre_attention method (predictors.methods) "
                          "reads each layer's pre-attention input, which the traces store only with "
                          "traces.pre_attention: true")
    if "pre_attention" in ahead:
        raise ConfigError("invalid config key 'predictors.lookahead.methods': pre_attention predicts a layer from its "
                          "own pre-attention input; it has no look-ahead distance")
    dm = cfg["predictors"].get("draft_model")
    for name in cfg["models"] if dm and "size" not in dm else ():  # a size rule solves d_model in heads' multiples
        d_model = (dm.get("d_model_per_model") or {}).get(name, dm["d_model"])
        heads = (dm.get("num_heads_per_model") or {}).get(name, dm["num_heads"])
        if d_model % heads:
            raise ConfigError(f"invalid config key 'predictors.draft_model.num_heads': must divide d_model for "
                              f"model {name} ({d_model} % {heads} != 0)")


def _check_path(value: str | None, key: str, base_dir: Path) -> None:
    if not value:
        raise ConfigError(f"invalid config key '{key}': a path is required")
    from specprefetch.contracts import excerpt, path_problem

    p = Path(value)
    if not p.is_absolute():
        p = base_dir / p
    why = path_problem(p)  # stat only: an over-long path, a loop or a FIFO is one line, nothing is opened
    if why is not None and why != "is a directory":  # a local model is a directory
        raise ConfigError(f"invalid config key '{key}': {'file not found' if why == 'not found' else why}: "
                          f"{excerpt(value) if len(value) > 200 else value}")


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and validate a config YAML file (duplicate keys, encodings and parse errors are one line)."""
    from specprefetch.contracts import ContractError, read_doc

    try:
        cfg = read_doc(path, None, "config file", kind="yaml")
    except ContractError as exc:
        raise ConfigError(str(exc)) from None
    return validate_config(cfg, REPO_ROOT)
