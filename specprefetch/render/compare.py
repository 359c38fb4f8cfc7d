"""Reproduced vs reported: every table side by side with the paper's numbers, and the paper's claims checked.

Two kinds of comparison, both always produced:

- **Numbers**: each reproduced cell next to the paper's cell with the same keys (display names and budget
  expressions), and the difference (a ratio for parameter counts). Meaningful for the paper profile.
- **Claims**: the statements the paper makes about its tables and figures ("SpecPrefetch is best or tied-best in 27
  of 30 settings", "PRED0 within 2% of OFF", "throughput peaks at a bounded M_max"), written as data in
  ``config/reference/claims.yaml`` and evaluated by ``render.claims`` on the reproduced cells and on the paper's.
  For the embedded default (stand-ins, not the paper's models) the direction of each claim is the comparison that
  means something; ``agrees`` says whether the claim holds in both or fails in both. Device claims are decided by
  the 95 % paired-bootstrap CI their cells carry (``Verdict.UNRESOLVED`` when it does not decide); with kept runs
  (``render.kept_runs``) across hours: each CI widened by the spread between the kept runs (``claims.across_runs``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specprefetch.io import write_json_atomic, write_text_atomic
from specprefetch.metrics import CI_LEVEL
from specprefetch.render.cells import Cell, TableDoc, fmt_fixed, fmt_params, latex_escape, read_table_doc
from specprefetch.render.claims import Claim, Test, Verdict, across_runs, evaluate_claims, load_claims
from specprefetch.render.profile import profile_sentence
from specprefetch.render.reported import MATCH_KEYS, Reported, match_key
from specprefetch.render.tables import TABLES, render_template

log = logging.getLogger(__name__)
_PCT = f"{CI_LEVEL * 100:g} %"

# --------------------------------------------------------------------------------------------- numbers side by side


@dataclass(frozen=True)
class Layout:
    """How a table's cells are arranged for the side-by-side view."""

    block: str | None
    rows: tuple[str, ...]
    col: str
    ratio: bool = False


LAYOUTS: dict[str, Layout] = {
    "table1_recall": Layout("model", ("workload", "method"), "budget"),
    "table2_ablation": Layout("model", ("workload", "method"), "budget"),
    "table3_params": Layout(None, ("model",), "method", ratio=True),
    "table4_overhead": Layout(None, ("policy",), "column"),
    "table5_matched": Layout(None, ("policy",), "column"),
}
DECIMALS = {"recall": 2, "throughput": 3, "gain": 2, "ready_recall": 1}
COLUMN_NAMES = {"throughput": "Throughput (tok/s)", "gain": "Gain vs OFF (%)", "gain_cold": "Cold gain (%)",
                "gain_slow": "Slow gain (%)", "ready_recall": "ReadyRecall (%)"}


def fmt_value(cell: Cell | None) -> str:
    if cell is None or cell.value is None:
        return "–"
    if cell.quantity == "params":
        return fmt_params(cell.value)
    dec = DECIMALS.get(cell.quantity, 2)
    text = fmt_fixed(cell.value, dec, sign=cell.quantity == "gain")
    if cell.has_ci:  # a reproduced device cell: its 95 % CI (the paper's cells carry mean ± std)
        return f"{text} [{fmt_fixed(cell.lo, dec, sign=cell.quantity == 'gain')}, " \
               f"{fmt_fixed(cell.hi, dec, sign=cell.quantity == 'gain')}]"
    return text if cell.std is None else f"{text} ± {fmt_fixed(cell.std, dec)}"


def fmt_delta(repro: Cell | None, paper: Cell | None, ratio: bool) -> str:
    if repro is None or paper is None or repro.value is None or paper.value is None:
        return "–"
    if ratio:
        return "–" if paper.value == 0 else f"×{repro.value / paper.value:.3g}"
    return fmt_fixed(repro.value - paper.value, DECIMALS.get(repro.quantity, 2), sign=True)


@dataclass
class SideBySide:
    """One block (e.g. one model) of a table: column headers and rows of (labels, [(repro, paper, delta)])."""

    title: str
    row_headers: list[str]
    columns: list[str]
    rows: list[tuple[list[str], list[tuple[str, str, str]]]]


