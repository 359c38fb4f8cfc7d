"""Tables 1-5 of the paper as LaTeX (jinja2 templates in workflow/templates, booktabs) plus their cells as JSON.

Each ``build_tableN`` turns the checked result CSVs into (a) a template context with every cell already formatted
(percent with 2 decimals, ``mean ± std``, "0.82M"), bolded where it is the best of its comparison, and (b) a
``TableDoc`` holding the same numbers unformatted. The templates only lay the cells out, so what the diff tool and
the comparison with the paper read is exactly what the table prints.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from specprefetch import registry
from specprefetch.config import METHOD_LABELS, REPO_ROOT, resolve_budget
from specprefetch.io import atomic_paths
from specprefetch.render.cells import (
    Cell,
    TableDoc,
    best_mask,
    bold,
    fmt_fixed,
    fmt_params,
    latex_escape,
    pm_ci,
    seed_fields,
    tex_cell,
    throughput_decimals,
)
from specprefetch.render.data import (
    BOUND_COLUMN,
    CI_META,
    DeviceSelection,
    RenderInputError,
    RepeatStats,
    bound_values,
    experiment_rows,
    paired_gains,
    read_result_csv,
    repeat_count,
    repeat_stats,
    repeats_note,
    require_inputs,
    require_rows,
    select_device,
)
from specprefetch.render.profile import model_display, profile_sentence
from specprefetch.render.style import POLICY_LABELS, POLICY_LATEX, storage_label

log = logging.getLogger(__name__)

TEMPLATES_DIR = REPO_ROOT / "workflow" / "templates"
# The built-in rows of Tables 1-3, in the paper's order. A configured plugin method (specprefetch.registry) or built-in
# extension (beyond the paper, marked with a dagger) is a row of Table 1 (recall against the baselines) and, if it is
# trained, of Table 3 (its parameters), just above SpecPrefetch, the paper's method, which stays last; Table 2 is
# SpecPrefetch's own ablation and takes neither.
TABLE1_METHODS = ("fate", "draft_model", "promoe", "specprefetch")
TABLE2_METHODS = ("single_mlp", "specprefetch")
TABLE3_METHODS = ("single_mlp", "draft_model", "promoe", "specprefetch")


EXTENSION_MARK = r"$^\star$"  # the budget roles already use a dagger


def table_methods(builtin: tuple[str, ...], cfg: Mapping[str, Any], learned_only: bool = False) -> tuple[str, ...]:
    """``builtin`` with the config's plugin and extension methods (trained ones only with ``learned_only``) before
    its last row."""
    extra = [m for m in cfg["predictors"]["methods"]
             if (registry.is_plugin(m) or registry.method(m).extension)
             and (registry.method(m).learned or not learned_only)]
    return (*builtin[:-1], *extra, builtin[-1])


def row_label(method: str) -> str:
    """A method's row (or column) label in LaTeX: its label, with a dagger where it goes beyond the paper."""
    return latex_escape(METHOD_LABELS[method]) + (EXTENSION_MARK if registry.method(method).extension else "")


def extension_note(methods: Sequence[str]) -> str:
    """The LaTeX sentence that explains the dagger ("" when no row carries one)."""
    ext = [latex_escape(METHOD_LABELS[m]) for m in methods if registry.method(m).extension]
    return (f"{EXTENSION_MARK}Beyond the paper: {', '.join(ext)} (same protocol; see the README, "
            "``Beyond the paper'').") if ext else ""
TABLE5_POLICIES = ("naive", "fate", "specprefetch")
CATEGORIES = (("LLM", "LLM Workloads"), ("VLM", "VLM Workloads"))
RECALL_DECIMALS = 2
# --------------------------------------------------------------------------------------------- templates


def template_env(templates: Path | None = None) -> jinja2.Environment:
    """A jinja2 environment with LaTeX-safe delimiters (<< >>, <% %>) so braces stay LaTeX's own."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates or TEMPLATES_DIR)),
        block_start_string="<%", block_end_string="%>",
        variable_start_string="<<", variable_end_string=">>",
        comment_start_string="<#", comment_end_string="#>",
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined, autoescape=False,
    )


def render_template(name: str, context: Mapping[str, Any], templates: Path | None = None) -> str:
    try:
        return template_env(templates).get_template(name).render(**context)
    except jinja2.TemplateNotFound:
        raise RenderInputError(f"template {name!r} not found in {templates or TEMPLATES_DIR}") from None


# --------------------------------------------------------------------------------------------- budgets


@dataclass(frozen=True)
class Budget:
    """One R@M column: M, the config expression it came from (K/2, K, K+2) and whether R@M is bounded by M/K."""

    M: int
    role: str
    top_k: int

    @property
    def bounded(self) -> bool:
        return self.M < self.top_k

    @property
    def header(self) -> str:
        return f"R@{self.M}" + (r"$^\dagger$" if self.bounded else "")

    @property
    def plain(self) -> str:
        return f"R@{self.M}" + ("†" if self.bounded else "")


def model_budgets(cfg: Mapping[str, Any], model: str) -> list[Budget]:
    """The table's budget columns for a model: config recall.budgets in order (extra budgets are for figures)."""
    k = cfg["models"][model]["top_k"]
    seen: dict[int, Budget] = {}
    for expr in cfg["recall"]["budgets"]:
        m = resolve_budget(expr, k)
        seen.setdefault(m, Budget(m, str(expr), k))
    return list(seen.values())


