"""Figures 1(a), 1(b), 4, 5, 6 and the per-layer recall figure, with seaborn, as PDF (for LaTeX) and PNG.

Each ``figure_*`` function takes checked DataFrames and returns the matplotlib figure plus a ``TableDoc`` of the
numbers it plots (written next to the image as JSON), so the comparison with the paper and the diff tool read the
plotted values rather than re-deriving them. Sizes are for one column of a two-column paper (3.3 in) with 7-8 pt
text; colours come from ``style.PALETTE`` so a method looks the same in every figure.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from specprefetch.contracts import split_experiment, variant_experiment  # noqa: E402
from specprefetch.io import atomic_path  # noqa: E402
from specprefetch.render.cells import CHOSEN, Cell, TableDoc, seed_fields  # noqa: E402
from specprefetch.render.data import (  # noqa: E402
    BOUND_COLUMN,
    CI_META,
    RenderInputError,
    RepeatStats,
    bound_values,
    experiment_rows,
    paired_gains,
    read_result_csv,
    repeat_stats,
    repeats_note,
    require_inputs,
    require_rows,
    select_device,
    summarize,
    window_exceed_overall,
    window_summary,
)
from specprefetch.render.profile import model_display, profile_name  # noqa: E402
from specprefetch.render.style import (  # noqa: E402
    COLUMN_WIDTH_IN,
    LATENCY_COMPONENTS,
    METHOD_ORDER,
    MODE_LABELS,
    POLICY_LABELS,
    STORAGE_ORDER,
    TEXT_WIDTH_IN,
    color,
    method_label,
    paper_rc,
    storage_label,
)
from specprefetch.render.tables import _unique_m_max, model_budgets  # noqa: E402
from specprefetch.runtime.core.budget import budget_scope, budget_source  # noqa: E402

log = logging.getLogger(__name__)


@dataclass
class FigureResult:
    fig: Figure
    doc: TableDoc


def _theme() -> Any:
    """Seaborn's ticks style with the paper's rc; a context manager so nothing leaks between figures."""
    style = sns.axes_style("ticks", {"axes.grid": True, "grid.color": "#E6E6E6", "axes.edgecolor": "#333333"})
    return plt.rc_context({**style, **paper_rc()})


def _display(cfg: Mapping[str, Any], model: str) -> str:
    """A model's display name as plot text: a ``$`` in a config string must not start matplotlib's mathtext."""
    return (model_display(cfg, model) if model in cfg["models"] else model).replace("$", r"\$")


def save_figure(fig: Figure, out_base: Path | str, dpi: int = 300) -> tuple[Path, Path]:
    """Write ``<base>.pdf`` and ``<base>.png`` atomically, without timestamps so a rerun gives the same bytes."""
    base = Path(out_base)
    pdf, png = base.with_suffix(".pdf"), base.with_suffix(".png")
    with atomic_path(pdf) as tmp:
        fig.savefig(tmp, format="pdf", metadata={"CreationDate": None, "ModDate": None, "Producer": None})
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    return pdf, png


def _caption_note(cfg: Mapping[str, Any], extra: str = "") -> str:
    return f"{profile_name(cfg)} profile" + (f"; {extra}" if extra else "")


# --------------------------------------------------------------------------------------------- Figure 1(a)


def figure_latency(latency: pd.DataFrame, cfg: Mapping[str, Any]) -> FigureResult:
    """Per-layer decoding latency, resident vs on-demand, stacked by component; one panel per platform."""
    from specprefetch.render.data import latency_summary

    comp = latency_summary(latency)
    panels = list(comp.groupby(["platform", "model"], sort=True))
    cells = []
    with _theme():
        fig, axes = plt.subplots(len(panels), 1, figsize=(COLUMN_WIDTH_IN, 0.55 + 0.85 * len(panels)),
                                 squeeze=False)
        for ax, ((platform, model), g) in zip(axes[:, 0], panels, strict=True):
            modes = [m for m in MODE_LABELS if m in set(g["mode"])]
            for y, mode in enumerate(modes):
                left = 0.0
                gm = g[g["mode"] == mode].set_index("component")
                for comp_name, (label, col) in LATENCY_COMPONENTS.items():
                    ms = float(gm["ms"].get(comp_name, 0.0))
                    ax.barh(y, ms, left=left, color=col, height=0.62, edgecolor="white", linewidth=0.4,
                            label=label if y == 0 and ax is axes[0, 0] else None)
                    left += ms
                    cells.append(Cell(id=f"{platform}/{model}/{mode}/{comp_name}", quantity="latency_ms", value=ms,
                                      keys={"platform": platform, "model": model, "mode": mode,
                                            "component": comp_name}))
                share = float(gm["share_pct"].get("expert_load", 0.0))
                cells.append(Cell(id=f"{platform}/{model}/{mode}/expert_load_share", quantity="share_pct",
                                  value=share, keys={"platform": platform, "model": model, "mode": mode}))
                if share > 0:
                    ax.text(left, y, f" {share:.0f}% load", va="center", ha="left", fontsize=6.5)
            ax.set_yticks(range(len(modes)), [MODE_LABELS[m] for m in modes])
            ax.invert_yaxis()
            ax.set_xlim(0, ax.get_xlim()[1] * 1.22)
            ax.set_title(f"{platform} · {_display(cfg, model)}", loc="left")
            ax.set_xlabel("Per-layer latency (ms)")
            ax.grid(axis="y", visible=False)
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=3, frameon=False, bbox_to_anchor=(0.5, 1.0),
                   columnspacing=0.8, handlelength=1.0)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.30 / fig.get_figheight()))
    doc = TableDoc("fig1a_latency", "Figure 1(a): per-layer latency, resident vs on-demand", cfg["profile"], cells,
                   meta={"note": _caption_note(cfg)})
    return FigureResult(fig, doc)


# --------------------------------------------------------------------------------------------- Figure 1(b)


def figure_window(window: pd.DataFrame, events: pd.DataFrame, cfg: Mapping[str, Any],
                  events_path: Path | str = "window_events.csv") -> FigureResult:
    """Prefetch window vs candidate transfer demand per layer; legend gives % of events over the window per M."""
    candidates = tuple(cfg["render"]["window_candidates"])
    summ = window_summary(window, events, events_path, candidates)
    overall = window_exceed_overall(events, candidates)
    order = {m: i for i, m in enumerate(cfg.get("models") or {})}  # the config's (the paper's) model order
    panels = sorted(summ.groupby(["platform", "model"], sort=True), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99)))
    ms_sorted = sorted(summ["M"].unique())
    greens = sns.color_palette("rocket_r", len(ms_sorted) + 2)[1:-1]
    cells = []
    with _theme():
        fig, axes = plt.subplots(len(panels), 1, figsize=(COLUMN_WIDTH_IN, 0.4 + 1.85 * len(panels)), squeeze=False)
        for ax, ((platform, model), g) in zip(axes[:, 0], panels, strict=True):
            win = g.drop_duplicates("layer").sort_values("layer")
            if win["window_ms"].isna().any():
                raise RenderInputError(f"window.csv: no window_ms for platform={platform!r}, model={model!r}, "
                                       f"layer {int(win.loc[win['window_ms'].isna(), 'layer'].iloc[0])} "
                                       "(window_events.csv has events there)")
            transfers = float(win["window_ms"].mean() / win["transfer_ms"].mean())
            ax.plot(win["layer"], win["window_ms"], color="black", marker="o", zorder=3,
                    label=f"Window $W_l$ (≈{transfers:.1f} xfers)")
            for m, col in zip(ms_sorted, greens, strict=True):
                gm = g[g["M"] == m].sort_values("layer")
                pct = overall[(overall["platform"] == platform) & (overall["model"] == model) & (overall["M"] == m)]
                pct_v = float(pct["exceed_pct"].iloc[0]) if not pct.empty else float("nan")
                ax.plot(gm["layer"], gm["demand_ms"], color=col, marker="s", linestyle="--",
                        label=f"Top-{m} ({pct_v:.0f}% > $W_l$)")
                cells.append(Cell(id=f"{platform}/{model}/M{m}/exceed_pct", quantity="exceed_pct", value=pct_v,
                                  keys={"platform": platform, "model": model, "M": int(m)}))
                for r in gm.itertuples():
                    cells.append(Cell(id=f"{platform}/{model}/M{m}/layer{r.layer}/demand_ms", quantity="demand_ms",
                                      value=float(r.demand_ms), keys={"platform": platform, "model": model,
                                                                      "M": int(m), "layer": int(r.layer)}))
            cells.append(Cell(id=f"{platform}/{model}/window_transfers", quantity="window_ms", value=transfers,
                              keys={"platform": platform, "model": model}, text=f"{transfers:.2f}"))
            for r in win.itertuples():
                cells.append(Cell(id=f"{platform}/{model}/layer{r.layer}/window_ms", quantity="window_ms",
                                  value=float(r.window_ms), keys={"platform": platform, "model": model,
                                                                  "layer": int(r.layer)}))
            ax.set_title(f"{platform} · {_display(cfg, model)}", loc="left")
            ax.set_xlabel("MoE layer $l$ (prefetch for $l+1$)")
            ax.set_ylabel("Time (ms)")
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            ax.set_ylim(bottom=0)
            ax.legend(loc="upper left", frameon=True, framealpha=0.9, edgecolor="none", ncol=2,
                      columnspacing=0.6, handlelength=1.6, fontsize=6)
            ax.set_ylim(top=ax.get_ylim()[1] * 1.35)
        fig.tight_layout()
    doc = TableDoc("fig1b_window", "Figure 1(b): prefetch window vs candidate transfer demand", cfg["profile"],
                   cells, meta={"candidates": list(candidates), "note": _caption_note(cfg)})
    return FigureResult(fig, doc)


# --------------------------------------------------------------------------------------------- runs-based figures


def _device_rows(runs: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any], experiment: str
                 ) -> tuple[pd.DataFrame, Any]:
    sel = select_device(runs, path, cfg)
    return experiment_rows(runs, path, sel, experiment), sel


def _one_storage(rows: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any], what: str) -> pd.DataFrame:
    """An experiment's rows on one storage: the only one present, else render.device.cold_storage (as the paper's
    Figures 4 and 6 are on cold-cache NVMe); averaging over storages would mix different regimes."""
    storages = sorted(rows["storage"].unique())
    if len(storages) == 1:
        return rows
    cold = cfg["render"]["device"]["cold_storage"]
    if cold not in storages:
        raise RenderInputError(f"{path}: {what} has rows on several storages ({', '.join(storages)}) and none on "
                               f"render.device.cold_storage={cold!r}")
    return rows[rows["storage"] == cold]


def _yerr(mean: Any, lo: Any, hi: Any) -> list[Any]:
    """matplotlib's asymmetric ``yerr`` ([below, above]) from a CI's bounds (the computed bootstrap interval)."""
    return [mean - lo, hi - mean]


def _stat_cell(cid: str, quantity: str, st: RepeatStats, keys: dict[str, Any]) -> Cell:
    return Cell(id=cid, quantity=quantity, keys=keys, **st.cell_fields())


def _ci_note(cfg: Mapping[str, Any], rows: pd.DataFrame) -> str:
    return _caption_note(cfg, "error bars: 95 % CI of the mean; " + repeats_note(rows).split(", ", 1)[1])


def _sweep(rows: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any], what: str) -> tuple[pd.DataFrame, Any]:
    """One sweep's SpecPrefetch summary by M_max (throughput, ReadyRecall) and its OFF rows."""
    rows = _one_storage(rows, path, cfg, what)
    spec = require_rows(rows, path, f"Figure 4 ({what})", policy="specprefetch")
    if spec["m_max"].isna().any():
        raise RenderInputError(f"{path}: column 'm_max' is empty for {what}'s rows of policy 'specprefetch'")
    spec = spec.assign(m_max=spec["m_max"].astype(int), ready_pct=spec["ready_recall"] * 100.0)
    return summarize(spec, ["m_max"], ["tokens_per_s", "ready_pct"]), rows[rows["policy"] == "off"]


def _sweep_cells(summ: pd.DataFrame, prefix: str, tag: dict[str, Any], grid: Sequence[int]) -> list[Cell]:
    """A sweep's points and its argmax; a point off the configured grid (``device.sweep_m_max``) is there because
    a rule chose its budget on this host (the window rule's, the simulated rule's): key ``chosen`` (CHOSEN)."""
    cells = []
    for r in summ.itertuples():
        key = {"m_max": int(r.m_max), **tag, **({CHOSEN: True} if int(r.m_max) not in set(grid) else {})}
        cells.append(_stat_cell(f"{prefix}M{r.m_max}/throughput", "throughput", r.tokens_per_s_stats, key))
        if r.ready_pct_stats is not None:
            cells.append(_stat_cell(f"{prefix}M{r.m_max}/ready_recall", "ready_recall", r.ready_pct_stats, key))
        else:
            cells.append(Cell(id=f"{prefix}M{r.m_max}/ready_recall", quantity="ready_recall", value=None, keys=key))
    peak = int(summ.loc[summ["tokens_per_s_mean"].idxmax(), "m_max"])
    cells.append(Cell(id=f"{prefix}peak_m_max", quantity="m_max", value=float(peak), keys=tag))
    return cells