def side_by_side(name: str, repro: TableDoc, reported: TableDoc | None) -> list[SideBySide]:
    """Pair reproduced and reported cells on MATCH_KEYS; cells only one side has show a dash on the other."""
    lay = LAYOUTS[name]
    paper_idx = {match_key(name, c): c for c in reported.cells} if reported else {}
    repro_idx = {match_key(name, c): c for c in repro.cells}
    order = list(dict.fromkeys([*repro_idx, *paper_idx]))
    keys_of = {k: (repro_idx.get(k) or paper_idx[k]).keys for k in order}
    fields = MATCH_KEYS[name]
    blocks: dict[str, dict[str, Any]] = {}
    for k in order:
        keys = keys_of[k]
        b = str(keys.get(lay.block, "")) if lay.block else ""
        blk = blocks.setdefault(b, {"rows": {}, "cols": []})
        col = str(keys[lay.col])
        if col not in blk["cols"]:
            blk["cols"].append(col)
        blk["rows"].setdefault(tuple(str(keys[f]) for f in lay.rows), {})[col] = k
    out = []
    for title, blk in blocks.items():
        rows = []
        for labels, by_col in blk["rows"].items():
            triples = []
            for col in blk["cols"]:
                k = by_col.get(col)
                r, p = (repro_idx.get(k), paper_idx.get(k)) if k else (None, None)
                triples.append((fmt_value(r), fmt_value(p), fmt_delta(r, p, lay.ratio)))
            rows.append((list(labels), triples))
        cols = [f"R@{c}" if lay.col == "budget" else COLUMN_NAMES.get(c, c) for c in blk["cols"]]
        out.append(SideBySide(title, [f.capitalize() for f in lay.rows if f in fields], cols, rows))
    return out


# --------------------------------------------------------------------------------------------- outputs


def _holds(v: Verdict) -> str:
    return {Verdict.HOLDS: "yes", Verdict.FAILS: "no", Verdict.UNRESOLVED: "unresolved", Verdict.NA: "n/a"}[v]


def _agree_mark(a: bool | None, tex: bool) -> str:
    if a is None:
        return "--" if tex else "–"
    if tex:
        return r"\checkmark" if a else r"$\times$"
    return "✓" if a else "✗"


def _same_mark(c: Claim, tex: bool) -> str:
    """The "Same?" column: ✓/✗ when both sides are decided, "unresolved" when the reproduced CI leaves it open."""
    if c.verdict_reproduced is Verdict.UNRESOLVED:
        return "unresolved"
    return _agree_mark(c.agrees, tex)


def _reproduced_text(c: Claim) -> str:
    """The reproduced value with its verdict where it is not decided ("… (unresolved: the 95 % CI contains 0)")."""
    if c.verdict_reproduced is Verdict.UNRESOLVED:
        return f"{c.reproduced} (unresolved: {c.reason})" if c.reason else f"{c.reproduced} (unresolved)"
    return c.reproduced


def claim_counts(claims: Sequence[Claim], extension: bool = False) -> dict[str, int]:
    """How many of the paper's claims (``extension``: of the claims beyond the paper) hold, fail and are unresolved
    on the reproduced side, of the checkable ones (n/a left out)."""
    claims = [c for c in claims if c.extension == extension]
    out = {v.value: sum(c.verdict_reproduced is v for c in claims) for v in Verdict}
    out["checkable"] = len(claims) - out[Verdict.NA.value]
    return out


def claims_summary(claims: Sequence[Claim]) -> str:
    """ "X hold, Y fail, Z unresolved of N" (reproduced, N the checkable claims), and how many agree with the paper."""
    n = claim_counts(claims)
    agree = [c.agrees for c in claims if c.agrees is not None and not c.extension]
    return (f"{n['holds']} hold, {n['fails']} fail, {n['unresolved']} unresolved of {n['checkable']} checkable claims "
            f"of the paper ({n['n/a']} informational or not evaluable); {sum(agree)} of {len(agree)} decided on "
            f"both sides hold the same way here. Device claims are decided by the {_PCT} CI of the measurements "
            "(paired bootstrap over repeats): a claim holds only when the CI excludes the opposite outcome.")


