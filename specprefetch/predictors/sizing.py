"""How many and how large the learned predictors are: ``predictors.seeds`` and the size rules.

Seeds: every learned predictor is trained ``predictors.seeds`` times (absent: once), seed index k with
``training.seed + k`` (data order and initial weights), so seed 0 is the single-seed predictor; training-free
methods are deterministic and have seed 0 only.

Baselines at the paper's relative sizes: ``predictors.<method>.size: {match: paper_ratio}``.

The paper's Table 3 fixes each learned baseline's trainable parameters *relative to SpecPrefetch's* per model
(ProMoE 32x SpecPrefetch on Qwen3-VL, 20x on DeepSeek-VL2, ...). At stand-in scale the absolute counts cannot match,
but the ratios can: with the rule, a baseline's width (ProMoE's and the Single MLP's ``hidden``, the Draft Model's
``d_model``) is solved per model so that ``params(method) / params(specprefetch)`` is the paper's ratio for the
model's ``display_name``. The counts are the predictors' own ``trainable_params`` at the model's shapes (exact: each
count is a polynomial of degree <= 2 in the width, fitted on three built widths and checked on the chosen one).
What is left of the ratio is the rule's residual, recorded in the predictor's meta.json and printed by Table 3.
A rule that cannot be met (the ratio needs a width below the smallest one, a model the paper's table lacks, a
method without a width) is one line naming the key.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specprefetch.config import METHOD_LABELS, REPO_ROOT
from specprefetch.contracts import read_doc
from specprefetch.io import SpecPrefetchError

if TYPE_CHECKING:
    from specprefetch.predictors.base import PredictorDims

PAPER_REPORTED = REPO_ROOT / "config" / "reference" / "paper_reported.yaml"
RULES = ("paper_ratio",)
ANCHOR = "specprefetch"
# method -> (the width key the rule sets, the per-model table it replaces)
WIDTH_KEYS = {"promoe": "hidden", "single_mlp": "hidden", "draft_model": "d_model"}


class SizeRuleError(SpecPrefetchError):
    """A size rule that cannot be met; the message names the key."""


def seed_count(cfg: Mapping[str, Any]) -> int:
    """``predictors.seeds`` (absent: 1); anything but an integer >= 1 is one line naming the key."""
    n = (cfg.get("predictors") or {}).get("seeds", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SpecPrefetchError(f"invalid predictors.seeds {n!r}: an integer >= 1 (how many seeds each learned "
                                "predictor is trained with)")
    return n


def seed_indices(cfg: Mapping[str, Any], learned: bool) -> list[int]:
    """The seed indices a method is trained with: 0..seeds-1 when learned, [0] when training-free."""
    return list(range(seed_count(cfg))) if learned else [0]


@functools.cache
def _paper_params(path: str) -> dict[str, dict[str, float]]:
    """Table 3 of the paper: display name -> method label -> millions of trainable parameters."""
    doc = read_doc(Path(path), None, "paper's reported numbers", kind="yaml")
    try:
        values = doc["tables"]["table3_params"]["values"]
        return {str(m): {str(k): float(v) for k, v in row.items()} for m, row in values.items()}
    except (KeyError, TypeError, AttributeError, ValueError):
        raise SizeRuleError(f"{path}: no tables.table3_params.values (model -> method -> parameters)") from None


def paper_ratio(display_name: str, method: str, path: Path = PAPER_REPORTED) -> float:
    """The paper's ``params(method) / params(specprefetch)`` for the model shown as ``display_name``."""
    table = _paper_params(str(path))
    if display_name not in table:
        raise SizeRuleError(f"predictors.{method}.size: the paper's Table 3 has no model {display_name!r} "
                            f"(models.*.display_name; it has {', '.join(table)})")
    row = table[display_name]
    label, anchor = METHOD_LABELS[method], METHOD_LABELS[ANCHOR]
    if label not in row or not row.get(anchor):
        raise SizeRuleError(f"predictors.{method}.size: the paper's Table 3 has no {label!r} and {anchor!r} "
                            f"for {display_name!r}")
    return row[label] / row[anchor]


def _count(method: str, dims: PredictorDims, method_cfg: Mapping[str, Any]) -> int:
    """Trainable parameters of ``method`` built at ``dims`` with ``method_cfg`` (weights are not used)."""
    from specprefetch.predictors.base import predictor_class

    return predictor_class(method)(dims, dict(method_cfg)).trainable_params()


def rule_of(cfg: Mapping[str, Any], method: str) -> str | None:
    """The method's size rule (``predictors.<method>.size.match``), None without one; a bad one is an error."""
    section = (cfg.get("predictors") or {}).get(method) or {}
    size = section.get("size")
    if size is None:
        return None
    where = f"predictors.{method}.size"
    if method == ANCHOR:
        raise SizeRuleError(f"{where}: SpecPrefetch is the anchor of the ratios; size it with its rank")
    if method not in WIDTH_KEYS:
        raise SizeRuleError(f"{where}: {method} has no width to solve (only {', '.join(WIDTH_KEYS)})")
    if not isinstance(size, Mapping) or size.get("match") not in RULES:
        raise SizeRuleError(f"{where}: {size!r} is not a size rule (use {{match: paper_ratio}})")
    return str(size["match"])