def rule_losses(sweep: pd.DataFrame, runs: pd.DataFrame, sel: Any, variant: str | None = None,
                simulated: Mapping[str, int] | None = None) -> list[Cell]:
    """Per storage the sweep ran on: how much throughput a budget rule's budget loses against the sweep's fastest
    budget, ``(tps(best) - tps(rule)) / tps(best)`` in percent per repeat (the sweep's runs of one repeat share a
    block: paired), as a cell with its CI: ``<storage>/rule_loss`` for the budget the storage's other experiments ran
    SpecPrefetch at (storage, matched, main, budget; a variant's own: the configured rule's, by default the paper's
    window rule), ``<storage>/sim_rule_loss`` for the simulated rule's (``simulated``: storage -> budget, from
    budget_curve.csv). A storage without the budget, or whose sweep did not measure it, has no cell. A variant's
    cells carry its name (key ``variant``, id prefix ``<variant>:``)."""
    names = [variant_experiment(e, variant) for e in ("storage", "matched", "main", "budget")]
    other = runs[(runs["platform"] == sel.platform) & (runs["model"] == sel.model)
                 & (runs["source"] == sel.sources[0]) & runs["experiment"].isin(names)
                 & (runs["policy"] == "specprefetch")]
    if "budget_rule" in other.columns:  # the rules beyond the paper of the budget experiment are not the profiled one
        other = other[other["budget_rule"].fillna("").astype(str).str.strip() == ""]
    prefix, tag = (f"{variant}:", {"variant": variant}) if variant else ("", {})
    cells = []
    for st in [s for s in STORAGE_ORDER if s in set(sweep["storage"])]:
        profiled = sorted({int(m) for m in other.loc[other["storage"] == st, "m_max"].dropna()})
        spec = sweep[(sweep["storage"] == st) & (sweep["policy"] == "specprefetch")].dropna(subset=["m_max"])
        spec = spec.assign(m_max=spec["m_max"].astype(int))
        tps = spec.pivot_table(index="repeat", columns="m_max", values="tokens_per_s")
        if tps.empty:
            continue
        best = int(tps.mean().idxmax())
        rules = [("rule_loss", profiled[0] if len(profiled) == 1 else None),
                 ("sim_rule_loss", (simulated or {}).get(st))]
        for name, m in rules:
            if m is None or m not in tps.columns:
                continue
            loss = (tps[best] - tps[m]) / tps[best] * 100.0
            st_loss = repeat_stats(loss, pd.Series(loss.index, index=loss.index))
            cells.append(_stat_cell(f"{prefix}{st}/{name}", "gain", st_loss,
                                    {"storage": st, "m_max": int(m), "best_m_max": best, **tag}))
    return cells


def read_curve(path: Path | None) -> pd.DataFrame | None:
    """budget_curve.csv (the simulator's curves from the window profile) when given and present, else None (an
    archive from before it existed: the figures then draw the measurements alone)."""
    if path is None or not Path(path).is_file():
        if path is not None:
            log.warning("%s: no budget_curve.csv, the figures draw no simulator curve", path)
        return None
    return read_result_csv(path, "budget_curve")


def curve_rows(curve: pd.DataFrame | None, sel: Any, rows: pd.DataFrame, kind: str) -> pd.DataFrame:
    """The curve rows of one kind for the selected platform and model, measured under the emulation and I/O order
    ``rows`` (runs of one benchmark) were (empty without a curve)."""
    if curve is None:
        return pd.DataFrame(columns=["storage", "m_max", "tokens_per_s", "off_tokens_per_s", "gain_pct",
                                     "w_over_t", "rule", "m_max_simulated"])
    return curve[(curve["platform"] == sel.platform) & (curve["model"] == sel.model) & (curve["curve"] == kind)
                 & (curve["emulation"] == _setting(rows, "emulation", "bandwidth"))
                 & (curve["io_order"] == _setting(rows, "io_order", "demand_first"))]


def simulated_budgets(curve: pd.DataFrame | None, sel: Any, rows: pd.DataFrame,
                      device: Mapping[str, Any]) -> dict[str, int]:
    """The simulated rule's budget per storage for a benchmark's rows (budget_curve.csv's ``storage`` rows), each
    storage's own or, under ``budget_scope: platform``, the reference storage's (``budget.budget_source``): the
    scope the rows were measured under (runs.csv's column), else, for files from before it, ``device``'s."""
    st = curve_rows(curve, sel, rows, "storage")
    own = {str(r.storage): int(r.m_max_simulated) for r in st.itertuples()}
    scope = {**device, "budget_scope": _setting(rows, "budget_scope", budget_scope(device))}
    src = {s: budget_source(scope, s) for s in own}
    return {s: own[src[s]] for s in own if src[s] in own}


def figure_budget(runs: pd.DataFrame, cfg: Mapping[str, Any], path: Path | str = "runs.csv",
                  curve: pd.DataFrame | None = None) -> FigureResult:
    """Figure 4: throughput and ReadyRecall of SpecPrefetch vs M_max (mean with its 95 % bootstrap CI over
    repeats), OFF as reference (its CI as a band). A variant of ``device.variants`` that measured the sweep too
    (e.g. FIFO I/O beside demand-first) is a second, dashed line; its cells carry its name (key ``variant``, id
    prefix ``<variant>:``). With ``curve`` (budget_curve.csv) also the simulator's curve from the window profile
    alone (its speedup over OFF times the measured OFF: the shape a prediction made before the runs gives) and the
    simulated rule's budget, and each rule's loss against the sweep's fastest budget."""
    rows, sel = _device_rows(runs, path, cfg, "sweep")
    summ, off = _sweep(rows, path, cfg, "experiment 'sweep'")
    shown = str(_one_storage(rows, path, cfg, "experiment 'sweep'")["storage"].iloc[0])  # the storage drawn
    spec = rows[rows["policy"] == "specprefetch"]
    others = {v: _sweep(r, path, cfg, f"experiment 'sweep@{v}'") + (r,)
              for v, r in variant_rows(runs, sel, "sweep").items()}
    profiled = None
    main = runs[(runs["platform"] == sel.platform) & (runs["model"] == sel.model) & (runs["experiment"] == "main")
                & (runs["source"] == sel.sources[0]) & (runs["policy"] == "specprefetch")]
    if not main.empty and main["m_max"].notna().any():
        profiled = int(main["m_max"].dropna().iloc[0])
    peak = int(summ.loc[summ["tokens_per_s_mean"].idxmax(), "m_max"])
    grid = [int(m) for m in cfg["device"]["sweep_m_max"]]
    c = color("specprefetch")
    cells: list[Cell] = []
    variant_cells: list[Cell] = []
    with _theme():
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(COLUMN_WIDTH_IN, 3.2 if others else 2.9), sharex=True)
        ax1.errorbar(summ["m_max"], summ["tokens_per_s_mean"], yerr=_yerr(summ["tokens_per_s_mean"],
                     summ["tokens_per_s_lo"], summ["tokens_per_s_hi"]), color=c, marker="o", capsize=2,
                     elinewidth=0.8, label="SpecPrefetch")
        ax1.plot([peak], summ.loc[summ["m_max"] == peak, "tokens_per_s_mean"], marker="*", markersize=9, color=c,
                 linestyle="none", label=f"peak ($M_{{\\max}}={peak}$)")
        sim_budget = simulated_budgets(curve, sel, rows, cfg["device"])
        if not off.empty:
            ost = repeat_stats(off["tokens_per_s"], off["repeat"])
            ax1.axhline(ost.mean, color=color("off"), linestyle="--", linewidth=1.0, label="OFF")
            ax1.axhspan(ost.lo, ost.hi, color=color("off"), alpha=0.15, linewidth=0)
            cells.append(_stat_cell("OFF/throughput", "throughput", ost, {"policy": "OFF"}))
            sim = curve_rows(curve, sel, rows, "budget")
            sim = sim[(sim["storage"] == shown) & sim["m_max"].between(summ["m_max"].min(),
                                                                                         summ["m_max"].max())]
            if not sim.empty:
                ax1.plot(sim["m_max"], sim["tokens_per_s"] / sim["off_tokens_per_s"] * ost.mean, color="#777777",
                         linewidth=0.9, linestyle="-.", label="simulator (profile)", zorder=1)
        for k, (v, (vs, voff, vrows)) in enumerate(others.items()):
            order = IO_ORDER_LABELS.get(_setting(vrows, "io_order", "demand_first"), v)
            dim = {"color": c, "alpha": 0.75, "linestyle": "--", "capsize": 2, "elinewidth": 0.6}
            ax1.errorbar(vs["m_max"] + 0.08 * (k + 1), vs["tokens_per_s_mean"], yerr=_yerr(
                vs["tokens_per_s_mean"], vs["tokens_per_s_lo"], vs["tokens_per_s_hi"]), marker="o", mfc="white",
                label=f"SpecPrefetch, {order}", **dim)
            vr = vs.dropna(subset=["ready_pct_mean"])
            ax2.errorbar(vr["m_max"] + 0.08 * (k + 1), vr["ready_pct_mean"], yerr=_yerr(
                vr["ready_pct_mean"], vr["ready_pct_lo"], vr["ready_pct_hi"]), marker="s", mfc="white", **dim)
            if not voff.empty:
                vst = repeat_stats(voff["tokens_per_s"], voff["repeat"])
                ax1.axhline(vst.mean, color=color("off"), linestyle=":", linewidth=1.0, label=f"OFF, {order}")
                variant_cells.append(_stat_cell(f"{v}:OFF/throughput", "throughput", vst,
                                                {"policy": "OFF", "variant": v}))
            variant_cells += _sweep_cells(vs, f"{v}:", {"variant": v}, grid) + rule_losses(
                vrows, runs, sel, v, simulated_budgets(curve, sel, vrows, cfg["device"]))
        ax1.set_ylabel("Throughput (tok/s)")
        ax1.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3 if not others else 2, frameon=False,
                   columnspacing=1.0, handlelength=1.5)
        rr = summ.dropna(subset=["ready_pct_mean"])
        ax2.errorbar(rr["m_max"], rr["ready_pct_mean"], yerr=_yerr(rr["ready_pct_mean"], rr["ready_pct_lo"],
                     rr["ready_pct_hi"]), color=c, marker="s", capsize=2, elinewidth=0.8)
        ax2.set_ylabel("ReadyRecall (%)")
        ax2.set_xlabel(r"Maximum prefetch budget $M_{\max}$ (experts/layer)")
        ax2.set_xticks(summ["m_max"].tolist())
        simulated = sim_budget.get(shown)
        for ax in (ax1, ax2):
            if profiled is not None:
                ax.axvline(profiled, color="#555555", linestyle=":", linewidth=0.9)
            if simulated is not None:
                ax.axvline(simulated, color="#777777", linestyle="-.", linewidth=0.8)
        if profiled is not None:
            ax2.annotate("window rule", xy=(profiled, ax2.get_ylim()[0]), xytext=(2, 2), textcoords="offset points",
                         fontsize=6, color="#555555")
        if simulated is not None:
            ax2.annotate("simulated", xy=(simulated, ax2.get_ylim()[1]), xytext=(2, -8), textcoords="offset points",
                         fontsize=6, color="#777777")
        fig.align_ylabels((ax1, ax2))
        fig.tight_layout(h_pad=0.4)
    cells += _sweep_cells(summ, "", {}, grid) + variant_cells + rule_losses(rows, runs, sel, None, sim_budget)
    doc = TableDoc("fig4_budget", "Figure 4: prefetch budget sweep", cfg["profile"], cells,
                   meta={"platform": sel.platform, "model": sel.model, "profiled_m_max": profiled,
                         **({"simulated_m_max": simulated, "simulated_m_max_per_storage": sim_budget}
                            if sim_budget else {}),
                         "storage": sorted(spec["storage"].unique()), "ci": CI_META,
                         "io_order": _setting(rows, "io_order", "demand_first"),
                         "variants": {v: {"io_order": _setting(r, "io_order", "demand_first")}
                                      for v, (_, _, r) in others.items()},
                         "note": _ci_note(cfg, rows)})
    return FigureResult(fig, doc)


def _gain_label(g: float) -> str:
    return f"{g:+.1f}%"


def variant_rows(runs: pd.DataFrame, sel: Any, experiment: str) -> dict[str, pd.DataFrame]:
    """``experiment``'s runs in each variant of ``device.variants`` (runs.csv's ``<experiment>@<variant>``) on the
    selected platform, model and source, by variant name, in the order they appear."""
    sub = runs[(runs["platform"] == sel.platform) & (runs["model"] == sel.model) & (runs["source"] == sel.sources[0])]
    out: dict[str, pd.DataFrame] = {}
    for name in dict.fromkeys(sub["experiment"]):
        base, variant = split_experiment(str(name))
        if base == experiment and variant:
            out[variant] = sub[sub["experiment"] == name]
    return out


def _setting(rows: pd.DataFrame, column: str, default: str) -> str:
    """The emulation, I/O order or budget scope the rows were measured under (runs.csv's column), else ``default``
    (files from before the column: the bandwidth emulation and demand-first I/O, the only ones there were)."""
    if column in rows and rows[column].notna().any():
        return str(rows[column].dropna().iloc[0])
    return default


EMULATION_TITLES = {"delay": "delay emulation (the paper's)", "bandwidth": "bandwidth emulation"}
IO_ORDER_LABELS = {"demand_first": "demand first", "fifo": "FIFO I/O"}