def vs_paper_tex(name: str, blocks: Sequence[SideBySide], claims: Sequence[Claim], cfg: Mapping[str, Any],
                 title: str, templates: Path | None = None) -> str:
    """The LaTeX companion of one table: reproduced | paper | difference per column, then the table's claims."""
    ctx_blocks = []
    for b in blocks:
        ctx_blocks.append({
            "title": latex_escape(b.title), "row_headers": [latex_escape(h) for h in b.row_headers],
            "columns": [latex_escape(c).replace("R@", "R@") for c in b.columns],
            "rows": [{"labels": [latex_escape(x) if i or not prev or x != prev[0] else ""
                                 for i, x in enumerate(labels)],
                      "cells": [latex_escape(x) for t in triples for x in t]}
                     for (labels, triples), prev in zip(b.rows, [None] + [r[0] for r in b.rows], strict=False)],
            "first_col": len(b.row_headers) + 1,
        })
    ctx_claims = [{"statement": latex_escape(c.statement), "reproduced": latex_escape(_reproduced_text(c)),
                   "paper": latex_escape(c.paper), "agrees": _same_mark(c, True)} for c in claims]
    ratio = LAYOUTS[name].ratio
    caption = (f"{latex_escape(title)} -- reproduced vs reported. Repro.: this run; Paper: the paper's value; "
               + ("Ratio: reproduced / paper. " if ratio else "$\\Delta$: reproduced $-$ paper. ")
               + latex_escape(profile_sentence(cfg)))
    return render_template("vs_paper.tex.j2", {"caption": caption, "label": f"tab:{name}-vs-paper",
                                               "blocks": ctx_blocks, "claims": ctx_claims,
                                               "delta": "Ratio" if ratio else r"$\Delta$"}, templates)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def _across_md(c: Claim) -> str:
    """How a claim judged across hours got its verdict: this run's own, and the margin the kept runs added."""
    if c.verdict_run is None:
        return ""
    spreads = [sp for sp in c.spreads if sp is not None]
    if not spreads:
        return "; no kept run has its effects: this run's CI alone"
    margins = sorted({f"{sp.margin:.3g}" for sp in spreads}, key=float)
    k = sorted({sp.k for sp in spreads})
    return (f"; this run alone: {c.verdict_run.value}; spread between {'/'.join(map(str, k))} runs "
            f"±{', ±'.join(margins)}")


def _reproduced_md(c: Claim) -> str:
    why = f": {c.reason}" if c.verdict_reproduced is Verdict.UNRESOLVED and c.reason else ""
    return f"{_md_escape(c.reproduced)} ({_holds(c.verdict_reproduced)}{_md_escape(why + _across_md(c))})"


def kept_runs_sentence(claims: Sequence[Claim], kept: Sequence[str]) -> str:
    """What judging across hours did: the kept runs, and the device claims whose verdict it changed."""
    changed = [c.id for c in claims if c.verdict_run is not None and c.verdict_run is not c.verdict_reproduced]
    judged = [c for c in claims if c.verdict_run is not None]
    return (f"Device claims are judged across hours: each effect's {_PCT} CI is widened by the spread between "
            f"this run and {len(kept)} kept runs of this DAG at other hours ({', '.join(kept)}; `render.kept_runs`): "
            "t_{0.975, k-1} times the k runs' standard deviation beyond their own CIs, added in quadrature "
            f"(docs/tables.md, \"One run judged across hours\"). {len(judged) - len(changed)} of {len(judged)} "
            "device claims with CI tests keep this run's own verdict"
            + (f"; {len(changed)} do not ({', '.join(changed)})." if changed else "."))


def comparison_markdown(cfg: Mapping[str, Any], per_table: Mapping[str, list[SideBySide]],
                        titles: Mapping[str, str], claims: Sequence[Claim], kept: Sequence[str] = ()) -> str:
    lines = ["# Reproduced vs reported", "", profile_sentence(cfg), ""]
    lines += [f"**Claims:** {claims_summary(claims)}", ""]
    if kept:
        lines += [kept_runs_sentence(claims, kept), ""]
    if cfg["profile"] != "paper":
        lines += ["The models here are not the paper's checkpoints, so the numeric differences below are not "
                  "errors; the claims (directions) are the comparison that carries over.", ""]
    lines += ["## Claims", "", "| Source | Claim | Reproduced | Paper | Same? |", "|---|---|---|---|---|"]
    for c in claims:
        if not c.extension:
            lines.append(f"| {c.source} | {_md_escape(c.statement)} | {_reproduced_md(c)} | {_md_escape(c.paper)} "
                         f"({_holds(c.verdict_paper)}) | {_same_mark(c, False)} |")
    lines += ["", f"Reproduced device values: mean [{_PCT} CI, paired bootstrap over repeats]; the paper's: "
              "mean ± std."]
    extensions = [c for c in claims if c.extension]
    if extensions:
        n = claim_counts(claims, extension=True)
        lines += ["", "## Beyond the paper", "",
                  f"Claims the paper does not make, about this pipeline's extensions (e.g. the simulated budget rule), "
                  f"decided the same way: {n['holds']} hold, {n['fails']} fail, {n['unresolved']} unresolved of "
                  f"{n['checkable']}. They are not in the counts above.", "",
                  "| Source | Claim | Reproduced |", "|---|---|---|"]
        lines += [f"| {c.source} | {_md_escape(c.statement)} | {_reproduced_md(c)} |" for c in extensions]
    for name, blocks in per_table.items():
        ratio = LAYOUTS[name].ratio
        lines += ["", f"## {titles[name]}", ""]
        for b in blocks:
            if b.title:
                lines += [f"**{b.title}**", ""]
            head = b.row_headers + [f"{c} {h}" for c in b.columns for h in ("repro.", "paper",
                                                                             "ratio" if ratio else "Δ")]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for labels, triples in b.rows:
                lines.append("| " + " | ".join([*labels, *[x for t in triples for x in t]]) + " |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def load_kept_runs(dirs: Sequence[Path | str],
                   own: Mapping[str, tuple[Test, ...]]) -> tuple[list[str], list[dict[str, tuple[Test, ...]]]]:
    """The kept runs (directories with comparison.json) and their device claims' tests (claim id -> tests), less any
    whose tests are ``own`` (a copy of this rendering, e.g. the committed run kept in docs/runs: a run counts once).
    A kept run without comparison.json, or with a malformed one, is a ``DiffError`` naming it."""
    from specprefetch.render.diff import DiffError, claim_verdicts

    names, runs = [], []
    for d in map(Path, dirs):
        claims = claim_verdicts(d) if d.is_dir() else None
        if claims is None:
            raise DiffError(f"render.kept_runs: {d} is not a rendering with comparison.json")
        tests = {cid: c.tests for cid, c in claims.items() if c.tests}
        if tests == own:
            log.info("render.kept_runs: %s has this run's own tests: left out (a run counts once)", d)
            continue
        names.append(str(d))
        runs.append(tests)
    return names, runs


