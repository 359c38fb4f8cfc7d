"""File layout of the rendering stage, for workflow/rules/render.smk and the CLI (no heavy imports here).

The rules take their inputs from ``TABLE_INPUTS``/``FIGURE_INPUTS`` so a table that needs the runtime's
``runs.csv`` declares it as an input: when the runtime stage has not produced it, Snakemake schedules (or reports
as missing) the file, instead of a renderer quietly writing an empty table.
"""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Mapping
from typing import Any

RESULT_PATHS: dict[str, str] = {
    "recall": "results/recall/recall.csv",
    "per_layer": "results/recall/recall_per_layer.csv",
    "params": "results/predictors/params.csv",
    "runs": "results/device/runs.csv",
    "window": "results/device/window.csv",
    "window_events": "results/device/window_events.csv",
    "latency": "results/device/latency.csv",
    "host": "results/device/host.csv",
    "budget_curve": "results/device/budget_curve.csv",
    "realism": "results/realism/realism.csv",
    "predictor_cost": "results/predictors/predictor_cost.csv",
    "lookahead": "results/recall/lookahead.csv",
}
TABLE_INPUTS: dict[str, tuple[str, ...]] = {
    "table0_realism": ("realism",),
    "table1_recall": ("recall",),
    "table2_ablation": ("recall",),
    "table3_params": ("params",),
    "table4_overhead": ("runs", "host"),
    "table5_matched": ("runs", "host"),
}
FIGURE_INPUTS: dict[str, tuple[str, ...]] = {
    "fig1a_latency": ("latency",),
    "fig1b_window": ("window", "window_events"),
    "fig4_budget": ("runs", "budget_curve"),
    "fig5_storage": ("runs", "budget_curve"),
    "fig6_component": ("runs",),
    "fig_recall_per_layer": ("per_layer",),
    "fig_lookahead": ("lookahead", "runs"),
    "fig_pareto": ("recall", "params", "predictor_cost", "runs"),
    "fig_budget_rules": ("runs",),
    "fig_pre_attention": ("recall", "runs"),
    "fig_batch": ("runs",),
}
# Figures beyond the paper drawn from a runtime experiment the embedded default does not run: figure -> experiment.
# They are in the DAG (figure_names) only where some model of device.models runs it (config/overlays/extensions.yaml).
EXPERIMENT_FIGURES: dict[str, str] = {"fig_batch": "batch"}
TABLE_NAMES = list(TABLE_INPUTS)
# The tables with a reproduced-vs-reported companion (<table>_vs_paper.tex); table0_realism is itself a comparison
# with the paper (the stand-ins' FATE recall beside Table 1's), so it has none.
UNCOMPARED_TABLES = ("table0_realism",)
COMPARED_TABLES = [t for t in TABLE_NAMES if t not in UNCOMPARED_TABLES]
# The rendering inputs are archived beside the rendering (``<out_dir>/results/<file name>``, committed for the
# embedded default), so the tables can be regenerated from them alone: CI does, then diffs against the commit.
ARCHIVE_SUBDIR = "results"
FIGURE_NAMES = list(FIGURE_INPUTS)  # every figure: the vocabulary (CLI choices, render.tolerances, claims' sources)
REPORTED = "config/reference/paper_reported.yaml"
CLAIMS = "config/reference/claims.yaml"  # the paper's claims, checked by compare-paper


def out_dir(cfg: Mapping[str, Any]) -> str:
    """Where the rendered tables go: ``render.out_dir`` (the schema's default ``paper_tables`` is committed; a
    config that was not validated, e.g. a bare ``{}``, gets the schema's default too)."""
    from specprefetch.config import section_defaults

    render = cfg["render"] if "render" in cfg else section_defaults("render")
    return str(render["out_dir"]).rstrip("/")


def figure_names(cfg: Mapping[str, Any]) -> list[str]:
    """The figures a config renders (the DAG's, the CLI's and the preview's default): ``FIGURE_NAMES`` without those
    of ``EXPERIMENT_FIGURES`` whose experiment no model of ``device.models`` runs (``config.device_experiments``)."""
    from specprefetch.config import device_experiments

    runs = device_experiments(cfg) if EXPERIMENT_FIGURES else set()
    return [f for f in FIGURE_NAMES if f not in EXPERIMENT_FIGURES or EXPERIMENT_FIGURES[f] in runs]