def figure_storage(runs: pd.DataFrame, cfg: Mapping[str, Any], path: Path | str = "runs.csv",
                   curve: pd.DataFrame | None = None) -> FigureResult:
    """Figure 5: OFF vs SpecPrefetch throughput per storage profile (fastest to slowest) with 95 % bootstrap CIs,
    the paired gain on top; with runs.csv's optional ``bound_tokens_per_s`` a marker at each bar's bound and the
    throughput as % of it (in the JSON). One panel per emulation measured: the default's, then each variant's
    (``device.variants``, e.g. the bandwidth emulation beside the paper's delay emulation); a variant's cells carry
    its name (key ``variant``, id prefix ``<variant>:``). With ``curve`` (budget_curve.csv) a second row draws each
    panel's gains against the host-independent axis W/t (:func:`_wt_panel`) with the simulator's curves."""
    has_bound = bound_values(runs, path) is not None
    rows, sel = _device_rows(runs, path, cfg, "storage")
    panels = {None: rows, **variant_rows(runs, sel, "storage")}
    prepared = {v: _storage_gains(r, path, has_bound) for v, r in panels.items()}
    has_bound = any(b for _, b in prepared.values())
    wt = {v: (curve_rows(curve, sel, r, "storage"), curve_rows(curve, sel, r, "w_over_t")) for v, r in panels.items()}
    has_wt = any(not a.empty and not b.empty for a, b in wt.values())
    cells: list[Cell] = []
    budgets: dict[str, dict[str, int]] = {}
    meta_variants: dict[str, dict[str, Any]] = {}
    meta_wt: dict[str, Any] = {}
    with _theme():
        counts = [g["storage"].nunique() for g, _ in prepared.values()]
        wide = COLUMN_WIDTH_IN if len(panels) == 1 else max(COLUMN_WIDTH_IN, 0.8 + 0.75 * sum(counts))
        high = 2.4 if has_bound or len(panels) > 1 else 2.2
        fig, axes = plt.subplots(2 if has_wt else 1, len(panels), figsize=(wide, high + (2.1 if has_wt else 0.0)),
                                 sharey="row", squeeze=False, gridspec_kw={"width_ratios": counts})
        top_all = 0.0
        for ax, (variant, (g, bound)) in zip(axes[0], prepared.items(), strict=True):
            emulation = _setting(g, "emulation", "bandwidth")
            spec = g[g["policy"] == "specprefetch"]
            storages = [s for s in STORAGE_ORDER if s in set(g["storage"])]
            budgets[variant or ""] = {s: _unique_m_max(spec[spec["storage"] == s], path,
                                                       f"Figure 5, SpecPrefetch on {s!r}") for s in storages}
            top_all = max(top_all, _storage_panel(ax, g, bound, variant, cells, budgets[variant or ""],
                                                  wrap=len(panels) > 1))
            if len(panels) > 1:
                ax.set_title(EMULATION_TITLES.get(emulation, emulation), fontsize=7)
            if variant:
                meta_variants[variant] = {"emulation": emulation, "m_max_per_storage": budgets[variant]}
        for ax in axes[0]:
            ax.set_ylim(0, top_all * 1.18)
        if has_wt:
            for ax, (variant, (g, _)) in zip(axes[1], prepared.items(), strict=True):
                meta_wt[variant or ""] = _wt_panel(ax, g, *wt[variant])
                ax.set_xlabel("$W/t$: expert loads per prefetch window", fontsize=7)
                if len(panels) > 1:
                    ax.set_xlabel("$W/t$: loads per window", fontsize=7)
            axes[1][0].set_ylabel("SpecPrefetch gain (%)")
            axes[1][0].legend(frameon=False, loc="upper right", fontsize=6)
            for ax in axes[0]:
                ax.set_xlabel("Expert storage (fast → slow)", fontsize=7)
        first = axes[0][0]
        first.set_ylabel("Throughput (tok/s)")
        if len(panels) > 1:  # one legend above both panels, clear of the titles and gain labels
            if not has_wt:
                fig.supxlabel("Expert storage (fast → slow)", fontsize=8)
            handles, labels = first.get_legend_handles_labels()
            fig.legend(handles, labels, title=None, frameon=False, loc="upper center", ncol=3,
                       bbox_to_anchor=(0.5, 1.0))
            fig.tight_layout(rect=(0, 0, 1, 0.9))
        else:
            first.set_xlabel("Expert storage (fast → slow)", fontsize=7 if has_wt else None)
            if has_bound:  # three entries: above the axes, clear of the gain labels
                first.legend(title=None, frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3)
            else:
                first.legend(title=None, frameon=False, loc="upper right", ncol=2)
            fig.tight_layout()
    doc = TableDoc("fig5_storage", "Figure 5: storage sensitivity", cfg["profile"], cells,
                   meta={"platform": sel.platform, "model": sel.model, "bound": has_bound, "ci": CI_META,
                         "emulation": _setting(rows, "emulation", "bandwidth"),
                         "m_max_per_storage": budgets[""], "variants": meta_variants,
                         **({"w_over_t": meta_wt} if meta_wt else {}),
                         "note": _ci_note(cfg, prepared[None][0])})
    return FigureResult(fig, doc)


def _wt_panel(ax: Any, g: pd.DataFrame, storages: pd.DataFrame, grid: pd.DataFrame) -> dict[str, Any]:
    """Figure 5's lower row: SpecPrefetch's measured gain (mean, 95 % CI) at each storage's W/t (the window over
    the isolated load time, both from the window profile) and the simulator's gain along W/t from the profile alone,
    at the window rule's budget and at the simulated rule's (module budget_model). Returns what it drew, for the
    JSON's meta (W/t is the host's, not a measured result: no cells)."""
    c = color("specprefetch")
    spec = g[g["policy"] == "specprefetch"]
    summ = summarize(spec, ["storage"], ["gain_pct"])
    where = {str(r.storage): float(r.w_over_t) for r in storages.itertuples()}
    drawn: dict[str, Any] = {"storages": {}, "simulated": {}}
    for rule, style in (("window", "-"), ("simulated", "--")):
        line = grid[grid["rule"] == rule].sort_values("w_over_t")
        if not line.empty:
            ax.plot(line["w_over_t"], line["gain_pct"], color="#777777", linestyle=style, linewidth=0.9,
                    label=f"simulator, {rule} rule")
            drawn["simulated"][rule] = [[float(x), float(y), int(m)] for x, y, m in
                                        zip(line["w_over_t"], line["gain_pct"], line["m_max"], strict=True)]
    for r in summ.itertuples():
        x = where.get(str(r.storage))
        if x is None:
            continue
        ax.errorbar([x], [r.gain_pct_mean], yerr=[[r.gain_pct_mean - r.gain_pct_lo], [r.gain_pct_hi - r.gain_pct_mean]],
                    color=c, marker="o", markersize=3.5, capsize=2, elinewidth=0.8, linestyle="none")
        ax.annotate(storage_label(str(r.storage)), xy=(x, r.gain_pct_mean), xytext=(3, 3), textcoords="offset points",
                    fontsize=5.5, color=c)
        drawn["storages"][str(r.storage)] = x
    ax.axhline(0, color="#999999", linewidth=0.6)
    ax.set_xscale("log", base=2)
    ticks = [0.5, 1, 2, 4, 8]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.grid(axis="x", visible=False)
    return drawn


def _storage_gains(rows: pd.DataFrame, path: Path | str, has_bound: bool) -> tuple[pd.DataFrame, bool]:
    """One panel's rows of Figure 5 (OFF and SpecPrefetch) with their paired gains and, if measured, the share of
    the bound."""
    rows = rows[rows["policy"].isin(["off", "specprefetch"])]
    require_rows(rows, path, "Figure 5", policy="specprefetch")
    g = paired_gains(rows, path)
    if has_bound:
        g = g.assign(**{BOUND_COLUMN: pd.to_numeric(g[BOUND_COLUMN], errors="coerce")})
        g["of_bound_pct"] = g["tokens_per_s"] / g[BOUND_COLUMN] * 100.0
        has_bound = bool(g[BOUND_COLUMN].notna().any())
    return g, has_bound


def _storage_panel(ax: Any, g: pd.DataFrame, has_bound: bool, variant: str | None, cells: list[Cell],
                   budget: Mapping[str, int], wrap: bool = False) -> float:
    """Draw one panel of Figure 5 and append its cells; returns the panel's highest point (``wrap``: storage names
    on two lines, for side-by-side panels). SpecPrefetch's cells carry the budget it ran at on the storage (key
    ``m_max``, ``budget``): a rerun whose window profile chose another budget measured another configuration."""
    extra = [BOUND_COLUMN, "of_bound_pct"] if has_bound else []
    storages = [s for s in STORAGE_ORDER if s in set(g["storage"])]
    policies = ["off", "specprefetch"]
    summ = summarize(g, ["storage", "policy"], ["tokens_per_s", "gain_pct", *extra])
    prefix = f"{variant}:" if variant else ""
    tag = {"variant": variant} if variant else {}
    width = 0.36
    top: dict[str, float] = {}
    bound_label = True
    for j, p in enumerate(policies):
        for i, s in enumerate(storages):
            sp = summ[(summ["storage"] == s) & (summ["policy"] == p)]
            if sp.empty:
                continue
            r = sp.iloc[0]
            x = i + (j - 0.5) * width
            ax.bar(x, r["tokens_per_s_mean"], width=width * 0.94, color=color(p),
                   label=POLICY_LABELS[p] if i == 0 else None,
                   yerr=[[r["tokens_per_s_mean"] - r["tokens_per_s_lo"]],
                         [r["tokens_per_s_hi"] - r["tokens_per_s_mean"]]],
                   error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "#222222"})
            high = r["tokens_per_s_hi"]
            if has_bound and r[f"{BOUND_COLUMN}_stats"] is not None:
                b = r[f"{BOUND_COLUMN}_mean"]
                ax.plot([x], [b], marker="_", markersize=9, markeredgewidth=1.4, color="black",
                        linestyle="none", label="bound" if bound_label else None, zorder=4)
                bound_label = False
                high = max(high, b)
            top[s] = max(top.get(s, 0.0), float(high))
    for i, s in enumerate(storages):
        sp = summ[(summ["storage"] == s) & (summ["policy"] == "specprefetch")]
        st = sp["gain_pct_stats"].iloc[0]
        ax.text(i, top[s] * 1.03, _gain_label(st.mean), ha="center", va="bottom", fontsize=6.5,
                color=color("specprefetch"), fontweight="bold")
        cells.append(_stat_cell(f"{prefix}{s}/gain", "gain", st, {"storage": s, "policy": "SpecPrefetch",
                                                                  "m_max": budget[s], **tag}))
    for r in summ.itertuples():
        key = {"storage": r.storage, "policy": POLICY_LABELS[r.policy], **tag,
               **({"m_max": budget[r.storage]} if r.policy == "specprefetch" else {})}
        base = f"{prefix}{r.storage}/{POLICY_LABELS[r.policy]}"
        cells.append(_stat_cell(f"{base}/throughput", "throughput", r.tokens_per_s_stats, key))
        if has_bound:
            bst, ost = getattr(r, f"{BOUND_COLUMN}_stats"), r.of_bound_pct_stats
            cells.append(Cell(id=f"{base}/bound", quantity="throughput", value=None, keys=key) if bst is None else
                         _stat_cell(f"{base}/bound", "throughput", bst, key))
            cells.append(Cell(id=f"{base}/of_bound", quantity="share_pct", value=None, keys=key) if ost is None
                         else _stat_cell(f"{base}/of_bound", "share_pct", ost, key))
    names = [storage_label(s) for s in storages]
    ax.set_xticks(range(len(storages)), [n.replace(" ", "\n", 1) for n in names] if wrap else names)
    ax.grid(axis="x", visible=False)
    return max(top.values())


COMPONENT_BARS = (  # (policy, compute_opt, label)
    ("off", False, "Baseline"),
    ("off", True, "+ Compute\nopt."),
    ("specprefetch", False, "+ Spec-\nPrefetch"),
    ("specprefetch", True, "+ Both"),
)


def figure_component(runs: pd.DataFrame, cfg: Mapping[str, Any], path: Path | str = "runs.csv") -> FigureResult:
    """Figure 6: compute optimization and SpecPrefetch alone and combined (cold page cache), gain vs baseline;
    error bars: 95 % bootstrap CI of the mean throughput over repeats."""
    rows, sel = _device_rows(runs, path, cfg, "component")
    rows = _one_storage(rows, path, cfg, "experiment 'component'")
    for policy, opt, _ in COMPONENT_BARS:
        require_rows(rows, path, "Figure 6", policy=policy, compute_opt=opt)
    g = paired_gains(rows, path, baseline={"policy": "off", "compute_opt": False}, match_compute_opt=False)
    cells = []
    with _theme():
        fig, ax = plt.subplots(figsize=(COLUMN_WIDTH_IN, 2.0))
        for i, (policy, opt, label) in enumerate(COMPONENT_BARS):
            sub = g[(g["policy"] == policy) & (g["compute_opt"] == opt)]
            tp = repeat_stats(sub["tokens_per_s"], sub["repeat"])
            gain = repeat_stats(sub["gain_pct"], sub["repeat"])
            ax.bar(i, tp.mean, yerr=[[tp.mean - tp.lo], [tp.hi - tp.mean]], color=color(policy),
                   hatch="////" if opt else None, edgecolor="white", linewidth=0.4, width=0.66,
                   error_kw={"elinewidth": 0.8, "capsize": 2})
            if i:
                ax.annotate(_gain_label(gain.mean), xy=(i, tp.hi), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=6.5)
            key = {"policy": POLICY_LABELS[policy], "compute_opt": opt}
            name = label.replace("\n", "").replace("Spec-", "Spec")
            cells.append(_stat_cell(f"{name}/throughput", "throughput", tp, key))
            cells.append(_stat_cell(f"{name}/gain", "gain", gain, key))
        ax.set_xticks(range(len(COMPONENT_BARS)), [b[2] for b in COMPONENT_BARS])
        ax.set_ylabel("Throughput (tok/s)")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
        ax.grid(axis="x", visible=False)
        fig.tight_layout()
    doc = TableDoc("fig6_component", "Figure 6: cold-cache component analysis", cfg["profile"], cells,
                   meta={"platform": sel.platform, "model": sel.model, "ci": CI_META, "note": _ci_note(cfg, g)})
    return FigureResult(fig, doc)