def compare_with_paper(cfg: Mapping[str, Any], table_jsons: Sequence[Path | str], figure_jsons: Sequence[Path | str],
                       reported: Reported, out_dir: Path | str, markdown: Path | str | None = None,
                       templates: Path | None = None, claims_file: Path | str | None = None) -> list[Claim]:
    """Write ``<table>_vs_paper.tex`` per table, ``figures_vs_paper.tex``, ``comparison.md`` and ``comparison.json``.

    ``table_jsons``/``figure_jsons`` are the JSON files written by render-tables/render-figures; ``claims_file`` the
    paper's claims (default ``config/reference/claims.yaml``).
    """
    out_dir = Path(out_dir)
    specs = load_claims(claims_file)
    docs = {d.name: d for d in (read_table_doc(p) for p in table_jsons)}
    figs = {d.name: d for d in (read_table_doc(p) for p in figure_jsons)}
    claims = evaluate_claims(docs, figs, reported, specs)
    kept_dirs, kept = load_kept_runs(cfg["render"].get("kept_runs", []),
                                     {c.id: c.tests for c in claims if c.device and c.tests})
    claims = [across_runs(c, kept) for c in claims]
    per_table: dict[str, list[SideBySide]] = {}
    titles = {}
    for name in TABLES:
        if name not in docs or not TABLES[name].compared:
            continue
        rep_doc = reported.tables.get(name)
        blocks = side_by_side(name, docs[name], rep_doc)
        per_table[name] = blocks
        titles[name] = docs[name].title
        tex = vs_paper_tex(name, blocks, [c for c in claims if c.doc == name], cfg, docs[name].title, templates)
        write_text_atomic(out_dir / f"{name}_vs_paper.tex", tex)
    fig_claims = [c for c in claims if c.doc not in TABLES and not c.extension]
    write_text_atomic(out_dir / "figures_vs_paper.tex", render_template("claims.tex.j2", {
        "caption": "Claims about the paper's figures: reproduced vs reported. " + latex_escape(profile_sentence(cfg)),
        "label": "tab:figures-vs-paper",
        "claims": [{"source": latex_escape(c.source), "statement": latex_escape(c.statement),
                    "reproduced": latex_escape(_reproduced_text(c)), "paper": latex_escape(c.paper),
                    "agrees": _same_mark(c, True)} for c in fig_claims]}, templates))
    md = comparison_markdown(cfg, per_table, titles, claims, kept_dirs)
    write_text_atomic(Path(markdown) if markdown else out_dir / "comparison.md", md)
    write_json_atomic(out_dir / "comparison.json", {"profile": cfg["profile"], "summary": claim_counts(claims),
                                                    "extensions": claim_counts(claims, extension=True),
                                                    "claims": [c.to_json() for c in claims]})
    log.info("compared with the paper: %s", claims_summary(claims).split(";")[0])
    return claims