def _step(method: str, cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(smallest width, width step): the Draft Model's width must be a multiple of its heads."""
    if method == "draft_model":
        heads = int(cfg.get("num_heads", 4))
        return heads * math.ceil(8 / heads), heads  # the schema's smallest d_model is 8
    return 1, 1


def solve_width(cfg: Mapping[str, Any], method: str, model: str, dims: PredictorDims) -> tuple[dict[str, Any],
                                                                                              dict[str, Any]]:
    """The method's config for ``model`` with the rule's width, and the rule's record (target and achieved ratio,
    residual). Without a rule: the config as ``method_config`` resolves it and an empty record."""
    from specprefetch.predictors.base import method_config

    base = method_config(cfg, method, model)
    if rule_of(cfg, method) is None:
        return base, {}
    key = WIDTH_KEYS[method]
    where = f"predictors.{method}.size"
    mcfg = cfg["models"][model]
    target = paper_ratio(str(mcfg.get("display_name", model)), method)
    anchor = _count(ANCHOR, dims, method_config(cfg, ANCHOR, model))
    base.pop("size", None)
    lo, step = _step(method, base)

    def at(width: int) -> int:
        return _count(method, dims, {**base, key: width})

    # params(w) = a w^2 + b w + c exactly (linear for the MLPs): fit on three widths, solve for the target count
    w0, w1, w2 = lo, lo + step, lo + 2 * step
    p0, p1, p2 = at(w0), at(w1), at(w2)
    d1, d2 = (p1 - p0) / step, (p2 - p1) / step
    a = (d2 - d1) / (2 * step)
    b = d1 - a * (w0 + w1)
    c = p0 - a * w0 * w0 - b * w0
    goal = target * anchor
    if a > 0:
        disc = b * b - 4 * a * (c - goal)
        w = (-b + math.sqrt(disc)) / (2 * a) if disc >= 0 else -math.inf
    else:
        w = (goal - c) / b
    if w < lo:  # the continuous solution is below the smallest width: no width meets the ratio
        raise SizeRuleError(f"{where}: the paper's ratio {target:.3g}x SpecPrefetch's {anchor} parameters for {model} "
                            f"needs {key} = {w:.3g} < {lo} ({key} {lo} already gives {p0 / anchor:.3g}x)")
    cands = {max(lo, int(math.floor(w / step)) * step), max(lo, int(math.ceil(w / step)) * step)}
    counts = {cw: at(cw) for cw in sorted(cands)}
    width = min(counts, key=lambda cw: (abs(math.log(counts[cw] / goal)), cw))
    achieved = counts[width] / anchor
    record = {"rule": "paper_ratio", "key": key, "width": width, "target_ratio": round(target, 6),
              "achieved_ratio": round(achieved, 6), "residual_pct": round(100.0 * (achieved / target - 1.0), 3),
              "anchor_params": anchor, "params": counts[width]}
    return {**base, key: width}, record


def sized_config(cfg: Mapping[str, Any], method: str, model: str, dims: PredictorDims) -> tuple[dict[str, Any],
                                                                                               dict[str, Any]]:
    """A copy of ``cfg`` whose ``predictors.<method>`` is the resolved section for ``model`` (rule applied, per-model
    tables and ``size`` gone), so ``build_predictor`` builds the sized predictor; and the rule's record."""
    resolved, record = solve_width(cfg, method, model, dims)
    if not record:
        return dict(cfg), {}
    preds = {**cfg["predictors"], method: resolved}
    return {**cfg, "predictors": preds}, record


def config_dims(cfg: Mapping[str, Any], model: str) -> PredictorDims:
    """A model's predictor shapes from the config alone (what a trace's manifest will say), for checking the rules
    before any job runs; the Draft Model's vocabulary is the tokenizer's."""
    from specprefetch.config import n_moe_layers
    from specprefetch.predictors.base import PredictorDims

    m = cfg["models"][model]
    vocab = (cfg.get("tokenizer") or {}).get("vocab_size") or m.get("vocab_size") or 1
    return PredictorDims(n_layers=n_moe_layers(dict(m)), hidden_size=int(m["hidden_size"]),
                         n_experts=int(m["n_experts"]), top_k=int(m["top_k"]), vocab_size=int(vocab))


def check_size_rules(cfg: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Resolve every configured size rule for every model (model -> method -> record); the first that cannot be met
    raises, naming its key."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    methods = [m for m in cfg["predictors"]["methods"] if rule_of(cfg, m) is not None]
    for model in cfg["models"] if methods else ():
        dims = config_dims(cfg, model)
        for method in methods:
            out.setdefault(model, {})[method] = solve_width(cfg, method, model, dims)[1]
    return out