# --------------------------------------------------------------------------------------------- per-layer recall


def figure_recall_per_layer(per_layer: pd.DataFrame, cfg: Mapping[str, Any],
                            path: Path | str = "per_layer.csv") -> FigureResult:
    """ExpertRecall@K per target layer for every method (mean over workloads), one panel per model."""
    models = [m for m in cfg["models"] if m in set(per_layer["model"])]
    if not models:
        raise RenderInputError(f"{path}: no rows for any configured model ({', '.join(cfg['models'])}) "
                               "(column 'model')")
    cells = []
    with _theme():
        fig, axes = plt.subplots(len(models), 1, figsize=(COLUMN_WIDTH_IN, 0.7 + 1.6 * len(models)), squeeze=False,
                                 sharey=True)
        for ax, m in zip(axes[:, 0], models, strict=True):
            k = cfg["models"][m]["top_k"]
            native = [b.M for b in model_budgets(cfg, m) if b.M == k]
            mk = native[0] if native else k
            sub = per_layer[(per_layer["model"] == m) & (per_layer["M"] == mk)]
            if sub.empty:
                raise RenderInputError(f"{path}: no rows with model={m!r}, M={mk} (column 'M'; the native budget K)")
            mean = sub.groupby(["method", "layer"], sort=True)["expert_recall"].mean().reset_index()
            methods = [x for x in METHOD_ORDER if x in set(mean["method"])]
            for meth in methods:
                gm = mean[mean["method"] == meth]
                lw = 1.8 if meth == "specprefetch" else 1.0
                ax.plot(gm["layer"], gm["expert_recall"] * 100.0, color=color(meth), marker="o", linewidth=lw,
                        markersize=2.5, label=method_label(meth), zorder=3 if meth == "specprefetch" else 2)
                for r in gm.itertuples():
                    cells.append(Cell(id=f"{model_display(cfg, m)}/{method_label(meth)}/layer{r.layer}",
                                      quantity="recall", value=float(r.expert_recall) * 100.0,
                                      keys={"model": model_display(cfg, m), "method": method_label(meth),
                                            "layer": int(r.layer), "M": mk}))
            ax.set_title(f"{_display(cfg, m)}, $M=K={mk}$", loc="left")
            ax.set_ylabel(f"R@{mk} (%)")
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        axes[-1, 0].set_xlabel("Target MoE layer $l+1$")
        handles = {}
        for ax in axes[:, 0]:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        fig.legend(list(handles.values()), list(handles.keys()), loc="upper center", ncol=4, frameon=False,
                   bbox_to_anchor=(0.5, 1.0), columnspacing=0.8, handlelength=1.5)
        rows = math.ceil(len(handles) / 4)
        fig.tight_layout(rect=(0, 0, 1, 1 - (0.05 + 0.13 * rows) / fig.get_figheight()))
    doc = TableDoc("fig_recall_per_layer", "Per-layer ExpertRecall@K per method", cfg["profile"], cells,
                   meta={"note": _caption_note(cfg)})
    return FigureResult(fig, doc)


@dataclass
class LookaheadRuntime:
    """The runtime's lookahead experiment, summarized (:func:`lookahead_runtime`)."""

    points: pd.DataFrame   # per (storage, kind, d): kind "ahead" (d layers ahead at M(d)) or "control" (1 at M(d))
    off: pd.DataFrame      # per storage: OFF's throughput
    window: pd.DataFrame   # per (storage, d > 1): the paired gain of d ahead over 1 ahead at the same budget M(d)
    budgets: dict[str, dict[int, int]]
    model: str
    platform: str
    note: str


def lookahead_runtime(runs: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any]) -> LookaheadRuntime | None:
    """The runtime's lookahead experiment (``device.lookahead``; None when runs.csv has none -- the embedded default
    does not run it, config/overlays/extensions.yaml does): per storage OFF, SpecPrefetch prefetching d layers ahead
    at the budget M(d), and the control, one layer ahead at M(d) (``M(1)``: the smallest budget one layer ahead).
    Summarized with the paired gain vs the block's OFF, ReadyRecall and the bound when recorded; ``window``: per
    repeat tps(d ahead, M(d)) / tps(1 ahead, M(d)) - 1, what the longer window adds at the same budget."""
    sel = select_device(runs, path, cfg)
    rows = runs[(runs["platform"] == sel.platform) & (runs["model"] == sel.model)
                & (runs["source"] == sel.sources[0]) & (runs["experiment"] == "lookahead")]
    rows = rows[rows["policy"].isin(["off", "specprefetch"])]
    if rows.empty:
        return None
    require_rows(rows, path, "the look-ahead figure's runtime row", policy="specprefetch")
    ahead = pd.to_numeric(rows["lookahead"], errors="coerce") if "lookahead" in rows.columns else None
    rows = rows.assign(lookahead=1 if ahead is None else ahead.fillna(1).astype(int))
    g = paired_gains(rows, path).assign(ready_pct=lambda d: d["ready_recall"] * 100.0)
    extra = []
    if bound_values(g, path) is not None:
        g = g.assign(**{BOUND_COLUMN: pd.to_numeric(g[BOUND_COLUMN], errors="coerce")})
        extra = [BOUND_COLUMN]
    spec = g[g["policy"] == "specprefetch"].assign(m_max=lambda d: d["m_max"].astype(int))
    parts, budgets, window = [], {}, []
    for st, gs in spec.groupby("storage", sort=False):
        budgets[st] = {}
        for d, gd in gs.groupby("lookahead", sort=True):
            ms = sorted(set(gd["m_max"]))
            if int(d) > 1 and len(ms) > 1:
                raise RenderInputError(f"{path}: SpecPrefetch {d} layers ahead on {st!r} ran at several budgets "
                                       f"({ms}; column 'm_max'): one budget per distance")
            budgets[st][int(d)] = ms[0]
        for d, m in budgets[st].items():
            mine = gs[(gs["lookahead"] == d) & (gs["m_max"] == m)]
            ctrl = gs[(gs["lookahead"] == 1) & (gs["m_max"] == m)]
            parts += [mine.assign(kind="ahead", d=d), ctrl.assign(kind="control", d=d)]
            if d > 1 and not ctrl.empty:
                pair = mine.merge(ctrl, on="repeat", suffixes=("", "_ctrl"))
                window += [{"storage": st, "d": d, "repeat": r.repeat, "m_max": m,
                            "window_pct": (r.tokens_per_s / r.tokens_per_s_ctrl - 1.0) * 100.0}
                           for r in pair.itertuples()]
    points = summarize(pd.concat(parts, ignore_index=True), ["storage", "kind", "d"],
                       ["tokens_per_s", "gain_pct", "ready_pct", *extra])
    win = pd.DataFrame(window)
    win = summarize(win, ["storage", "d", "m_max"], ["window_pct"]) if not win.empty else win
    off = summarize(g[g["policy"] == "off"], ["storage"], ["tokens_per_s"])
    return LookaheadRuntime(points, off, win, budgets, sel.model, sel.platform, repeats_note(g))


def _lookahead_runtime_panel(ax: Any, rt: LookaheadRuntime, storage: str, cells: list[Cell]) -> None:
    """One storage of the runtime row: SpecPrefetch's throughput d layers ahead at M(d) and, dashed, one layer ahead
    at the same M(d) (95 % CIs; labels: the paired gain vs OFF and the budget), OFF's throughput as a band, the
    runtime's bound as ticks."""
    off = rt.off[rt.off["storage"] == storage]
    if not off.empty:
        o = off.iloc[0]
        ax.axhline(o["tokens_per_s_mean"], color=color("off"), linewidth=1.0, label=POLICY_LABELS["off"])
        ax.axhspan(o["tokens_per_s_lo"], o["tokens_per_s_hi"], color=color("off"), alpha=0.18, linewidth=0)
        cells.append(_stat_cell(f"runtime/{storage}/OFF/throughput", "throughput", o["tokens_per_s_stats"],
                                {"storage": storage, "policy": POLICY_LABELS["off"]}))
    part = rt.points[rt.points["storage"] == storage]
    c = color("specprefetch")
    bound = f"{BOUND_COLUMN}_mean"
    for kind, style, label in (("ahead", "-", f"{POLICY_LABELS['specprefetch']}, $d$ ahead"),
                               ("control", "--", "1 ahead, same $M$")):
        pts = part[part["kind"] == kind].sort_values("d")
        if pts.empty:
            continue
        ax.errorbar(pts["d"] + (0.08 if kind == "control" else 0.0), pts["tokens_per_s_mean"],
                    yerr=_yerr(pts["tokens_per_s_mean"], pts["tokens_per_s_lo"], pts["tokens_per_s_hi"]), color=c,
                    linestyle=style, marker="o" if kind == "ahead" else "s", markersize=3 if kind == "ahead" else 2.5,
                    linewidth=1.4 if kind == "ahead" else 0.9, elinewidth=0.8, capsize=2, label=label,
                    alpha=1.0 if kind == "ahead" else 0.75)
        for r in pts.itertuples():
            d = int(r.d)
            if kind == "control" and d == 1:
                continue  # one layer ahead at M(1) is the d = 1 point itself
            key = {"storage": storage, "policy": POLICY_LABELS["specprefetch"], "d": d,
                   "lookahead": d if kind == "ahead" else 1, "m_max": rt.budgets[storage][d]}
            base = f"runtime/{storage}/d{d}" + ("" if kind == "ahead" else "/control")
            cells.append(_stat_cell(f"{base}/throughput", "throughput", r.tokens_per_s_stats, key))
            cells.append(_stat_cell(f"{base}/gain", "gain", r.gain_pct_stats, key))
            if r.ready_pct_stats is not None:
                cells.append(_stat_cell(f"{base}/ready_recall", "ready_recall", r.ready_pct_stats, key))
            if kind == "ahead":
                top = max(r.tokens_per_s_hi, getattr(r, bound, float("nan")) if bound in pts.columns else 0.0)
                if bound in pts.columns and math.isfinite(getattr(r, bound)):
                    ax.plot([d], [getattr(r, bound)], marker="_", markersize=9, markeredgewidth=1.4,
                            color="black", linestyle="none", label="bound" if d == int(pts["d"].min()) else None)
                ax.annotate(f"{r.gain_pct_stats.mean:+.0f}%\n$M$={key['m_max']}", xy=(d, top),  # narrow panels
                            xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=5.5,
                            color=c)
    ds = sorted({int(d) for d in part["d"]})
    if ds:  # room for the gain labels centred on the first and last d
        ax.set_xlim(ds[0] - 0.45, ds[-1] + 0.45)
    win = rt.window[rt.window["storage"] == storage] if not rt.window.empty else rt.window
    for r in win.itertuples():
        cells.append(_stat_cell(f"runtime/{storage}/d{int(r.d)}/window_gain", "gain", r.window_pct_stats,
                                {"storage": storage, "d": int(r.d), "m_max": int(r.m_max),
                                 "vs": f"1 ahead at M={int(r.m_max)}"}))
    ax.set_title(storage_label(storage), loc="left")