def budget_note(cfg: Mapping[str, Any], models: list[str]) -> str:
    exprs = ", ".join(str(b) for b in cfg["recall"]["budgets"])
    ks = " and ".join(f"$K={cfg['models'][m]['top_k']}$ for {latex_escape(model_display(cfg, m))}" for m in models)
    return (rf"$R@M$ denotes ExpertRecall@$M$ with $M$ predicted candidates. The evaluated budgets are "
            rf"$\{{{exprs}\}}$, where {ks}. $^\dagger$: $M<K$, so $R@M\le M/K$ (50\% for $M=K/2$). "
            r"Bold: best in its comparison. --: not evaluated.")


# --------------------------------------------------------------------------------------------- recall frame


def _config_methods(cfg: Mapping[str, Any], wanted: tuple[str, ...], table: str) -> list[str]:
    methods = [m for m in wanted if m in cfg["predictors"]["methods"]]
    if "specprefetch" not in methods:
        raise RenderInputError(f"{table}: config predictors.methods lacks 'specprefetch'; the table compares to it")
    return methods


def recall_frame(recall: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any],
                 methods: list[str]) -> pd.DataFrame:
    """recall.csv restricted to the config's models, workloads and ``methods``, recall in percent.

    Rows of models/workloads outside the config are dropped with a warning (a stale file); a configured model,
    workload or method without any row, or a duplicated measurement, is an error naming it.
    """
    models, workloads = list(cfg["models"]), list(cfg["workloads"])
    stale = recall[~recall["model"].isin(models) | ~recall["workload"].isin(workloads)]
    if not stale.empty:
        log.warning("%s: ignoring %d rows of models/workloads not in the config (%s)", path, len(stale),
                    ", ".join(sorted(set(stale["model"]) | set(stale["workload"]))[:6]))
    df = recall[recall["model"].isin(models) & recall["workload"].isin(workloads) & recall["method"].isin(methods)]
    for col, names in (("model", models), ("workload", workloads), ("method", methods)):
        absent = [n for n in names if n not in set(df[col])]
        if absent:
            raise RenderInputError(f"{path}: no rows with {col}={absent[0]!r} (column {col!r}; "
                                   f"the config lists it)")
    dup = df.duplicated(["model", "workload", "method", "seed", "M"], keep=False)
    if dup.any():
        r = df[dup].iloc[0]
        raise RenderInputError(f"{path}: duplicate rows for model={r['model']!r}, workload={r['workload']!r}, "
                               f"method={r['method']!r}, seed={r['seed']}, M={r['M']} (column 'M')")
    out = df.copy()
    out["pct"] = out["expert_recall"] * 100.0
    return out


RecallKey = tuple[str, str, str, int]  # (model, workload, method, M)


def _lookup(df: pd.DataFrame) -> dict[RecallKey, dict[int, float]]:
    """Per (model, workload, method, M) the recall (%) of each seed index."""
    out: dict[RecallKey, dict[int, float]] = {}
    for r in df.itertuples():
        out.setdefault((r.model, r.workload, r.method, int(r.M)), {})[int(r.seed)] = float(r.pct)
    return out


def _recall_cell(table: str, cfg: Mapping[str, Any], values: Mapping[RecallKey, dict[int, float]],
                 model: str, workload: str, method: str, b: Budget) -> Cell:
    """One recall cell: the mean over the method's seeds, with its 95 % t-interval and the per-seed values when it
    has two or more (printed ``mean ± half-width``); a single seed prints its value as before."""
    mdisp, wdisp, label = model_display(cfg, model), cfg["workloads"][workload]["display_name"], METHOD_LABELS[method]
    per_seed = values.get((model, workload, method, b.M))
    if per_seed is None:
        log.debug("%s: no ExpertRecall for %s / %s / %s at M=%d: printed as a dash", table, model, workload,
                  method, b.M)
    stats = seed_fields(per_seed) if per_seed else {"value": None}
    v = stats["value"]
    text = (pm_ci(v, stats["lo"], stats["hi"], RECALL_DECIMALS, math_mode=False) if "lo" in stats
            else fmt_fixed(v, RECALL_DECIMALS))
    ext = {"extension": True} if registry.method(method).extension else {}  # beyond the paper: no paper claim's
    return Cell(id=f"{mdisp}/{wdisp}/{label}/R@{b.M}", quantity="recall",
                keys={"model": mdisp, "workload": wdisp, "method": label, "budget": b.role, "M": b.M, **ext},
                text=text, **stats)


def _recall_tex(c: Cell) -> str:
    """A recall cell in LaTeX: ``$mean\\pm h$`` with a seed interval, else its plain text."""
    return pm_ci(c.value, c.lo, c.hi, RECALL_DECIMALS) if c.has_ci else tex_cell(c.text)


def seeds_note(cfg: Mapping[str, Any], cells: list[Cell]) -> str:
    """What the ± of a recall table means, or nothing when every cell is a single run."""
    n = max((c.n or 1 for c in cells), default=1)
    if n < 2:
        return ""
    return (f"Learned predictors: mean $\\pm$ 95\\,\\% t-interval half-width over {n} training seeds; "
            "training-free methods are deterministic (one value).")