def table_inputs(table: str) -> dict[str, str]:
    return {k: RESULT_PATHS[k] for k in TABLE_INPUTS[table]}


def figure_inputs(figure: str) -> dict[str, str]:
    return {k: RESULT_PATHS[k] for k in FIGURE_INPUTS[figure]}


def input_flags(inputs: Mapping[str, Any]) -> str:
    """``--recall results/recall/recall.csv ...`` for a rule's named inputs (the CLI's flag names), as shell words:
    each flag and each path quoted on its own (the rules insert the result unquoted)."""
    words: list[str] = []
    for k, v in inputs.items():
        words.append(f"--{k.replace('_', '-')}")
        words.extend(map(str, v) if isinstance(v, (list, tuple)) else [str(v)])
    return shlex.join(words)


# One file of the rendering; called without a name, the rule's wildcard pattern (e.g. ``<out_dir>/{table}.tex``).
def table_file(cfg: Mapping[str, Any], table: str = "{table}", ext: str = "tex") -> str:
    return f"{out_dir(cfg)}/{table}.{ext}"


def figure_file(cfg: Mapping[str, Any], figure: str = "{figure}", ext: str = "pdf") -> str:
    return f"{out_dir(cfg)}/figures/{figure}.{ext}"


def vs_paper_file(cfg: Mapping[str, Any], table: str = "{table}") -> str:
    """A table's reproduced-vs-reported comparison (LaTeX)."""
    return f"{out_dir(cfg)}/{table}_vs_paper.tex"


def comparison_file(cfg: Mapping[str, Any], name: str) -> str:
    """``figures_vs_paper.tex``, ``comparison.md`` or ``comparison.json``."""
    return f"{out_dir(cfg)}/{name}"


def preview_file(cfg: Mapping[str, Any], ext: str = "tex") -> str:
    return f"{out_dir(cfg)}/paper_tables.{ext}"


def table_files(cfg: Mapping[str, Any]) -> list[str]:
    return [table_file(cfg, t, ext) for t in TABLE_NAMES for ext in ("tex", "json")]


def figure_files(cfg: Mapping[str, Any]) -> list[str]:
    return [figure_file(cfg, f, ext) for f in figure_names(cfg) for ext in ("pdf", "png", "json")]


def comparison_files(cfg: Mapping[str, Any]) -> list[str]:
    return ([vs_paper_file(cfg, t) for t in COMPARED_TABLES]
            + [comparison_file(cfg, n) for n in ("figures_vs_paper.tex", "comparison.md", "comparison.json")])


def archive_files(cfg: Mapping[str, Any]) -> dict[str, str]:
    """Where ``rule archive_results`` copies each rendering input: ``<out_dir>/results/<its file name>``."""
    return {k: f"{out_dir(cfg)}/{ARCHIVE_SUBDIR}/{v.rsplit('/', 1)[-1]}" for k, v in RESULT_PATHS.items()}


def pdflatex_available() -> bool:
    return shutil.which("pdflatex") is not None


def preview_files(cfg: Mapping[str, Any], with_pdf: bool | None = None) -> list[str]:
    """The preview source always; the PDF only where pdflatex is installed (``with_pdf`` overrides the check)."""
    pdf = pdflatex_available() if with_pdf is None else with_pdf
    return [preview_file(cfg, "tex")] + ([preview_file(cfg, "pdf")] if pdf else [])


def all_outputs(cfg: Mapping[str, Any], with_pdf: bool | None = None) -> list[str]:
    """Everything ``rule paper_tables`` should depend on from the rendering stage."""
    return (table_files(cfg) + figure_files(cfg) + comparison_files(cfg) + preview_files(cfg, with_pdf)
            + list(archive_files(cfg).values()))


def skipped_pdf_message(cfg: Mapping[str, Any]) -> str | None:
    """The line the Snakefile prints when the PDF is left out of the DAG (None when pdflatex is there)."""
    if pdflatex_available():
        return None
    return (f"pdflatex not found: skipping {out_dir(cfg)}/paper_tables.pdf (the .tex tables and figures are still "
            "made; install texlive-latex-base texlive-latex-recommended texlive-latex-extra to get the PDF)")