def figure_lookahead(lookahead: pd.DataFrame, cfg: Mapping[str, Any], path: Path | str = "lookahead.csv",
                     runs: pd.DataFrame | None = None, runs_path: Path | str = "runs.csv") -> FigureResult:
    """ExpertRecall@K predicting the experts d MoE layers ahead (layer l predicts layer l+d; d = 1 is the paper's
    next-layer prediction, Table 1's values), per model (rows) and workload (columns, then their unweighted mean),
    one line per method with the t-interval over training seeds: how much predictability a longer prefetch window
    gives up, and whether a learned adapter holds it better than the next layers' gates (beyond the paper). With
    runs.csv's lookahead experiment, a last row per storage: the runtime's throughput prefetching d layers ahead
    against OFF (paired bootstrap CIs over repeats), at the window rule's budget on the window summed over d layers."""
    models = [m for m in cfg["models"] if m in set(lookahead["model"])]
    if not models:
        raise RenderInputError(f"{path}: no rows for any configured model ({', '.join(cfg['models'])}) "
                               "(column 'model')")
    workloads = [w for w in cfg["workloads"] if w in set(lookahead["workload"])]
    columns = [*workloads, None]  # None: the mean over workloads
    methods = [m for m in METHOD_ORDER if m in set(lookahead["method"])]
    rt = lookahead_runtime(runs, runs_path, cfg) if runs is not None else None
    rt_storages = [s for s in STORAGE_ORDER if rt is not None and s in set(rt.points["storage"])]
    if len(rt_storages) > len(columns):
        raise RenderInputError(f"{runs_path}: the lookahead experiment has {len(rt_storages)} storages, more than "
                               f"the figure's {len(columns)} columns")
    cells = []
    with _theme():
        n_rows = len(models) + (1 if rt_storages else 0)
        fig, axes = plt.subplots(n_rows, len(columns), squeeze=False, sharex=True, sharey="row",
                                 figsize=(TEXT_WIDTH_IN, 0.75 + 1.55 * n_rows))
        for i, m in enumerate(models):
            k = int(cfg["models"][m]["top_k"])
            sub = lookahead[(lookahead["model"] == m) & (lookahead["M"] == k)]
            if sub.empty:
                raise RenderInputError(f"{path}: no rows with model={m!r}, M={k} (column 'M'; the native budget K)")
            for ax, w in zip(axes[i], columns, strict=True):
                part = sub if w is None else sub[sub["workload"] == w]
                wname = "Mean" if w is None else str(cfg["workloads"][w]["display_name"])
                for meth in methods:
                    pts = []
                    for d, g in part[part["method"] == meth].groupby("lookahead", sort=True):
                        per_seed = {int(s): float(gs["expert_recall"].mean()) * 100.0 for s, gs in g.groupby("seed")}
                        f = seed_fields(per_seed)
                        pts.append((int(d), f))
                        cells.append(Cell(id=f"{model_display(cfg, m)}/{wname}/{method_label(meth)}/d{d}",
                                          quantity="recall", keys={"model": model_display(cfg, m), "workload": wname,
                                                                   "method": method_label(meth), "d": int(d), "M": k},
                                          **f))
                    if not pts:
                        continue
                    ds, ys = [d for d, _ in pts], [f["value"] for _, f in pts]
                    err = [[f["value"] - f.get("lo", f["value"]) for _, f in pts],
                           [f.get("hi", f["value"]) - f["value"] for _, f in pts]]
                    lw = 1.6 if meth == "specprefetch" else 1.0
                    ax.errorbar(ds, ys, yerr=err, color=color(meth), marker="o", markersize=2.8, linewidth=lw,
                                elinewidth=0.7, capsize=1.5, label=method_label(meth),
                                zorder=3 if meth == "specprefetch" else 2)
                ax.set_title(wname if i == 0 else "", loc="left")
                ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
                if i == n_rows - 1:
                    ax.set_xlabel("Look-ahead $d$")
            axes[i, 0].set_ylabel(f"{_display(cfg, m)}\nR@{k} (%)")
        meta_rt: dict[str, Any] = {}
        if rt is not None and rt_storages:
            last = axes[-1]
            for j, ax in enumerate(last):
                if j < len(rt_storages):
                    _lookahead_runtime_panel(ax, rt, rt_storages[j], cells)
                    ax.set_xlabel("Look-ahead $d$")
                else:
                    ax.set_axis_off()
            cols = [c for c in ("tokens_per_s_hi", f"{BOUND_COLUMN}_mean") if c in rt.points.columns]
            last[0].set_ylim(0, float(rt.points[cols].max().max()) * 1.3)  # room for the labels (one y per row)
            last[0].set_ylabel(f"Runtime, {_display(cfg, rt.model)}\nThroughput (tok/s)")
            spare = last[len(rt_storages)] if len(rt_storages) < len(last) else None
            leg = (spare or last[0]).legend(*last[0].get_legend_handles_labels(), frameon=False, fontsize=6,
                                            loc="center left" if spare is not None else "lower left")
            leg.set_in_layout(False)  # drawn in the spare panel's room: it must not shrink the panels
            meta_rt = {"model": rt.model, "platform": rt.platform,
                       "m_max": {st: {str(d): m for d, m in b.items()} for st, b in rt.budgets.items()},
                       "ci": CI_META, "note": rt.note}
        handles: dict[str, Any] = {}
        for ax in axes[:len(models)].flat:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        fig.legend(list(handles.values()), list(handles.keys()), loc="upper center", ncol=min(7, len(handles)),
                   frameon=False, bbox_to_anchor=(0.5, 1.0), columnspacing=0.9, handlelength=1.6)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    doc = TableDoc("fig_lookahead", "ExpertRecall@K vs look-ahead distance", cfg["profile"], cells,
                   meta={"note": _caption_note(cfg), "lookahead": sorted(int(d) for d in set(lookahead["lookahead"])),
                         "ci": "95 % t-interval over training seeds", **({"runtime": meta_rt} if meta_rt else {})})
    return FigureResult(fig, doc)


PARETO_MARKERS = ("o", "s", "P", "X")  # one per model (panels a, b)
STORAGE_MARKERS = ("D", "^", "v", "<", ">", "h")  # one per storage (panel c)


def pareto_points(recall: pd.DataFrame, params: pd.DataFrame, cost: pd.DataFrame, cfg: Mapping[str, Any],
                  paths: Mapping[str, Path | str]) -> pd.DataFrame:
    """Per model and live method (the oracle excluded: it reads the routing it predicts): R@K at M = K as the
    unweighted mean over the configured workloads every method was evaluated on (all of them in a pipeline run), per
    seed, then over seeds (``recall``: :func:`seed_fields`, a t-interval when the method has two or more seeds), its
    trainable parameters and its prediction cost (% of one MoE layer, with the bootstrap CI over timing rounds). A
    method missing from params or cost is an error naming it."""
    from specprefetch import registry

    live = {m for m, spec in registry.methods().items() if not spec.sees_future}
    methods = [m for m in cfg["predictors"]["methods"] if m in live]
    rows = []
    for model in cfg["models"]:
        k = int(cfg["models"][model]["top_k"])
        rec = recall[(recall["model"] == model) & (recall["M"] == k) & recall["workload"].isin(list(cfg["workloads"]))]
        # the workloads every method was evaluated on, so every point averages the same ones
        common = [w for w in cfg["workloads"] if all(((rec["method"] == m) & (rec["workload"] == w)).any()
                                                     for m in methods)]
        if not common:
            raise RenderInputError(f"{paths['recall']}: no workload with R@{k} rows of every method "
                                   f"({', '.join(methods)}) for model={model!r} (column 'workload')")
        rec = rec[rec["workload"].isin(common)]
        for method in methods:
            r = rec[rec["method"] == method]
            per_seed = {int(s): float(g["expert_recall"].mean()) * 100.0 for s, g in r.groupby("seed")}
            par = require_rows(params, paths["params"], "the Pareto figure", model=model, method=method)
            c = require_rows(cost, paths["predictor_cost"], "the Pareto figure", model=model, method=method)
            c0 = c.iloc[0]
            rows.append({"model": model, "method": method, "params": int(par["trainable_params"].iloc[0]),
                         "cost_pct": float(c0["ratio"]) * 100.0, "cost_lo": float(c0["ratio_lo"]) * 100.0,
                         "cost_hi": float(c0["ratio_hi"]) * 100.0, "rounds": int(c0["rounds"]),
                         "layer_us": float(c0["layer_us"]), "workloads": len(common),
                         "M": k, "recall": seed_fields(per_seed)})
    return pd.DataFrame(rows)


def _xy_err(ax: Any, x: float, y: float, xlo: float | None, xhi: float | None, ylo: float | None,
            yhi: float | None, **style: Any) -> None:
    """One point with its CIs on either axis (absent: no bar)."""
    xerr = None if xlo is None else [[x - xlo], [xhi - x]]
    yerr = None if ylo is None else [[y - ylo], [yhi - y]]
    ax.errorbar([x], [y], xerr=xerr, yerr=yerr, linestyle="none", markersize=4.5, elinewidth=0.8, capsize=1.5,
                markeredgecolor="white", markeredgewidth=0.4, **style)


def _matched_points(runs: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any]) -> pd.DataFrame:
    """Per storage and prefetching policy of the matched-budget experiment: the paired gain vs OFF and the
    ReadyRecall (%), each a :class:`RepeatStats` (empty when the runs hold no matched experiment)."""
    sel = select_device(runs, path, cfg)
    sub = runs[(runs["platform"] == sel.platform) & (runs["model"] == sel.model) & (runs["source"] == sel.sources[0])
               & (runs["experiment"] == "matched")]
    if sub.empty:
        return pd.DataFrame()
    g = paired_gains(sub, path)
    g = g[g["policy"] != "off"].assign(ready_pct=lambda d: d["ready_recall"] * 100.0)
    out = summarize(g, ["storage", "policy", "m_max"], ["gain_pct", "ready_pct"])
    return out.assign(model=sel.model)


def figure_pareto(recall: pd.DataFrame, params: pd.DataFrame, cost: pd.DataFrame, runs: pd.DataFrame | None,
                  cfg: Mapping[str, Any], paths: Mapping[str, Path | str]) -> FigureResult:
    """Beyond the paper: what each predictor buys for what it costs. (a) R@K against trainable parameters (symlog:
    the training-free methods at 0), (b) R@K against the prediction time per layer pair as a share of one MoE
    layer's compute (the budget a next-layer prediction has to fit in), (c) with runs.csv's matched-budget
    experiment: the runtime's paired throughput gain vs OFF against its ReadyRecall, per storage and policy (does
    recall turn into throughput). Error bars: the seed t-interval (recall), the bootstrap over timing rounds (cost),
    the paired bootstrap over repeats (device)."""
    pts = pareto_points(recall, params, cost, cfg, paths)
    dev = _matched_points(runs, paths.get("runs", "runs.csv"), cfg) if runs is not None else pd.DataFrame()
    models = list(dict.fromkeys(pts["model"]))
    marker = {m: PARETO_MARKERS[i % len(PARETO_MARKERS)] for i, m in enumerate(models)}
    cells: list[Cell] = []
    for r in pts.itertuples():
        mdisp, label = model_display(cfg, r.model), method_label(r.method)
        keys = {"model": mdisp, "method": label, "M": r.M, "workloads": r.workloads}
        cells += [Cell(id=f"{mdisp}/{label}/recall", quantity="recall", keys=keys, **r.recall),
                  Cell(id=f"{mdisp}/{label}/params", quantity="params", value=float(r.params), keys=keys),
                  Cell(id=f"{mdisp}/{label}/cost", quantity="share_pct", value=r.cost_pct, lo=r.cost_lo,
                       hi=r.cost_hi, keys={**keys, "rounds": r.rounds})]
    panels = 3 if not dev.empty else 2
    with _theme():
        fig, axes = plt.subplots(1, panels, figsize=(TEXT_WIDTH_IN if panels == 3 else COLUMN_WIDTH_IN * 1.6, 2.5))
        axes[1].sharey(axes[0])
        for r in pts.itertuples():
            style = {"color": color(r.method), "marker": marker[r.model]}
            y, lo, hi = r.recall["value"], r.recall.get("lo"), r.recall.get("hi")
            _xy_err(axes[0], float(r.params), y, None, None, lo, hi, **style)
            _xy_err(axes[1], r.cost_pct, y, r.cost_lo, r.cost_hi, lo, hi, **style)
        axes[0].set_xscale("symlog", linthresh=100.0, linscale=0.4)
        axes[0].set_xlim(left=-20.0)
        axes[0].set_xlabel("Trainable parameters")
        axes[1].set_xscale("log")
        axes[1].set_xlabel("Prediction cost (% of one MoE layer)")
        axes[0].set_ylabel("R@$K$ (%), mean over workloads")
        axes[0].set_title("(a) recall vs size", loc="left")
        axes[1].set_title("(b) recall vs compute", loc="left")
        handles = [matplotlib.lines.Line2D([], [], color=color(m), marker="o", linestyle="none", markersize=4.5,
                                           label=method_label(m)) for m in dict.fromkeys(pts["method"])]
        handles += [matplotlib.lines.Line2D([], [], color="#555555", marker=marker[m], linestyle="none",
                                            markersize=4.5, label=_display(cfg, m)) for m in models]
        meta_dev: dict[str, Any] = {}
        if not dev.empty:
            ax = axes[2]
            storages = [s for s in STORAGE_ORDER if s in set(dev["storage"])]
            smark = {s: STORAGE_MARKERS[i % len(STORAGE_MARKERS)] for i, s in enumerate(storages)}
            for r in dev.itertuples():
                gs, rs = r.gain_pct_stats, r.ready_pct_stats
                if rs is None:
                    continue
                _xy_err(ax, rs.mean, gs.mean, rs.lo, rs.hi, gs.lo, gs.hi, color=color(r.policy),
                        marker=smark[r.storage])
                keys = {"storage": r.storage, "policy": POLICY_LABELS[r.policy], "m_max": int(r.m_max)}
                cells += [_stat_cell(f"{r.storage}/{POLICY_LABELS[r.policy]}/gain", "gain", gs, keys),
                          _stat_cell(f"{r.storage}/{POLICY_LABELS[r.policy]}/ready", "ready_recall", rs, keys)]
            ax.axhline(0.0, color="#888888", linewidth=0.6, linestyle=":")
            ax.set_xlabel("ReadyRecall (%)")
            ax.set_ylabel("Gain vs OFF (%)")
            ax.set_title(f"(c) runtime, {_display(cfg, str(dev['model'].iloc[0]))}", loc="left")
            for p in dict.fromkeys(dev["policy"]):
                if POLICY_LABELS[p] not in {h.get_label() for h in handles}:  # a policy named as its method
                    handles.append(matplotlib.lines.Line2D([], [], color=color(p), marker="o", linestyle="none",
                                                           markersize=4.5, label=POLICY_LABELS[p]))
            handles += [matplotlib.lines.Line2D([], [], color="#555555", marker=smark[s], linestyle="none",
                                                markersize=4.5, label=storage_label(s)) for s in storages]
            meta_dev = {"model": str(dev["model"].iloc[0]),
                        "m_max_per_storage": {s: sorted({int(v) for v in dev[dev["storage"] == s]["m_max"]})
                                              for s in storages}}
        ncol = min(len(handles), 7 if panels == 3 else 4)
        fig.legend(handles=handles, loc="upper center", ncol=ncol, frameon=False, bbox_to_anchor=(0.5, 1.0),
                   columnspacing=0.8, handlelength=1.0, fontsize=6)
        rows_leg = math.ceil(len(handles) / ncol)
        fig.tight_layout(rect=(0, 0, 1, 1 - (0.04 + 0.11 * rows_leg) / fig.get_figheight()))
    layer = {model_display(cfg, m): float(pts[pts["model"] == m]["layer_us"].iloc[0]) for m in models}
    doc = TableDoc("fig_pareto", "Recall against predictor size and compute; runtime gain against ReadyRecall",
                   cfg["profile"], cells,
                   meta={"note": _caption_note(cfg), "layer_us": layer, "rounds": int(pts["rounds"].iloc[0]),
                         "matched": meta_dev, "ci": CI_META})
    return FigureResult(fig, doc)


