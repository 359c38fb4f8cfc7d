"""Config validation: the three profiles pass; each kind of bad config fails with a message naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from specprefetch.config import ConfigError, budgets_for, load_config, resolve_budget, validate_config

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ["config/config.yaml", "config/smoke.yaml", "config/paper.yaml"]


@pytest.fixture(scope="module")
def default_cfg() -> dict:
    return yaml.safe_load((ROOT / "config/config.yaml").read_text())


@pytest.mark.parametrize("profile", PROFILES)
def test_profiles_are_valid(profile: str) -> None:
    cfg = load_config(ROOT / profile)
    assert cfg["models"] and cfg["workloads"]


@pytest.mark.parametrize("overlay", sorted(p.name for p in (ROOT / "config" / "overlays").glob("*.yaml")))
def test_overlays_extend_the_default(overlay: str) -> None:
    """config/overlays/*.yaml are overlays: merged over the embedded default the way Snakemake merges several
    --configfile files (key by key), each validates; alone none is a profile. precise.yaml turns on adaptive
    repeats."""
    def merge(base: dict, over: dict) -> dict:
        return {**base, **{k: merge(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in over.items()}}

    path = ROOT / "config" / "overlays" / overlay
    cfg = validate_config(merge(yaml.safe_load((ROOT / "config/config.yaml").read_text()),
                                yaml.safe_load(path.read_text())), ROOT)
    if overlay == "precise.yaml":
        d = cfg["device"]
        assert d["max_repeats"] > d["repeats"] and d["target_ci_pp"] == 2.0 and d["experiments"]
    with pytest.raises(ConfigError):
        load_config(path)


def test_paper_budgets_are_the_papers() -> None:
    cfg = load_config(ROOT / "config/paper.yaml")
    assert budgets_for(cfg, "qwen3-vl-30b-a3b") == [4, 8, 10]
    assert budgets_for(cfg, "deepseek-vl2-tiny") == [3, 6, 8]
    t = cfg["predictors"]["training"]
    assert (t["lr"], t["betas"], t["eps"], t["warmup_ratio"], t["max_grad_norm"], t["epochs"]) == (
        1e-4, [0.9, 0.999], 1e-8, 0.03, 0.5, 1)
    assert t["scheduler"] == "cosine" and t["precision"] == "bf16"
    assert {w["display_name"] for w in cfg["workloads"].values()} == {
        "GSM8K", "HumanEval", "OCRBench", "ChartQA-Test", "HallusionBench"}


def test_budget_expressions() -> None:
    assert [resolve_budget(b, 6) for b in ("K/2", "K", "K+2", "K-1", 5)] == [3, 6, 8, 5, 5]
    with pytest.raises(ConfigError, match="invalid budget"):
        resolve_budget("2K", 6)


def _mutate(cfg: dict, path: str, value) -> dict:
    cfg = copy.deepcopy(cfg)
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return cfg


_DELETE = object()

BAD = [
    # (key path, new value, text the error must contain)
    ("bogus_key", 1, "'bogus_key'"),
    ("models.tiny-qwen3-vl-moe.topk", 3, "models.tiny-qwen3-vl-moe.topk"),
    ("models.tiny-qwen3-vl-moe.top_k", 129, "models.tiny-qwen3-vl-moe.top_k"),
    ("models.tiny-qwen3-vl-moe.top_k", "eight", "models.tiny-qwen3-vl-moe.top_k"),
    ("models.tiny-deepseek-vl2.first_dense_layers", 11, "models.tiny-deepseek-vl2.first_dense_layers"),
    ("models.tiny-deepseek-vl2.pretrain", _DELETE, "models.tiny-deepseek-vl2.pretrain"),
    ("recall.budgets", [0], "recall.budgets[0]"),
    ("recall.budgets", ["K-8"], "recall.budgets[0]"),
    ("recall.extra_budgets", [200], "recall.extra_budgets[0]"),
    ("recall.candidates", "tokens", "recall.candidates"),
    ("traces.shard_tokens", 0, "traces.shard_tokens"),
    ("workloads.gsm8k.generator", "gsm9k", "workloads.gsm8k.generator"),
    ("workloads.gsm8k.n_samples", _DELETE, "workloads.gsm8k.n_samples"),
    ("predictors.methods", ["specprefetch", "magic"], "predictors.methods"),
    ("predictors.training.lr", -1.0, "predictors.training.lr"),
    ("predictors.training.deepspeed_config", "config/missing.json", "predictors.training.deepspeed_config"),
    # a fixed width (the default profile's size rule solves d_model in multiples of the heads)
    ("predictors.draft_model", {"num_layers": 2, "d_model": 128, "num_heads": 3}, "predictors.draft_model.num_heads"),
    ("workloads.gsm8k.generator", "local", "workloads.gsm8k.path"),
    ("device.max_repeats", 2, "device.max_repeats"),
    ("device.target_ci_pp", 0, "device.target_ci_pp"),
    ("render.kept_runs", ["docs/runs"], "render.kept_runs[0]"),  # a directory without comparison.json
    ("render.kept_runs", ["docs/runs/bb83649", "docs/runs/bb83649"], "render.kept_runs"),
]


@pytest.mark.parametrize(("path", "value", "expected"), BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_config_names_the_key(default_cfg: dict, path: str, value, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(_mutate(default_cfg, path, value), ROOT)
    assert expected in str(info.value), str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