def _workload_groups(cfg: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    groups = []
    for cat, label in CATEGORIES:
        ws = [w for w, wc in cfg["workloads"].items() if wc["category"] == cat]
        if ws:
            groups.append((label, ws))
    return groups


@dataclass
class Built:
    """A table ready to write: the template to use, its context, and the cells."""

    template: str
    context: dict[str, Any]
    doc: TableDoc


# --------------------------------------------------------------------------------------------- Table 1


def build_table1(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> Built:
    """Next-layer expert coverage: methods x workloads (grouped LLM / VLM) x (model, budget) columns."""
    path = inputs["recall"]
    methods = _config_methods(cfg, table_methods(TABLE1_METHODS, cfg), "table1_recall")
    df = recall_frame(read_result_csv(path, "recall"), path, cfg, methods)
    values = _lookup(df)
    models = list(cfg["models"])
    budgets = {m: model_budgets(cfg, m) for m in models}
    cells: list[Cell] = []
    groups = []
    for cat_label, workloads in _workload_groups(cfg):
        bench_rows = []
        for w in workloads:
            grid = [[_recall_cell("table1_recall", cfg, values, m, w, meth, b) for m in models for b in budgets[m]]
                    for meth in methods]
            cells += [c for row in grid for c in row]
            texts = [[_recall_tex(c) for c in row] for row in grid]
            for j in range(len(grid[0])):  # bold the best method per (benchmark, model, budget)
                for i, on in enumerate(best_mask([row[j].value for row in grid], RECALL_DECIMALS)):
                    texts[i][j] = bold(texts[i][j], on)
            rows = [{"method": row_label(meth), "cells": row}
                    for meth, row in zip(methods, texts, strict=True)]
            bench_rows.append({"label": latex_escape(cfg["workloads"][w]["display_name"]), "rows": rows})
        groups.append({"label": cat_label.replace(" ", r"\\"), "n_rows": len(workloads) * len(methods),
                       "benchmarks": bench_rows})
    col = 4
    model_ctx = []
    for m in models:
        n = len(budgets[m])
        model_ctx.append({"label": latex_escape(model_display(cfg, m)), "budgets": [b.header for b in budgets[m]],
                          "first": col, "last": col + n - 1})
        col += n
    caption = ("Next-layer expert coverage (ExpertRecall@$M$, \\%) of SpecPrefetch and baseline predictors across "
               "LLM and VLM workloads. The evaluated candidate counts represent limited, native, and expanded "
               "prediction settings for each model. " + latex_escape(profile_sentence(cfg)))
    context = {"caption": caption, "label": "tab:recall", "models": model_ctx, "n_cols": col - 1,
               "groups": groups, "note": " ".join(x for x in (budget_note(cfg, models), seeds_note(cfg, cells),
                                                              extension_note(methods)) if x)}
    _warn_dashes("table1_recall", cells)
    doc = TableDoc("table1_recall", "Table 1: next-layer expert coverage", cfg["profile"], cells,
                   meta={"models": {model_display(cfg, m): m for m in models},
                         "budgets": {model_display(cfg, m): [b.role for b in budgets[m]] for m in models}})
    return Built("table1_recall.tex.j2", context, doc)


# --------------------------------------------------------------------------------------------- Table 2


def build_table2(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> Built:
    """Predictor design ablation: Single MLP vs SpecPrefetch per model (sub-tables (a), (b)), all workloads."""
    path = inputs["recall"]
    methods = _config_methods(cfg, TABLE2_METHODS, "table2_ablation")
    if "single_mlp" not in methods:
        raise RenderInputError("table2_ablation: config predictors.methods lacks 'single_mlp' (the ablation)")
    df = recall_frame(read_result_csv(path, "recall"), path, cfg, methods)
    values = _lookup(df)
    cells: list[Cell] = []
    panels = []
    for idx, m in enumerate(cfg["models"]):
        bs = model_budgets(cfg, m)
        rows = []
        for w in cfg["workloads"]:
            grid = {meth: [_recall_cell("table2_ablation", cfg, values, m, w, meth, b) for b in bs]
                    for meth in methods}
            cells += [c for meth in methods for c in grid[meth]]
            texts = {meth: [_recall_tex(c) for c in grid[meth]] for meth in methods}
            for j in range(len(bs)):  # bold the better design per (benchmark, budget)
                mask = best_mask([grid[meth][j].value for meth in methods], RECALL_DECIMALS)
                for meth, on in zip(methods, mask, strict=True):
                    texts[meth][j] = bold(texts[meth][j], on)
            rows.append({"label": latex_escape(cfg["workloads"][w]["display_name"]),
                         "cells": [t for meth in methods for t in texts[meth]]})
        panels.append({"tag": f"({chr(ord('a') + idx)})", "model": latex_escape(model_display(cfg, m)),
                       "methods": [latex_escape(METHOD_LABELS[meth]) for meth in methods],
                       "budgets": [b.header for b in bs], "n_budgets": len(bs), "rows": rows})
    caption = ("Predictor design ablation (ExpertRecall@$M$, \\%) across all workloads and candidate budgets: "
               "one shared Single MLP vs SpecPrefetch's layer-specific adapters. "
               + latex_escape(profile_sentence(cfg)))
    note = " ".join(x for x in (budget_note(cfg, list(cfg["models"])), seeds_note(cfg, cells)) if x)
    context = {"caption": caption, "label": "tab:ablation", "panels": panels, "note": note}
    _warn_dashes("table2_ablation", cells)
    doc = TableDoc("table2_ablation", "Table 2: predictor design ablation", cfg["profile"], cells,
                   meta={"models": {model_display(cfg, m): m for m in cfg["models"]}})
    return Built("table2_ablation.tex.j2", context, doc)


# --------------------------------------------------------------------------------------------- Table 3


def build_table3(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> Built:
    """Trainable parameters of the learned predictors, per model (exact counts in the JSON)."""
    path = inputs["params"]
    params = read_result_csv(path, "params")
    methods = [m for m in table_methods(TABLE3_METHODS, cfg, learned_only=True) if m in cfg["predictors"]["methods"]]
    if "specprefetch" not in methods:
        raise RenderInputError("table3_params: config predictors.methods lacks 'specprefetch'")
    params = params[params["model"].isin(list(cfg["models"])) & params["method"].isin(methods)]
    for col, names in (("model", list(cfg["models"])), ("method", methods)):
        absent = [n for n in names if n not in set(params[col])]
        if absent:
            raise RenderInputError(f"{path}: no rows with {col}={absent[0]!r} (column {col!r}; the config lists it)")
    dup = params.duplicated(["model", "method"], keep=False)
    if dup.any():
        r = params[dup].iloc[0]
        raise RenderInputError(f"{path}: duplicate rows for model={r['model']!r}, method={r['method']!r}")
    lookup = {(r.model, r.method): int(r.trainable_params) for r in params.itertuples()}
    cells, rows = [], []
    for m in cfg["models"]:
        mdisp = model_display(cfg, m)
        row = []
        for meth in methods:
            v = lookup.get((m, meth))
            c = Cell(id=f"{mdisp}/{METHOD_LABELS[meth]}", quantity="params", value=None if v is None else float(v),
                     keys={"model": mdisp, "method": METHOD_LABELS[meth]}, text=fmt_params(v))
            cells.append(c)
            row.append(tex_cell(c.text))
        rows.append({"label": latex_escape(mdisp), "cells": row})
    ratios = param_ratios(cfg, lookup, methods)
    caption = "Trainable parameters of different expert predictors. " + latex_escape(profile_sentence(cfg))
    if ratios:
        caption += " " + latex_escape(ratio_sentence(ratios))
    ext = extension_note(methods)
    if ext:
        caption += " " + ext
    context = {"caption": caption, "label": "tab:params", "rows": rows,
               "methods": [row_label(m) for m in methods]}
    doc = TableDoc("table3_params", "Table 3: trainable parameters", cfg["profile"], cells,
                   meta={"ratios": ratios} if ratios else {})
    return Built("table3_params.tex.j2", context, doc)


def param_ratios(cfg: Mapping[str, Any], lookup: Mapping[tuple[str, str], int],
                 methods: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Per model (display name) and baseline (label): its parameters over SpecPrefetch's, the paper's Table 3 ratio
    for that model and the residual (achieved / paper - 1, in %): how well the size rule
    (``predictors.<method>.size``, :mod:`specprefetch.predictors.sizing`) met the paper's relative sizes. Models
    and methods the paper's table lacks are left out."""
    from specprefetch.predictors.sizing import SizeRuleError, paper_ratio

    out: dict[str, dict[str, dict[str, float]]] = {}
    for m in cfg["models"]:
        anchor = lookup.get((m, "specprefetch"))
        for meth in methods:
            v = lookup.get((m, meth))
            if meth == "specprefetch" or not anchor or v is None:
                continue
            try:
                target = paper_ratio(model_display(cfg, m), meth)
            except (SizeRuleError, KeyError):
                continue
            achieved = v / anchor
            out.setdefault(model_display(cfg, m), {})[METHOD_LABELS[meth]] = {
                "achieved": round(achieved, 4), "paper": round(target, 4),
                "residual_pct": round(100.0 * (achieved / target - 1.0), 2)}
    return out


def ratio_sentence(ratios: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """The caption's line on the relative sizes: reproduced vs paper ratio to SpecPrefetch, per model."""
    parts = ["; ".join(f"{meth} {r['achieved']:.2f}× vs {r['paper']:.2f}× ({r['residual_pct']:+.1f} %)"
                       for meth, r in by.items()) for by in ratios.values()]
    return "Parameters relative to SpecPrefetch, reproduced vs paper (residual): " + "; ".join(
        f"{model}: {p}" for model, p in zip(ratios, parts, strict=True)) + "."


# --------------------------------------------------------------------------------------------- Tables 4, 5


def device_sentence(cfg: Mapping[str, Any], sel: DeviceSelection, rows: pd.DataFrame) -> str:
    """Which platform/model/source produced a device table and how its ± reads (plain text): "mean ± 95 % CI
    half-width, paired bootstrap over R repeats, N decoded tokens per run", R and N from ``rows``."""
    model = model_display(cfg, sel.model) if sel.model in cfg["models"] else sel.model
    sources = ", ".join(sel.sources)
    models = [sel.model] if sel.model in cfg["models"] else []
    prof = profile_sentence(cfg, models) if models else f"Profile: {cfg['profile']}."
    return (f"Platform {sel.platform} ({sources}), model {model}; {repeats_note(rows)}; gains computed per repeat "
            f"against OFF. {prof}")


def host_note(inputs: Mapping[str, Path], sel: DeviceSelection, storages: Sequence[str],
              ran: Mapping[str, int] | None = None) -> tuple[str, list[dict]]:
    """What the host gave a device table's runs (``host.csv``, the window profile's): a sentence and the rows, so a
    reader can set runs on different hosts side by side (the window-to-transfer ratio W/t decides prefetching).
    Where the table's runs on a storage used another budget than that storage's own window rule gives (``ran``, from
    the runs: e.g. the reference storage's, ``device.budget_scope: platform``), it says so (``ran_m_max``). Empty
    for a platform with no local profile (external logs, the simulator) or without ``host.csv``."""
    path = inputs.get("host")
    if path is None or not Path(path).is_file():  # an archive from before host.csv existed
        log.warning("%s: no host.csv, the device tables say nothing of the host's window and transfer times", path)
        return "", []
    host = read_result_csv(path, "host")
    rows = host[(host["platform"] == sel.platform) & (host["model"] == sel.model) & host["storage"].isin(storages)]
    if rows.empty:
        return "", []
    own = dict(zip(rows["storage"].astype(str), rows["m_max"].astype(int), strict=True))
    other = {str(st): int(m) for st, m in (ran or {}).items() if str(st) in own and int(m) != own[str(st)]}
    rows = rows.set_index("storage").loc[[st for st in storages if st in set(rows["storage"])]]
    parts = []
    margins: dict[str, dict[str, float]] = {}
    for st, r in rows.iterrows():
        delay = f", {r['emulation']} emulation, delay {r['delay_ms']:.2f} ms" if r["emulation"] != "none" else ""
        margin = window_rule_margin(float(r["w_over_t"]), int(r["m_max"]))
        edge = ""
        if margin is not None:
            margins[str(st)] = margin
            edge = (f" (the window rule's budget for W/t within {margin['down_pct']:+.1f} % / "
                    f"{margin['up_pct']:+.1f} % of this host's)")
        at = f"; its runs at M_max = {other[str(st)]}" if str(st) in other else ""
        parts.append(f"{storage_label(st)}: t = {r['transfer_ms']:.2f} ms per expert, W/t = {r['w_over_t']:.2f}, "
                     f"M_max = {int(r['m_max'])}{edge}{at}{delay}")
    first = rows.iloc[0]
    text = (f"Host (profile-window): compute {first['compute_ms']:.2f} ms per MoE layer all resident, window "
            f"W = {first['window_ms']:.2f} ms; " + "; ".join(parts) + ".")
    meta = [{"storage": st, **{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()
                                if k not in ("platform", "model")},
             **({"window_rule_margin": margins[str(st)]} if str(st) in margins else {}),
             **({"ran_m_max": other[str(st)]} if str(st) in other else {})} for st, r in rows.iterrows()]
    return text, meta


def window_rule_margin(w_over_t: float, m_max: int) -> dict[str, float] | None:
    """How far W/t may move before the window rule's budget ``floor(W/t)`` changes, in % of this host's W/t: down to
    ``m_max`` (``down_pct``, negative; -100 % at M_max = 1, the rule's floor) and up to ``m_max + 1`` (``up_pct``).
    A rerun whose window or transfer time drifts by more than that gets another budget, so a claim about "the
    profiled M_max" is only as stable as this margin. None where ``m_max`` is not the window
    rule's (a configured integer, the simulated rule) or W/t is not positive."""
    if not (w_over_t > 0) or m_max != max(1, math.floor(w_over_t)):
        return None
    down = -100.0 if m_max == 1 else (m_max / w_over_t - 1.0) * 100.0
    return {"down_pct": down, "up_pct": ((m_max + 1) / w_over_t - 1.0) * 100.0}


def storage_phrase(storage: str) -> str:
    """How a caption names a storage profile ("cold-cache NVMe" as the paper says, else "Slow UFS storage")."""
    return "cold-cache NVMe" if storage == "nvme_cold" else latex_escape(f"{storage_label(storage)} storage")


def _warn_dashes(table: str, cells: list[Cell]) -> None:
    """One warning per table listing what is printed as a dash (a missing measurement must not go unnoticed)."""
    missing = sorted({"/".join(c.id.split("/")[:3]) for c in cells if c.value is None})
    if missing:
        log.warning("%s: %d cells have no value and print as a dash: %s", table,
                    sum(c.value is None for c in cells), "; ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))


def _policy_rows(g: pd.DataFrame, path: Path | str, policy: str, what: str, **match: Any) -> pd.DataFrame:
    return require_rows(g, path, what, policy=policy, **match)


def _unique_m_max(rows: pd.DataFrame, path: Path | str, what: str) -> int:
    vals = sorted({int(v) for v in rows["m_max"].dropna()})
    if len(vals) != 1:
        raise RenderInputError(f"{path}: column 'm_max' has {vals or 'no values'} for {what}; expected one budget")
    return vals[0]


def _stat_cell(cid: str, quantity: str, st: RepeatStats | None, keys: dict[str, Any], dec: int,
               sign: bool = False) -> Cell:
    """A device cell: mean with its CI, std, spread and per-repeat values; text "mean ± CI half-width"."""
    if st is None:
        return Cell(id=cid, quantity=quantity, value=None, keys=keys, text="–")
    return Cell(id=cid, quantity=quantity, keys=keys, text=pm_ci(st.mean, st.lo, st.hi, dec, sign=sign,
                                                                   math_mode=False), **st.cell_fields())


def _tex_stat(st: RepeatStats | None, dec: int, sign: bool = False) -> str:
    return "--" if st is None else pm_ci(st.mean, st.lo, st.hi, dec, sign=sign)


def _maybe_stats(values: pd.Series, repeats: pd.Series) -> RepeatStats | None:
    return repeat_stats(values, repeats) if values.notna().any() else None


TABLE4_POLICIES = ("off", "pred0", "specprefetch")
TABLE4_REFERENCE = "resident"  # the all-resident upper bound, a reference row when the runtime measured it


def build_table4(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> Built:
    """OFF / PRED0 / SpecPrefetch throughput and paired gain vs OFF under cold storage, each as mean ± 95 % CI
    half-width (paired bootstrap over repeats); with runs.csv's optional ``bound_tokens_per_s`` also the bound and
    the throughput as % of it; the all-resident runs (if any) as a reference row."""
    path = inputs["runs"]
    runs = read_result_csv(path, "runs")
    has_bound = bound_values(runs, path) is not None
    rset = cfg["render"]
    sel = select_device(runs, path, cfg)
    storage = rset["device"]["cold_storage"]
    main = require_rows(experiment_rows(runs, path, sel, "main"), path, "Table 4", storage=storage)
    g = paired_gains(main, path)
    if has_bound:
        g = g.assign(**{BOUND_COLUMN: pd.to_numeric(g[BOUND_COLUMN], errors="coerce")})
        has_bound = bool(g[BOUND_COLUMN].notna().any())
    m_max = _unique_m_max(_policy_rows(g, path, "specprefetch", "Table 4 (SpecPrefetch)"), path,
                          "experiment 'main', policy 'specprefetch'")
    off = _policy_rows(g, path, "off", "Table 4 (OFF)")
    dec = throughput_decimals(float(off["tokens_per_s"].mean()))
    policies = list(TABLE4_POLICIES)
    reference = TABLE4_REFERENCE in set(g["policy"])
    if reference:
        policies.append(TABLE4_REFERENCE)
    cells, rows, ref_rows = [], [], []
    for policy in policies:
        pr = _policy_rows(g, path, policy, f"Table 4 ({POLICY_LABELS[policy]})")
        label = POLICY_LABELS[policy]
        tp = repeat_stats(pr["tokens_per_s"], pr["repeat"])
        gain = repeat_stats(pr["gain_pct"], pr["repeat"]) if policy != "off" else None
        row_cells = [_stat_cell(f"{label}/throughput", "throughput", tp, {"policy": label, "column": "throughput"},
                                dec),
                     _stat_cell(f"{label}/gain", "gain", gain, {"policy": label, "column": "gain"}, 2, sign=True)]
        tex = [_tex_stat(tp, dec), _tex_stat(gain, 2, sign=True)]
        if has_bound:
            bound = _maybe_stats(pr[BOUND_COLUMN], pr["repeat"])
            ratio = _maybe_stats(pr["tokens_per_s"] / pr[BOUND_COLUMN] * 100.0, pr["repeat"])
            row_cells += [_stat_cell(f"{label}/bound", "throughput", bound, {"policy": label, "column": "bound"},
                                     dec),
                          _stat_cell(f"{label}/of_bound", "share_pct", ratio, {"policy": label,
                                                                               "column": "of_bound"}, 1)]
            tex += [_tex_stat(bound, dec), _tex_stat(ratio, 1)]
        cells += row_cells
        name = POLICY_LATEX[policy] + (rf" ($M_{{\max}}={m_max}$)" if policy == "specprefetch" else "")
        if policy == TABLE4_REFERENCE:
            name += " (reference)"
        (ref_rows if policy == TABLE4_REFERENCE else rows).append({"label": name, "cells": tex})
    shown = g[g["policy"].isin(policies)]
    n_rep = repeat_count(shown)
    headers = [("Throughput", "(tok/s)"), ("Gain vs.\\ OFF", "(\\%)")]
    if has_bound:
        headers += [("Bound", "(tok/s)"), ("Of bound", "(\\%)")]
    caption = (f"Runtime overhead of prediction and prefetch control under {storage_phrase(storage)}. "
               r"PRED$_0$ executes the complete prediction and control path but issues no expert transfers. "
               + (r"Bound: the overlap/roofline throughput bound of the configuration computed by the runtime; "
                  r"of bound: throughput / bound per repeat. " if has_bound else "")
               + ("All resident: every expert in accelerator memory (an upper reference, not a policy). "
                  if reference else "")
               + latex_escape(device_sentence(cfg, sel, shown)))
    host_text, host = host_note(inputs, sel, [storage])
    caption += latex_escape(" " + host_text) if host_text else ""
    context = {"caption": caption, "label": "tab:overhead", "rows": rows, "reference_rows": ref_rows,
               "headers": headers}
    doc = TableDoc("table4_overhead", "Table 4: runtime overhead of prediction and prefetch control",
                   cfg["profile"], cells, meta={"platform": sel.platform, "model": sel.model, "storage": storage,
                                                "m_max": m_max, "sources": list(sel.sources), "repeats": n_rep,
                                                "bound": has_bound, "ci": CI_META,
                                                "note": repeats_note(shown), "host": host})
    return Built("table4_overhead.tex.j2", context, doc)


def build_table5(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> Built:
    """Naive Prefetch (and FATE if run) vs SpecPrefetch at one matched M_max: gain under cold and slow storage,
    ReadyRecall (under the cold storage), each as mean ± 95 % CI half-width (paired bootstrap over repeats)."""
    path = inputs["runs"]
    runs = read_result_csv(path, "runs")
    rset = cfg["render"]
    sel = select_device(runs, path, cfg)
    cold, slow = rset["device"]["cold_storage"], rset["device"]["slow_storage"]
    matched = experiment_rows(runs, path, sel, "matched")
    g = paired_gains(matched, path)
    plugin_policies = tuple(p for p in registry.policies() if registry.is_plugin(p))  # before SpecPrefetch's row
    policies = [p for p in (*TABLE5_POLICIES[:-1], *plugin_policies, TABLE5_POLICIES[-1]) if p in set(g["policy"])]
    for need in ("naive", "specprefetch"):
        _policy_rows(g, path, need, "Table 5")
    budgets: dict[str, int] = {}  # each storage has its own window-aware budget, the same for every policy
    for st in dict.fromkeys([cold, slow]):
        per = {p: _unique_m_max(_policy_rows(g, path, p, "Table 5", storage=st), path,
                                f"experiment 'matched', policy {p!r}, storage {st!r}") for p in policies}
        if len(set(per.values())) != 1:
            raise RenderInputError(f"{path}: experiment 'matched' uses different m_max per policy {per} on {st}; "
                                   "Table 5 compares at one matched budget per storage")
        budgets[st] = next(iter(per.values()))
    m_max = budgets[cold]
    m_text = (f"$M_{{\\max}}={m_max}$" if budgets[slow] == m_max else
              f"$M_{{\\max}}={m_max}$ under {storage_phrase(cold)} and ${budgets[slow]}$ under {storage_phrase(slow)} "
              "(each storage's window-aware budget)")
    columns = (("gain_cold", cold, "gain", 2), ("gain_slow", slow, "gain", 2), ("ready_recall", cold,
                                                                                 "ready_recall", 1))
    stats: dict[str, list[RepeatStats | None]] = {}
    for p in policies:
        out: list[RepeatStats | None] = []
        for col, storage, _, _ in columns:
            pr = _policy_rows(g, path, p, f"Table 5 column {col}", storage=storage)
            if col == "ready_recall":
                out.append(_maybe_stats(pr["ready_recall"] * 100.0, pr["repeat"]))
            else:
                out.append(repeat_stats(pr["gain_pct"], pr["repeat"]))
        stats[p] = out
    cells = []
    texts = {p: [] for p in policies}
    for j, (col, storage, quantity, dec) in enumerate(columns):
        mask = best_mask([stats[p][j].mean if stats[p][j] else None for p in policies], dec)
        for p, on in zip(policies, mask, strict=True):
            s = stats[p][j]
            sign = quantity == "gain"
            cells.append(_stat_cell(f"{POLICY_LABELS[p]}/{col}", quantity, s,
                                    {"policy": POLICY_LABELS[p], "column": col, "storage": storage}, dec, sign=sign))
            texts[p].append(bold(_tex_stat(s, dec, sign=sign), on))
    rows = [{"label": POLICY_LATEX[p], "cells": texts[p]} for p in policies]
    shown = g[g["policy"].isin(policies)]
    n_rep = repeat_count(shown)
    headers = [("Cold NVMe" if cold == "nvme_cold" else storage_label(cold), "Gain (\\%)"),
               (f"{storage_label(slow)}", "Gain (\\%)"), ("ReadyRecall", "(\\%)")]
    caption = (f"Matched-budget comparison of expert prediction strategies with {m_text}: throughput "
               f"gain vs OFF under {storage_phrase(cold)} and {storage_phrase(slow)}, ReadyRecall under "
               f"{storage_phrase(cold)}. Bold: best mean per column. "
               + latex_escape(device_sentence(cfg, sel, shown)))
    host_text, host = host_note(inputs, sel, list(dict.fromkeys([cold, slow])), budgets)
    caption += latex_escape(" " + host_text) if host_text else ""
    context = {"caption": caption, "label": "tab:matched", "rows": rows, "headers": headers}
    doc = TableDoc("table5_matched", "Table 5: matched-budget comparison", cfg["profile"], cells,
                   meta={"platform": sel.platform, "model": sel.model, "cold_storage": cold, "slow_storage": slow,
                         "m_max": m_max, "m_max_per_storage": budgets, "sources": list(sel.sources),
                         "repeats": n_rep, "ci": CI_META, "note": repeats_note(shown), "host": host})
    return Built("table5_matched.tex.j2", context, doc)


# --------------------------------------------------------------------------------------------- Table 0 (realism)

REALISM_TARGET_PP = 5.0  # issue 27: a stand-in routes like the real model when FATE R@K is within 5 pp of the paper's
REALISM_DECIMALS = {"recall": 2, "cosine": 3, "entropy": 3}
# (column key, token type, measured quantity), in the table's order after the stand-in / paper / delta columns
REALISM_SPLIT = (("recall_text", "text", "recall"), ("recall_image", "image", "recall"),
                 ("cosine_all", "all", "cosine"), ("cosine_text", "text", "cosine"),
                 ("cosine_image", "image", "cosine"), ("entropy_all", "all", "entropy"),
                 ("entropy_text", "text", "entropy"), ("entropy_image", "image", "entropy"))
_REALISM_FIELD = {"recall": "fate_recall", "cosine": "input_cosine", "entropy": "load_entropy"}


def _paper_fate(reported_path: Path | None) -> dict[tuple[str, str], float]:
    """The paper's FATE R@K (Table 1, budget K) by (model display name, workload display name)."""
    from specprefetch.render.reported import load_reported

    doc = load_reported(reported_path).tables.get("table1_recall")
    if doc is None:
        raise RenderInputError(f"{reported_path or 'the reported-numbers file'}: no table1_recall (the paper's FATE "
                               "R@K the realism table compares with)")
    return {(c.keys["model"], c.keys["workload"]): c.value for c in doc.cells
            if c.keys.get("method") == METHOD_LABELS["fate"] and c.keys.get("budget") == "K" and c.value is not None}


def _realism_rows(path: Path, cfg: Mapping[str, Any]) -> dict[tuple[str, str, str], Any]:
    """realism.csv by (model, workload, tokens): every configured (model, workload) with an ``all`` row at M = K."""
    df = read_result_csv(path, "realism")
    models, workloads = list(cfg["models"]), list(cfg["workloads"])
    stale = df[~df["model"].isin(models) | ~df["workload"].isin(workloads)]
    if not stale.empty:
        log.warning("%s: ignoring %d rows of models/workloads not in the config", path, len(stale))
    dup = df.duplicated(["model", "workload", "tokens"], keep=False)
    if dup.any():
        r = df[dup].iloc[0]
        raise RenderInputError(f"{path}: duplicate rows for model={r['model']!r}, workload={r['workload']!r}, "
                               f"tokens={r['tokens']!r} (column 'tokens')")
    rows = {(r.model, r.workload, r.tokens): r for r in df.itertuples()}
    for m in models:
        for w in workloads:
            r = rows.get((m, w, "all"))
            if r is None:
                raise RenderInputError(f"{path}: no row with model={m!r}, workload={w!r}, tokens='all' (the config "
                                       "lists both)")
            if int(r.M) != int(cfg["models"][m]["top_k"]):
                raise RenderInputError(f"{path}: column 'M' is {r.M} for {m}/{w}, but the config's top_k is "
                                       f"{cfg['models'][m]['top_k']} (a stale file?)")
    return rows


def _realism_value(rows: Mapping[tuple[str, str, str], Any], key: tuple[str, str, str], quantity: str) -> float | None:
    r = rows.get(key)
    if r is None:
        return None
    v = float(getattr(r, _REALISM_FIELD[quantity]))
    return v * 100.0 if quantity == "recall" else v


def _realism_cell(keys: Mapping[str, str], col: str, quantity: str, tokens: str, value: float | None,
                  sign: bool = False) -> Cell:
    return Cell(id=f"{keys['model']}/{keys['workload']}/{col}", quantity=quantity, value=value,
                keys={**keys, "column": col, "tokens": tokens},
                text=fmt_fixed(value, REALISM_DECIMALS[quantity], sign=sign))


def build_table0(inputs: Mapping[str, Path], cfg: Mapping[str, Any], reported: Path | None = None) -> Built:
    """Stand-in realism: per model and workload, FATE R@K against the paper's, and the routing properties behind
    it (adjacent router-input cosine, normalised expert-load entropy), all tokens and by token type."""
    path = inputs["realism"]
    rows_of = _realism_rows(path, cfg)
    paper = _paper_fate(reported)
    models = list(cfg["models"])
    cells: list[Cell] = []
    blocks = []
    n_within = n_compared = 0
    for m in models:
        mdisp = model_display(cfg, m)
        rows = []
        for w in cfg["workloads"]:
            wdisp = cfg["workloads"][w]["display_name"]
            keys = {"model": mdisp, "workload": wdisp}
            ours, ref = _realism_value(rows_of, (m, w, "all"), "recall"), paper.get((mdisp, wdisp))
            delta = None if ours is None or ref is None else ours - ref
            row = [_realism_cell(keys, "recall", "recall", "all", ours),
                   _realism_cell(keys, "paper", "recall", "all", ref),
                   _realism_cell(keys, "delta", "recall", "all", delta, sign=True)]
            row += [_realism_cell(keys, col, q, tok, _realism_value(rows_of, (m, w, tok), q))
                    for col, tok, q in REALISM_SPLIT]
            cells += row
            texts = [tex_cell(c.text) for c in row]
            if delta is not None:
                within = abs(delta) <= REALISM_TARGET_PP
                n_compared += 1
                n_within += within
                texts[2] = bold(texts[2], within)
            rows.append({"label": latex_escape(wdisp), "cells": texts})
        blocks.append({"model": latex_escape(mdisp), "rows": rows})
    k_text = " and ".join(f"$K={cfg['models'][m]['top_k']}$ for {latex_escape(model_display(cfg, m))}"
                          for m in models)
    caption = (r"Stand-in realism: how predictable the models' routing is from one MoE layer to the next. FATE "
               r"ExpertRecall@$K$ (\%) of the models here vs the paper's (Table 1), by token type, with the routing "
               r"properties behind it: the cosine similarity of adjacent MoE layers' router inputs and the expert-load "
               r"entropy (normalised by $\log n$, averaged over layers). " + latex_escape(profile_sentence(cfg)))
    note = (f"{k_text}. " + r"$\Delta$: here $-$ paper; bold: within "
            + f"{REALISM_TARGET_PP:g} pp ({n_within} of {n_compared} cells). "
            + r"Image tokens: the workloads' image placeholders (the traces' \texttt{is\_image} flag); text: every "
            r"other token. --: no such tokens, or no paper value.")
    context = {"caption": caption, "label": "tab:realism", "blocks": blocks, "note": note}
    doc = TableDoc("table0_realism", "Table 0: stand-in realism (routing predictability)", cfg["profile"], cells,
                   meta={"models": {model_display(cfg, m): m for m in models},
                         "M": {model_display(cfg, m): int(cfg["models"][m]["top_k"]) for m in models},
                         "target_pp": REALISM_TARGET_PP, "within_target": n_within, "compared": n_compared})
    return Built("table0_realism.tex.j2", context, doc)


# --------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class TableSpec:
    """A table: the result CSVs it reads (contract names) and how it is built."""

    name: str
    inputs: tuple[str, ...]
    build: Callable[[Mapping[str, Path], Mapping[str, Any]], Built]
    compared: bool = True  # has a reproduced-vs-reported companion (table0_realism is itself a comparison)
    optional: tuple[str, ...] = ()  # read when given (the DAG always gives them; an older archive may lack them)


TABLES: dict[str, TableSpec] = {
    "table0_realism": TableSpec("table0_realism", ("realism",), build_table0, compared=False),
    "table1_recall": TableSpec("table1_recall", ("recall",), build_table1),
    "table2_ablation": TableSpec("table2_ablation", ("recall",), build_table2),
    "table3_params": TableSpec("table3_params", ("params",), build_table3),
    "table4_overhead": TableSpec("table4_overhead", ("runs",), build_table4, optional=("host",)),
    "table5_matched": TableSpec("table5_matched", ("runs",), build_table5, optional=("host",)),
}


def render_table(name: str, cfg: Mapping[str, Any], inputs: Mapping[str, Path | str], out_tex: Path | str,
                 out_json: Path | str | None = None, templates: Path | None = None) -> TableDoc:
    """Build table ``name`` from its result CSVs (``inputs``: contract name -> path), write .tex and .json atomically.

    The JSON defaults to the .tex path with suffix .json. Raises RenderInputError for a missing input.
    """
    if name not in TABLES:
        raise RenderInputError(f"unknown table {name!r}; choose from {', '.join(TABLES)}")
    spec = TABLES[name]
    inputs = require_inputs(name, spec.inputs, inputs)
    given = [k for k in (*spec.inputs, *spec.optional) if k in inputs]
    built = spec.build({k: Path(inputs[k]) for k in given}, cfg)
    built.doc.meta.setdefault("inputs", {k: str(inputs[k]) for k in given})
    tex = render_template(built.template, built.context, templates)
    out_tex = Path(out_tex)
    with atomic_paths([out_tex, Path(out_json) if out_json else out_tex.with_suffix(".json")]) as (tmp_tex, tmp_json):
        tmp_tex.write_text(tex)  # .tex and .json appear together: a full disk leaves neither
        built.doc.write(tmp_json)
    log.info("wrote %s (%d cells)", out_tex, len(built.doc.cells))
    return built.doc