# --------------------------------------------------------------------------------------------- budget rules
# The budget experiment's rules (beyond the paper), in drawing order: key -> (label, colour, marker). "window" and
# "layer" are the paper's rule per storage and per layer; "dp", "ewma" and "simulated" come with device.extra_rules.
BUDGET_RULES: dict[str, tuple[str, str, str]] = {
    "window": (r"$\lfloor W/t \rfloor$ (paper)", "#0072B2", "o"),
    "layer": (r"$\lfloor W_l/t \rfloor$ per layer", "#56B4E9", "s"),
    "dp": ("DP per layer", "#009E73", "D"),
    "ewma": ("EWMA, online", "#D55E00", "^"),
    "simulated": ("simulated rule", "#CC79A7", "v"),
}


def _rule_of(row: Any) -> str:
    """A budget-experiment row's rule: its ``budget_rule``, else the paper's per layer (per-layer budgets) or per
    storage."""
    rule = row.get("budget_rule")
    if isinstance(rule, str) and rule.strip():
        return rule.strip()
    layers = row.get("layer_m_max")
    return "layer" if isinstance(layers, str) and layers.strip() else "window"


def _mean_budget(row: Any) -> float:
    """The mean budget per prediction step: ``m_max_mean`` when recorded, else the per-layer budgets' mean or M_max."""
    v = pd.to_numeric(row.get("m_max_mean"), errors="coerce")
    if pd.notna(v):
        return float(v)
    layers = row.get("layer_m_max")
    if isinstance(layers, str) and layers.strip():
        ms = [int(m) for m in layers.split("/")]
        return sum(ms) / len(ms)
    return float(row["m_max"])


def budget_rule_points(runs: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any]
                       ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, Any]:
    """The budget experiment per storage and rule (:data:`BUDGET_RULES`): SpecPrefetch's paired gain vs the block's
    OFF, throughput and mean budget per prediction step (:func:`summarize`); the loss against the block's fastest
    rule, ``(tps(best) - tps(rule)) / tps(best)`` per repeat (one block: paired); and, where the sweep ran on the
    storage, its paired gains per uniform budget (its own block and OFF). Returns (points, losses, sweep, selection)."""
    sel = select_device(runs, path, cfg)
    mine = runs[(runs["platform"] == sel.platform) & (runs["model"] == sel.model)
                & (runs["source"] == sel.sources[0])]
    rows = mine[mine["experiment"] == "budget"]
    require_rows(rows, path, "the budget-rule figure", policy="specprefetch")
    g = paired_gains(rows[rows["policy"].isin(["off", "specprefetch"])], path)
    spec = g[g["policy"] == "specprefetch"]
    spec = spec.assign(rule=[_rule_of(r) for _, r in spec.iterrows()],
                       budget=[_mean_budget(r) for _, r in spec.iterrows()])
    unknown = sorted(set(spec["rule"]) - set(BUDGET_RULES))
    if unknown:
        raise RenderInputError(f"{path}: unknown budget_rule {', '.join(unknown)} (one of {', '.join(BUDGET_RULES)})")
    points = summarize(spec, ["storage", "rule"], ["gain_pct", "tokens_per_s", "budget"])
    losses = []
    for st, gs in spec.groupby("storage", sort=False):
        tps = gs.pivot_table(index="repeat", columns="rule", values="tokens_per_s")
        best = str(tps.mean().idxmax())
        for rule in tps.columns:
            loss = (tps[best] - tps[rule]) / tps[best] * 100.0
            losses.append({"storage": st, "rule": rule, "best": best,
                           "loss": repeat_stats(loss, pd.Series(loss.index, index=loss.index))})
    sweep = mine[(mine["experiment"] == "sweep") & mine["policy"].isin(["off", "specprefetch"])
                 & mine["storage"].isin(set(spec["storage"]))]
    sweep_pts = pd.DataFrame()
    if not sweep.empty and (sweep["policy"] == "specprefetch").any():
        sg = paired_gains(sweep, path)
        sweep_pts = summarize(sg[sg["policy"] == "specprefetch"], ["storage", "m_max"], ["gain_pct"])
    return points, pd.DataFrame(losses), sweep_pts, sel


def figure_budget_rules(runs: pd.DataFrame, cfg: Mapping[str, Any], path: Path | str = "runs.csv") -> FigureResult:
    """Beyond the paper: the budget rules side by side in one block per storage (:func:`budget_rule_points`) --
    SpecPrefetch's paired gain vs OFF against its mean budget per prediction step, one marker per rule (95 % CIs),
    on the grey line of the uniform-budget sweep where it ran on that storage (its own block, for reference). Cells:
    ``<storage>/<rule>/{gain,throughput,budget,loss}``; ``loss`` against the block's fastest rule."""
    points, losses, sweep, sel = budget_rule_points(runs, path, cfg)
    storages = [s for s in STORAGE_ORDER if s in set(points["storage"])]
    cells: list[Cell] = []
    n = len(storages)
    cols = min(n, 4)
    nrows = math.ceil(n / cols)
    with _theme():
        fig, axes = plt.subplots(nrows, cols, figsize=(TEXT_WIDTH_IN if cols > 2 else COLUMN_WIDTH_IN * 1.6,
                                                       0.75 + 1.9 * nrows), squeeze=False, sharey=True, sharex=True)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        for ax, st in zip(axes.flat, storages):
            sw = sweep[sweep["storage"] == st] if not sweep.empty else sweep
            if not sw.empty:
                sw = sw.sort_values("m_max")
                ax.errorbar(sw["m_max"], sw["gain_pct_mean"], yerr=_yerr(sw["gain_pct_mean"], sw["gain_pct_lo"],
                                                                          sw["gain_pct_hi"]),
                            color="#9E9E9E", linestyle="--", marker=".", markersize=3, linewidth=0.9, elinewidth=0.6,
                            capsize=1.5, label="uniform $M$ sweep (own block)", zorder=1)
            part = points[points["storage"] == st]
            loss_of = {r["rule"]: r for _, r in losses[losses["storage"] == st].iterrows()}
            for rule, (label, colour, marker) in BUDGET_RULES.items():
                r = part[part["rule"] == rule]
                if r.empty:
                    continue
                r = r.iloc[0]
                dodge = 2.0 ** (0.07 * (list(BUDGET_RULES).index(rule) - 1.5))  # equal budgets stay visible
                ax.errorbar([r["budget_mean"] * dodge], [r["gain_pct_mean"]],
                            yerr=[[r["gain_pct_mean"] - r["gain_pct_lo"]], [r["gain_pct_hi"] - r["gain_pct_mean"]]],
                            color=colour, marker=marker, markersize=5, linestyle="none", elinewidth=0.9, capsize=2,
                            markeredgecolor="white", markeredgewidth=0.5, label=label, zorder=3)
                # the configuration is the rule's budget (``m_max``: its mean per prediction step); a rule beyond
                # the paper's runs only where its budgets differ from the others', a loss only beside another rule
                keys = {"storage": st, "rule": label, "budget_rule": rule, "m_max": round(float(r["budget_mean"]), 3),
                        **({CHOSEN: True} if rule != "window" else {})}
                cells += [_stat_cell(f"{st}/{rule}/gain", "gain", r["gain_pct_stats"], keys),
                          _stat_cell(f"{st}/{rule}/throughput", "throughput", r["tokens_per_s_stats"], keys),
                          _stat_cell(f"{st}/{rule}/budget", "m_max", r["budget_stats"], keys)]
                lo = loss_of.get(rule)
                if lo is not None and lo["best"] != rule:
                    cells.append(_stat_cell(f"{st}/{rule}/loss", "gain", lo["loss"],
                                            {**keys, "best": lo["best"], CHOSEN: True}))
            ax.axhline(0.0, color="#888888", linewidth=0.6, linestyle=":")
            ax.set_title(storage_label(st), loc="left")
            if len(loss_of) > 1:
                best = next(iter(loss_of.values()))["best"]
                ax.text(0.98, 0.04, f"fastest mean: {BUDGET_RULES[best][0]}", transform=ax.transAxes, ha="right",
                        va="bottom", fontsize=6, color="#444444")
        top = max([16.0, *points["budget_hi"], *(sweep["m_max"] if not sweep.empty else [])])
        axes.flat[0].set_xscale("log", base=2)
        axes.flat[0].set_xlim(0.75, top * 1.3)
        axes.flat[0].xaxis.set_major_locator(matplotlib.ticker.FixedLocator([2.0 ** i for i in range(8)]))
        axes.flat[0].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        for row in axes:
            row[0].set_ylabel("Gain vs OFF (%)")
        fig.supxlabel("Mean budget per prediction step (experts)", fontsize=7.5)
        handles: dict[str, Any] = {}
        for ax in axes.flat[:n]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        order = [v[0] for v in BUDGET_RULES.values()]
        labels = sorted(handles, key=lambda lab: order.index(lab) if lab in order else len(order))
        fig.legend([handles[lab] for lab in labels], labels, loc="upper center", ncol=min(len(labels), 5),
                   frameon=False, bbox_to_anchor=(0.5, 1.0), columnspacing=1.0, handlelength=1.4, fontsize=6.5)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    doc = TableDoc("fig_budget_rules", "Budget rules: gain vs mean budget per storage", cfg["profile"], cells,
                   meta={"note": _caption_note(cfg, repeats_note(runs[runs["experiment"] == "budget"])),
                         "model": sel.model, "platform": sel.platform, "ci": CI_META,
                         "rules": {k: v[0] for k, v in BUDGET_RULES.items() if k in set(points["rule"])}})
    return FigureResult(fig, doc)


# --------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class FigureSpec:
    name: str
    inputs: tuple[str, ...]
    build: Callable[[Mapping[str, Path], Mapping[str, Any]], FigureResult]
    caption: str
    paper_label: str
    optional: tuple[str, ...] = ()  # read when given (the DAG always gives them; an older archive may lack them)


def _with_curve(fn: Callable[..., FigureResult]) -> Callable[[Mapping[str, Path], Mapping[str, Any]], FigureResult]:
    """A runs.csv figure that also draws the simulator's curves when budget_curve.csv is given."""
    def build(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> FigureResult:
        return fn(read_result_csv(inputs["runs"], "runs"), cfg, inputs["runs"], read_curve(inputs.get("budget_curve")))
    return build


def _from_csv(contract: str, fn: Callable[..., FigureResult]) -> Callable[[Mapping[str, Path], Mapping[str, Any]],
                                                                           FigureResult]:
    def build(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> FigureResult:
        path = inputs[contract]
        return fn(read_result_csv(path, contract), cfg, path)
    return build


# --------------------------------------------------------------------------------------------- pre-attention
PRE_ATTENTION_METHODS = ("fate", "specprefetch", "pre_attention")  # the recall row: the paper's two and the extension


def pre_attention_runtime(runs: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any]
                          ) -> tuple[pd.DataFrame, Any] | None:
    """runs.csv's pre_attention experiment (beyond the paper; None when it has none -- config/overlays/extensions.yaml
    runs it): per storage, SpecPrefetch at the window rule's budget and the pre-attention policy at its own budget
    (the window rule on the attention window) and at SpecPrefetch's, each with its paired gain vs the block's OFF,
    throughput and ReadyRecall (:func:`summarize`). Returns (points, selection)."""
    sel = select_device(runs, path, cfg)
    rows = runs[(runs["platform"] == sel.platform) & (runs["model"] == sel.model)
                & (runs["source"] == sel.sources[0]) & (runs["experiment"] == "pre_attention")]
    if rows.empty:
        return None
    require_rows(rows, path, "the pre-attention figure's runtime row", policy="pre_attention")
    g = paired_gains(rows, path).assign(ready_pct=lambda d: d["ready_recall"] * 100.0)
    g = g[g["policy"] != "off"].assign(m_max=lambda d: d["m_max"].astype(int))
    return summarize(g, ["storage", "policy", "m_max"], ["gain_pct", "tokens_per_s", "ready_pct"]), sel


def figure_pre_attention(recall: pd.DataFrame, cfg: Mapping[str, Any], path: Path | str = "recall.csv",
                         runs: pd.DataFrame | None = None, runs_path: Path | str = "runs.csv") -> FigureResult:
    """Beyond the paper: the pre-attention predictor (layer l's experts from layer l's own pre-attention input) beside
    SpecPrefetch and FATE (layer l's router input). Top row, per model: ExpertRecall@K per workload and their mean
    (t-interval over training seeds). With runs.csv's pre_attention experiment, a bottom row per storage: the
    paired throughput gain vs OFF of SpecPrefetch at its budget and of the pre-attention policy at its own (the
    window rule on the attention window) and at SpecPrefetch's (paired bootstrap CIs over repeats; ticks: the
    budget; above each bar: its ReadyRecall)."""
    models = [m for m in cfg["models"] if m in set(recall["model"])]
    methods = [m for m in PRE_ATTENTION_METHODS if m in set(recall["method"])]
    if not models or not methods:  # a profile without pre_attention draws the others (its recall: Table 1's)
        raise RenderInputError(f"{path}: no rows of {', '.join(PRE_ATTENTION_METHODS)} for any configured model "
                               "(columns 'model', 'method')")
    workloads = [w for w in cfg["workloads"] if w in set(recall["workload"])]
    rt = pre_attention_runtime(runs, runs_path, cfg) if runs is not None else None
    storages = [s for s in STORAGE_ORDER if rt is not None and s in set(rt[0]["storage"])]
    cells: list[Cell] = []
    width = 0.8 / len(methods)
    with _theme():
        n_cols = max(len(models), len(storages))
        n_rows = 2 if storages else 1
        fig, axes = plt.subplots(n_rows, n_cols, squeeze=False, figsize=(TEXT_WIDTH_IN, 0.6 + 1.9 * n_rows))
        for ax, m in zip(axes[0], models):
            k = int(cfg["models"][m]["top_k"])
            sub = recall[(recall["model"] == m) & (recall["M"] == k)]
            names = [str(cfg["workloads"][w]["display_name"]) for w in workloads] + ["Mean"]
            for j, meth in enumerate(methods):
                part = sub[sub["method"] == meth]
                if part.empty:
                    raise RenderInputError(f"{path}: no rows with model={m!r}, method={meth!r}, M={k}")
                per_w = part.groupby(["workload", "seed"])["expert_recall"].mean().unstack("workload")
                fields = [seed_fields({int(s): float(v) * 100.0 for s, v in per_w[w].dropna().items()})
                          for w in workloads]
                fields.append(seed_fields({int(s): float(v) * 100.0 for s, v in per_w[workloads].mean(axis=1).items()}))
                xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(names))]
                ys = [f["value"] for f in fields]
                err = [[f["value"] - f.get("lo", f["value"]) for f in fields],
                       [f.get("hi", f["value"]) - f["value"] for f in fields]]
                ax.bar(xs, ys, width=width, color=color(meth), label=method_label(meth), edgecolor="white",
                       linewidth=0.4, yerr=err, error_kw={"elinewidth": 0.7, "capsize": 1.2})
                for wname, f in zip(names, fields, strict=True):
                    cells.append(Cell(id=f"{model_display(cfg, m)}/{wname}/{method_label(meth)}", quantity="recall",
                                      keys={"model": model_display(cfg, m), "workload": wname,
                                            "method": method_label(meth), "M": k}, **f))
            ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
            low = min(c.value for c in cells if c.keys.get("model") == model_display(cfg, m) and c.value is not None)
            ax.set_ylim(max(0.0, math.floor(low / 10.0) * 10.0 - 10.0), 100)  # the differences, not the bars' feet
            ax.set_ylabel(f"R@{k} (%)")
            ax.set_title(f"(a) {_display(cfg, m)}", loc="left")
        for ax in axes[0][len(models):]:
            ax.set_axis_off()
        meta_rt: dict[str, Any] = {}
        if rt is not None and storages:
            pts, sel = rt
            for ax, st in zip(axes[1], storages):
                part = pts[pts["storage"] == st].sort_values(["policy", "m_max"])
                for i, r in enumerate(part.itertuples()):
                    label = f"{POLICY_LABELS[r.policy]} M={r.m_max}"
                    ax.bar([i], [r.gain_pct_mean], color=color(r.policy), width=0.7, edgecolor="white",
                           yerr=[[r.gain_pct_mean - r.gain_pct_lo], [r.gain_pct_hi - r.gain_pct_mean]],
                           error_kw={"elinewidth": 0.7, "capsize": 1.5})
                    if not pd.isna(r.ready_pct_mean):
                        ax.text(i, max(r.gain_pct_hi, 0.0) + 1.0, f"RR {r.ready_pct_mean:.0f}%", ha="center",
                                va="bottom", fontsize=5.5)
                    keys = {"storage": st, "policy": POLICY_LABELS[r.policy], "m_max": int(r.m_max)}
                    cells += [_stat_cell(f"{st}/{label}/gain", "gain", r.gain_pct_stats, keys),
                              _stat_cell(f"{st}/{label}/throughput", "throughput", r.tokens_per_s_stats, keys)]
                    if r.ready_pct_stats is not None:
                        cells.append(_stat_cell(f"{st}/{label}/ready", "ready_recall", r.ready_pct_stats, keys))
                ax.set_xticks(range(len(part)), [f"{POLICY_LABELS[p]}\n$M$={m}" for p, m in
                                                 zip(part["policy"], part["m_max"], strict=True)])
                ax.axhline(0.0, color="#888888", linewidth=0.6, linestyle=":")
                ax.set_ylim(top=max(5.0, float(part["gain_pct_hi"].max())) * 1.35)
                ax.set_title(f"(b) {storage_label(st)}", loc="left")
            axes[1][0].set_ylabel(f"Runtime, {_display(cfg, sel.model)}\nGain vs OFF (%)")
            for ax in axes[1][len(storages):]:
                ax.set_axis_off()
            meta_rt = {"model": sel.model, "platform": sel.platform, "ci": CI_META,
                       "m_max": {st: {POLICY_LABELS[p]: sorted(int(v) for v in g["m_max"])
                                      for p, g in pts[pts["storage"] == st].groupby("policy")} for st in storages},
                       "note": repeats_note(runs[runs["experiment"] == "pre_attention"])}
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False, bbox_to_anchor=(0.5, 1.0))
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    doc = TableDoc("fig_pre_attention", "Pre-attention prediction: recall and runtime gain", cfg["profile"], cells,
                   meta={"note": _caption_note(cfg), "ci": "95 % t-interval over training seeds (recall)",
                         **({"runtime": meta_rt} if meta_rt else {})})
    return FigureResult(fig, doc)


# --------------------------------------------------------------------------------------------- batch decoding
BATCH_POLICIES = ("off", "specprefetch", "resident")  # the batch experiment's runs of each (storage, batch) block


def batch_sizes(rows: pd.DataFrame, path: Path | str) -> pd.Series:
    """Each row's batch size (runs.csv's ``batch``: the sequences decoded together), 1 where the column is absent
    or empty (older runs.csv files, one sequence as in the paper). A filled value that is not a positive integer is
    an input error naming the column and line (the line is right for the frame as read)."""
    if "batch" not in rows.columns:
        return pd.Series(1, index=rows.index, dtype=int)
    raw = rows["batch"]
    blank = raw.isna() | (raw.astype(str).str.strip() == "")
    vals = pd.to_numeric(raw.where(~blank), errors="coerce")
    bad = ~blank & ~((vals >= 1) & (vals == vals.round()))
    if bad.any():
        i = rows.index.get_loc(bad[bad].index[0])
        raise RenderInputError(f"{path}: column 'batch', line {int(i) + 2}: value {raw[bad].iloc[0]!r} is not a "
                               "positive integer (the sequences decoded together)")
    return vals.fillna(1).astype(int)


@dataclass
class BatchRuntime:
    """The runtime's batch experiment, summarized (:func:`batch_runtime`)."""

    points: pd.DataFrame                # per (storage, batch, policy): throughput, paired gain, ReadyRecall, bound
    budgets: dict[str, dict[int, int]]  # per storage and batch size: SpecPrefetch's M_max
    has_bound: bool                     # whether runs.csv records the overlap bound
    model: str
    platform: str
    note: str


def batch_runtime(runs: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any]) -> BatchRuntime:
    """runs.csv's batch experiment (beyond the paper; the embedded default does not run it,
    config/overlays/extensions.yaml does): per storage and batch size B (column ``batch``) OFF, SpecPrefetch at that
    batch's budget and all-resident, one block each, so SpecPrefetch's (and all-resident's) gain vs OFF is paired by
    repeat within the batch size's block. Summarized with :func:`summarize`: aggregate throughput (every sequence's
    tokens), the paired gain, ReadyRecall (%) and, when recorded, the overlap bound."""
    sel = select_device(runs, path, cfg)
    rows = require_rows(runs, path, "fig_batch: the batch experiment of the runtime benchmarks, beyond the paper; "
                        "add 'batch' to device.experiments, as config/overlays/extensions.yaml does",
                        platform=sel.platform, model=sel.model, source=sel.sources[0], experiment="batch")
    rows = rows[rows["policy"].isin(BATCH_POLICIES)]
    rows = rows.assign(batch=batch_sizes(rows, path))
    require_rows(rows, path, "fig_batch", policy="specprefetch")
    parts = []
    for b, gb in rows.groupby("batch", sort=True):  # one block per (storage, batch): pair within the batch size
        try:
            parts.append(paired_gains(gb, path))
        except RenderInputError as exc:
            raise RenderInputError(f"{exc}; batch size {int(b)}") from None
    g = pd.concat(parts, ignore_index=True).assign(ready_pct=lambda d: d["ready_recall"] * 100.0)
    extra = []
    if bound_values(g, path) is not None:
        g = g.assign(**{BOUND_COLUMN: pd.to_numeric(g[BOUND_COLUMN], errors="coerce")})
        extra = [BOUND_COLUMN]
    spec = g[g["policy"] == "specprefetch"]
    if spec["m_max"].isna().any():
        raise RenderInputError(f"{path}: column 'm_max' is empty for the batch experiment's rows of policy "
                               "'specprefetch'")
    budgets: dict[str, dict[int, int]] = {}
    for (st, b), gs in spec.groupby(["storage", "batch"], sort=True):
        ms = sorted({int(m) for m in gs["m_max"]})
        if len(ms) > 1:
            raise RenderInputError(f"{path}: SpecPrefetch at batch size {int(b)} on {st!r} ran at several budgets "
                                   f"({ms}; column 'm_max'): one budget per batch size")
        budgets.setdefault(str(st), {})[int(b)] = ms[0]
    points = summarize(g, ["storage", "batch", "policy"], ["tokens_per_s", "gain_pct", "ready_pct", *extra])
    return BatchRuntime(points, budgets, bool(extra), sel.model, sel.platform, repeats_note(g))


def figure_batch(runs: pd.DataFrame, cfg: Mapping[str, Any], path: Path | str = "runs.csv") -> FigureResult:
    """Beyond the paper: batch decoding (:func:`batch_runtime`), one column per storage. Top: the aggregate decoding
    throughput (every sequence's tokens) against the batch size B of OFF and SpecPrefetch (95 % CIs, paired
    bootstrap over repeats), all-resident (the resident bound; band: its CI) and, dashed, SpecPrefetch's overlap bound
    (perfect transfer/compute overlap). Bottom: SpecPrefetch's paired gain vs OFF, labelled with its budget M_max.
    Cells: ``<storage>/b<B>/<policy>/throughput``, ``<storage>/b<B>/{gain,bound,budget,ready_recall}``."""
    bt = batch_runtime(runs, path, cfg)
    pts = bt.points
    storages = [s for s in STORAGE_ORDER if s in set(pts["storage"])]
    sizes = sorted({int(b) for b in pts["batch"]})
    bound = f"{BOUND_COLUMN}_mean"
    spec_c = color("specprefetch")
    cells: list[Cell] = []
    n = len(storages)
    with _theme():
        width = TEXT_WIDTH_IN if n > 2 else COLUMN_WIDTH_IN * (1.6 if n == 2 else 1.1)
        fig, axes = plt.subplots(2, n, squeeze=False, sharex=True, sharey="row", figsize=(width, 0.8 + 1.75 * 2))
        for j, st in enumerate(storages):
            top, bottom = axes[0, j], axes[1, j]
            part = pts[pts["storage"] == st]
            res = part[part["policy"] == "resident"].sort_values("batch")
            if not res.empty:
                top.fill_between(res["batch"], res["tokens_per_s_lo"], res["tokens_per_s_hi"],
                                 color=color("resident"), alpha=0.12, linewidth=0)
                top.plot(res["batch"], res["tokens_per_s_mean"], color=color("resident"), linewidth=1.0,
                         marker="^", markersize=3, label=POLICY_LABELS["resident"], zorder=2)
            for p, dodge, marker in (("off", 2.0 ** -0.04, "s"), ("specprefetch", 2.0 ** 0.04, "o")):
                q = part[part["policy"] == p].sort_values("batch")
                if q.empty:
                    continue
                top.errorbar(q["batch"] * dodge, q["tokens_per_s_mean"],
                             yerr=_yerr(q["tokens_per_s_mean"], q["tokens_per_s_lo"], q["tokens_per_s_hi"]),
                             color=color(p), marker=marker, markersize=3, linewidth=1.3, elinewidth=0.8, capsize=2,
                             label=POLICY_LABELS[p], zorder=3)
            spec = part[part["policy"] == "specprefetch"].sort_values("batch")
            if bt.has_bound and spec[bound].notna().any():
                top.plot(spec["batch"], spec[bound], color=spec_c, linestyle="--", linewidth=0.9, alpha=0.8,
                         label=f"{POLICY_LABELS['specprefetch']}'s overlap bound", zorder=2)
            top.set_title(storage_label(st), loc="left")
            bottom.errorbar(spec["batch"], spec["gain_pct_mean"],
                            yerr=_yerr(spec["gain_pct_mean"], spec["gain_pct_lo"], spec["gain_pct_hi"]),
                            color=spec_c, marker="o", markersize=3, linewidth=1.3, elinewidth=0.8, capsize=2)
            for r in spec.itertuples():
                ax_y = max(float(r.gain_pct_hi), float(r.gain_pct_mean))
                bottom.annotate(f"$M$={bt.budgets[st][int(r.batch)]}", xy=(int(r.batch), ax_y), xytext=(0, 2),
                                textcoords="offset points", ha="center", va="bottom", fontsize=5.5, color=spec_c)
            bottom.axhline(0.0, color="#888888", linewidth=0.6, linestyle=":")
            bottom.set_xlabel("Batch size $B$")
            for r in part.itertuples():
                b, p = int(r.batch), str(r.policy)
                key = {"storage": st, "batch": b, "policy": POLICY_LABELS[p]}
                cells.append(_stat_cell(f"{st}/b{b}/{p}/throughput", "throughput", r.tokens_per_s_stats, key))
                if p != "specprefetch":
                    continue
                key = {**key, "m_max": bt.budgets[st][b]}
                cells.append(_stat_cell(f"{st}/b{b}/gain", "gain", r.gain_pct_stats, key))
                bst = getattr(r, f"{BOUND_COLUMN}_stats", None)
                cells.append(_stat_cell(f"{st}/b{b}/bound", "throughput", bst, key) if bst is not None else
                             Cell(id=f"{st}/b{b}/bound", quantity="throughput", value=None, keys=key))
                cells.append(Cell(id=f"{st}/b{b}/budget", quantity="m_max", value=float(bt.budgets[st][b]), keys=key))
                cells.append(_stat_cell(f"{st}/b{b}/ready_recall", "ready_recall", r.ready_pct_stats, key)
                             if r.ready_pct_stats is not None else
                             Cell(id=f"{st}/b{b}/ready_recall", quantity="ready_recall", value=None, keys=key))
        first = axes[0, 0]
        first.set_xscale("log", base=2)
        first.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(sizes))
        first.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        first.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        first.set_xlim(sizes[0] / 1.45, sizes[-1] * 1.45)
        highs = [pts["tokens_per_s_hi"].max()] + ([pts[bound].max()] if bt.has_bound else [])
        first.set_ylim(0, float(pd.Series(highs).max()) * 1.08)
        spec_all = pts[pts["policy"] == "specprefetch"]
        lo, hi = min(0.0, float(spec_all["gain_pct_lo"].min())), max(0.0, float(spec_all["gain_pct_hi"].max()))
        span = max(hi - lo, 1.0)
        axes[1, 0].set_ylim(lo - 0.08 * span, hi + 0.3 * span)  # room for the budget labels
        first.set_ylabel(f"{_display(cfg, bt.model)}\nThroughput (tok/s,\nall sequences)")
        axes[1, 0].set_ylabel(f"{POLICY_LABELS['specprefetch']} gain\nvs OFF (%)")
        for ax in axes.flat:
            ax.grid(axis="x", visible=False)
        handles: dict[str, Any] = {}
        for ax in axes[0]:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        order = [POLICY_LABELS[p] for p in ("off", "specprefetch", "resident")]
        labels = sorted(handles, key=lambda lab: order.index(lab) if lab in order else len(order))
        fig.legend([handles[lab] for lab in labels], labels, loc="upper center", ncol=min(len(labels), 4),
                   frameon=False, bbox_to_anchor=(0.5, 1.0), columnspacing=1.0, handlelength=1.8, fontsize=6.5)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    doc = TableDoc("fig_batch", "Batch decoding: throughput and gain vs batch size", cfg["profile"], cells,
                   meta={"note": _caption_note(cfg, bt.note), "model": bt.model, "platform": bt.platform,
                         "ci": CI_META, "batches": sizes,
                         "m_max": {st: {str(b): m for b, m in bt.budgets[st].items()} for st in storages}})
    return FigureResult(fig, doc)


def _build_pre_attention(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> FigureResult:
    runs = read_result_csv(inputs["runs"], "runs") if "runs" in inputs else None
    return figure_pre_attention(read_result_csv(inputs["recall"], "recall"), cfg, inputs["recall"], runs,
                                inputs.get("runs", "runs.csv"))


def _build_lookahead(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> FigureResult:
    runs = read_result_csv(inputs["runs"], "runs") if "runs" in inputs else None
    return figure_lookahead(read_result_csv(inputs["lookahead"], "lookahead"), cfg, inputs["lookahead"], runs,
                            inputs.get("runs", "runs.csv"))


def _build_pareto(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> FigureResult:
    runs = read_result_csv(inputs["runs"], "runs") if "runs" in inputs else None
    return figure_pareto(read_result_csv(inputs["recall"], "recall"), read_result_csv(inputs["params"], "params"),
                         read_result_csv(inputs["predictor_cost"], "predictor_cost"), runs, cfg, inputs)


def _build_latency(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> FigureResult:
    return figure_latency(read_result_csv(inputs["latency"], "latency"), cfg)


def _build_window(inputs: Mapping[str, Path], cfg: Mapping[str, Any]) -> FigureResult:
    return figure_window(read_result_csv(inputs["window"], "window"),
                         read_result_csv(inputs["window_events"], "window_events"), cfg, inputs["window_events"])


FIGURES: dict[str, FigureSpec] = {
    "fig1a_latency": FigureSpec("fig1a_latency", ("latency",), _build_latency,
                                "Per-layer decoding latency under resident and on-demand expert loading, by "
                                "component; the label gives the exposed expert-loading share.", "Figure 1(a)"),
    "fig1b_window": FigureSpec("fig1b_window", ("window", "window_events"), _build_window,
                               "Measured prefetch window and candidate transfer demand per layer; percentages are "
                               "the fraction of events whose demand exceeds their window.", "Figure 1(b)"),
    "fig4_budget": FigureSpec("fig4_budget", ("runs",), _with_curve(figure_budget),
                              "Impact of the maximum prefetch budget $M_{\\max}$ on throughput and ReadyRecall "
                              "(mean with its 95\\,\\% CI, paired bootstrap over repeats; dotted: the window rule's "
                              "profiled budget; dash-dotted: the simulator's curve from the window profile alone, "
                              "scaled to the measured OFF, and the simulated rule's budget).",
                              "Figure 4", optional=("budget_curve",)),
    "fig5_storage": FigureSpec("fig5_storage", ("runs",), _with_curve(figure_storage),
                               "Storage sensitivity of decoding throughput, OFF vs SpecPrefetch, with the paired "
                               "throughput gain of SpecPrefetch per storage profile (error bars: 95\\,\\% CI, paired "
                               "bootstrap over repeats; black ticks: the runtime's throughput bound, when recorded). "
                               "Lower row: the gains against $W/t$, the prefetch window over the isolated load time, "
                               "with the simulator's gain from the window profile alone at the window rule's and the "
                               "simulated rule's budget.",
                               "Figure 5", optional=("budget_curve",)),
    "fig6_component": FigureSpec("fig6_component", ("runs",), _from_csv("runs", figure_component),
                                 "Cold-cache component analysis: compute optimization and prediction-guided "
                                 "prefetching alone and combined (hatched: compute optimization on; error bars: "
                                 "95\\,\\% CI, paired bootstrap over repeats).", "Figure 6"),
    "fig_recall_per_layer": FigureSpec("fig_recall_per_layer", ("per_layer",),
                                       _from_csv("per_layer", figure_recall_per_layer),
                                       "ExpertRecall@$K$ per target layer for every predictor, mean over "
                                       "workloads.", "Per-layer recall (not in the paper)"),
    "fig_lookahead": FigureSpec("fig_lookahead", ("lookahead",), _build_lookahead,
                                "ExpertRecall@$K$ predicting the experts $d$ MoE layers ahead (layer $l$ predicts "
                                "layer $l+d$: SpecPrefetch's adapters and the learned baselines trained per distance, "
                                "FATE applying layer $l+d$'s gate to $x^l$; $d=1$ is Table~1), per workload and their "
                                "mean (error bars: 95\\,\\% t-interval over training seeds). When the runtime ran "
                                "the look-ahead experiment, the last row: decoding throughput with SpecPrefetch "
                                "prefetching $d$ layers ahead at the window rule's budget on the window summed over "
                                "$d$ layers, against OFF (band), per storage (95\\,\\% CIs, paired bootstrap over "
                                "repeats; labels: the paired gain and the budget).",
                                "Look-ahead (beyond the paper)", optional=("runs",)),
    "fig_budget_rules": FigureSpec("fig_budget_rules", ("runs",), _from_csv("runs", figure_budget_rules),
                                   "Budget rules side by side, one block per storage: SpecPrefetch's paired "
                                   "throughput gain vs OFF against its mean budget per prediction step under the "
                                   "paper's window rule per storage and per layer and, with the extra rules "
                                   "configured, the DP allotment of the per-layer total, the online EWMA rule and the "
                                   "simulated rule's budget "
                                   "(95\\,\\% CIs, paired bootstrap over repeats; markers nudged sideways so equal "
                                   "budgets stay visible); grey: the uniform-budget sweep where it ran on the storage "
                                   "(its own block and OFF).",
                                   "Budget rules (beyond the paper)"),
    "fig_pre_attention": FigureSpec("fig_pre_attention", ("recall",), _build_pre_attention,
                                    "Pre-attention prediction (beyond the paper): ExpertRecall@$K$ of layer $l$'s "
                                    "experts from layer $l$'s own pre-attention input (two linear maps at "
                                    "SpecPrefetch's rank, KL plus a pairwise ranking loss) beside SpecPrefetch and "
                                    "FATE (layer $l-1$'s router input), per workload and their mean (error bars: "
                                    "95\\,\\% t-interval over training seeds). When the runtime ran the "
                                    "pre-attention experiment, the lower row: the paired throughput gain vs OFF of "
                                    "SpecPrefetch at the window rule's budget and of the pre-attention policy, whose "
                                    "prefetches go out before the layer's attention, at its own budget (the window "
                                    "rule on the attention window) and at SpecPrefetch's, per storage (95\\,\\% "
                                    "CIs, paired bootstrap over repeats; above each bar: its ReadyRecall).",
                                    "Pre-attention (beyond the paper)", optional=("runs",)),
    "fig_batch": FigureSpec("fig_batch", ("runs",), _from_csv("runs", figure_batch),
                            "Batch decoding (beyond the paper): the runtime decodes a batch of $B$ prompts at once "
                            "(one token of each per step), SpecPrefetch with the paper's batch-level priorities "
                            "$s_e = \\sum_{(b,s) \\in \\Omega} \\hat{\\pi}_{b,s,e}$ (summed over the batch's "
                            "tokens) at the budget per batch step from the window rule on the prefetch window "
                            "measured at that batch size. Top: the aggregate decoding throughput (every sequence's "
                            "tokens) of OFF and SpecPrefetch (95\\,\\% CIs, paired bootstrap over repeats), with "
                            "two bounds: all experts resident (band: its CI) and, dashed, SpecPrefetch's overlap "
                            "bound (perfect transfer/compute overlap). Bottom: SpecPrefetch's paired throughput gain "
                            "vs OFF per batch size, labelled with its budget $M_{\\max}$.",
                            "Batch decoding (beyond the paper)"),
    "fig_pareto": FigureSpec("fig_pareto", ("recall", "params", "predictor_cost"), _build_pareto,
                             "What a predictor buys for what it costs: (a) ExpertRecall@$K$ (mean over workloads; "
                             "95\\,\\% t-interval over training seeds) against trainable parameters, (b) against "
                             "the prediction time per layer pair as a share of one MoE layer's compute (95\\,\\% "
                             "bootstrap CI over interleaved timing rounds), (c) the runtime's paired throughput gain "
                             "vs OFF against ReadyRecall at the matched budget, per storage (95\\,\\% CIs, paired "
                             "bootstrap over repeats).", "Pareto (beyond the paper)", optional=("runs",)),
}


def render_figure(name: str, cfg: Mapping[str, Any], inputs: Mapping[str, Path | str], out_dir: Path | str
                  ) -> TableDoc:
    """Build figure ``name`` from its CSVs and write ``<out_dir>/<name>.{pdf,png,json}`` atomically."""
    if name not in FIGURES:
        raise RenderInputError(f"unknown figure {name!r}; choose from {', '.join(FIGURES)}")
    spec = FIGURES[name]
    inputs = require_inputs(name, spec.inputs, inputs)
    given = [k for k in (*spec.inputs, *spec.optional) if k in inputs]
    res = spec.build({k: Path(inputs[k]) for k in given}, cfg)
    base = Path(out_dir) / name
    save_figure(res.fig, base)
    res.doc.meta.setdefault("inputs", {k: str(inputs[k]) for k in given})
    res.doc.meta["caption"] = spec.caption
    res.doc.meta["paper_label"] = spec.paper_label
    res.doc.write(base.with_suffix(".json"))
    log.info("wrote %s.{pdf,png,json} (%d values)", base, len(res.doc.cells))
    return res.doc

