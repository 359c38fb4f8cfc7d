"""Reproduced vs reported: every table side by side with the paper's numbers, and the paper's claims checked.

Two kinds of comparison, both always produced:

- **Numbers**: each reproduced cell next to the paper's cell with the same keys (display names and budget
  expressions), and the difference (a ratio for parameter counts). Meaningful for the paper profile.
- **Claims**: the statements the paper makes about its tables and figures ("SpecPrefetch is best or tied-best in 27
  of 30 settings", "PRED0 within 2% of OFF", "throughput peaks at a bounded M_max"), evaluated by the same function
  on the reproduced cells and on the paper's cells. For the embedded default (stand-ins, not the paper's models)
  the direction of each claim is the comparison that means something; ``agrees`` says whether the claim holds in
  both or fails in both.

Device claims (Tables 4-5, Figures 4-6: values from measured runs) are decided by the 95 % paired-bootstrap CI their
cells carry (``render.data.bootstrap_ci``): e.g. "gain > 0" holds iff lo > 0, fails iff hi < 0, and is otherwise
``Verdict.UNRESOLVED``; a comparison of two cells uses the CI of their per-repeat difference. The paper's cells have
no CI (mean ± std) and are judged by their values. Count claims hold only with the count the paper states.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from specprefetch.io import write_json_atomic, write_text_atomic
from specprefetch.metrics import CI, CI_LEVEL, bootstrap_ci
from specprefetch.render.cells import Cell, TableDoc, fmt_fixed, fmt_params, latex_escape, read_table_doc
from specprefetch.render.profile import profile_sentence
from specprefetch.render.reported import MATCH_KEYS, Reported, match_key
from specprefetch.render.tables import TABLES, render_template

log = logging.getLogger(__name__)
PRED0_TOLERANCE_PCT = 2.0  # "PRED0 within 2% of OFF": the runtime issue's target for the control path's overhead


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


# --------------------------------------------------------------------------------------------- claims


class Verdict(str, Enum):
    """Whether a claim holds: decided either way, undecided by the measurements' 95 % CI, or not applicable
    (informational, or nothing to evaluate)."""

    HOLDS = "holds"
    FAILS = "fails"
    UNRESOLVED = "unresolved"
    NA = "n/a"

    @staticmethod
    def of(x: bool | Verdict | None) -> Verdict:
        if isinstance(x, Verdict):
            return x
        return Verdict.NA if x is None else (Verdict.HOLDS if x else Verdict.FAILS)

    @property
    def holds(self) -> bool | None:
        """True / False when decided, None when unresolved or not applicable."""
        return {Verdict.HOLDS: True, Verdict.FAILS: False}.get(self)


@dataclass
class Claim:
    """A statement of the paper, evaluated on the reproduced and on the reported numbers.

    A device claim (its reproduced value comes from measured runs) is decided by the 95 % bootstrap CI of its
    cells: ``Verdict.UNRESOLVED`` when the CI does not exclude the opposite outcome, with ``reason`` saying why.
    ``holds_*`` are True/False only for a decided verdict; ``agrees`` only when both sides are decided."""

    id: str
    source: str  # "Table 1", "Figure 4", ...
    statement: str
    reproduced: str
    paper: str
    verdict_reproduced: Verdict
    verdict_paper: Verdict
    reason: str = ""
    device: bool = False

    def __post_init__(self) -> None:
        self.verdict_reproduced = Verdict.of(self.verdict_reproduced)
        self.verdict_paper = Verdict.of(self.verdict_paper)

    @property
    def holds_reproduced(self) -> bool | None:
        return self.verdict_reproduced.holds

    @property
    def holds_paper(self) -> bool | None:
        return self.verdict_paper.holds

    @property
    def agrees(self) -> bool | None:
        if self.holds_reproduced is None or self.holds_paper is None:
            return None
        return self.holds_reproduced == self.holds_paper

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "statement": self.statement, "reproduced": self.reproduced,
                "paper": self.paper, "holds_reproduced": self.holds_reproduced, "holds_paper": self.holds_paper,
                "verdict_reproduced": self.verdict_reproduced.value, "verdict_paper": self.verdict_paper.value,
                "reason": self.reason, "device": self.device, "agrees": self.agrees}


Outcome = bool | Verdict | None


@dataclass(frozen=True)
class Evaluation:
    """What an evaluator says about one side: the text shown, the outcome and, when unresolved, why."""

    text: str
    outcome: Outcome
    reason: str = ""



Result = tuple[str, bool | None]  # a deterministic (recall, parameter) evaluator's (text, does the claim hold)


def _ev(x: Evaluation | Result) -> Evaluation:
    return x if isinstance(x, Evaluation) else Evaluation(x[0], x[1])


# --------------------------------------------------------------------------------------------- CI decisions

_PCT = f"{CI_LEVEL * 100:g} %"


def cell_ci(c: Cell | None) -> CI | None:
    """A reproduced device cell's CI (None for a cell without one: the paper's, an older JSON's, a recall cell)."""
    if c is None or not c.has_ci:
        return None
    assert c.value is not None and c.lo is not None and c.hi is not None
    return CI(c.value, c.lo, c.hi, int(c.n or 0))


def paired_difference(a: Cell, b: Cell) -> CI | None:
    """CI of mean(a - b) over the repeats both cells have, resampling those repeats (``bootstrap_ci``); None when
    either lacks per-repeat values or they share no repeat."""
    if not a.repeats or not b.repeats:
        return None
    common = sorted(set(a.repeats) & set(b.repeats), key=lambda k: (len(k), k))
    if not common:
        return None
    return bootstrap_ci([a.repeats[k] - b.repeats[k] for k in common])


def _fmt_ci(ci: CI, dec: int, unit: str, sign: bool = True) -> str:
    f = (lambda v: f"{v:+.{dec}f}") if sign else (lambda v: f"{v:.{dec}f}")
    return f"{f(ci.mean)}{unit} ({_PCT} CI {f(ci.lo)}..{f(ci.hi)}{unit}, n={ci.n})"


def decide_sign(ci: CI, positive: bool = True, strict_zero: bool = True) -> tuple[Verdict, str]:
    """'> 0' (``positive``) holds iff lo > 0 and fails iff hi < 0; '≤ 0' (not ``positive``) holds iff hi ≤ 0 and
    fails iff lo > 0. Otherwise, or with a single repeat, unresolved with the reason."""
    if not ci.decidable:
        return Verdict.UNRESOLVED, f"{ci.n} repeat: not decidable"
    if positive:
        if ci.lo > 0:
            return Verdict.HOLDS, ""
        if ci.hi < 0:
            return Verdict.FAILS, ""
    else:
        if ci.hi <= 0:
            return Verdict.HOLDS, ""
        if ci.lo > 0:
            return Verdict.FAILS, ""
    return Verdict.UNRESOLVED, f"the {_PCT} CI contains 0"


def decide_within(ci: CI, tol: float) -> tuple[Verdict, str]:
    """'|x| ≤ tol' holds iff the CI lies within ±tol, fails iff it lies entirely outside, else unresolved."""
    if not ci.decidable:
        return Verdict.UNRESOLVED, f"{ci.n} repeat: not decidable"
    if -tol <= ci.lo and ci.hi <= tol:
        return Verdict.HOLDS, ""
    if ci.hi < -tol or ci.lo > tol:
        return Verdict.FAILS, ""
    return Verdict.UNRESOLVED, f"the {_PCT} CI straddles ±{tol:g}"


def _combine(verdicts: Sequence[tuple[Verdict, str]]) -> tuple[Verdict, str]:
    """All of several conditions: fails if any fails, holds if all hold, else unresolved (first reason)."""
    if any(v is Verdict.FAILS for v, _ in verdicts):
        return Verdict.FAILS, ""
    if all(v is Verdict.HOLDS for v, _ in verdicts):
        return Verdict.HOLDS, ""
    return Verdict.UNRESOLVED, next(r for v, r in verdicts if v is not Verdict.HOLDS)


def _positive_cell(c: Cell | None, doc_missing: bool, dec: int = 2, unit: str = "%") -> Evaluation:
    """'value > 0' of one cell: by its CI when it has one, else by the value (the paper's cells)."""
    if c is None or c.value is None:
        return Evaluation("not rendered" if doc_missing else "no value", None)
    ci = cell_ci(c)
    if ci is None:
        return Evaluation(f"{c.value:+.{dec}f}{unit}", c.value > 0)
    v, why = decide_sign(ci)
    return Evaluation(_fmt_ci(ci, dec, unit), v, why)


def _greater(a: Cell, b: Cell, dec: int, unit: str) -> tuple[Verdict | bool, str, str]:
    """a > b: by the paired CI of a - b (per repeat), else by the two CIs (holds iff a.lo > b.hi, fails iff a.hi <
    b.lo), else by the values. Returns (outcome, the difference's text, reason)."""
    d = paired_difference(a, b)
    if d is not None:
        v, why = decide_sign(d)
        return v, f"; Δ {_fmt_ci(d, dec, unit)}", why
    ca, cb = cell_ci(a), cell_ci(b)
    assert a.value is not None and b.value is not None
    if ca is not None and cb is not None:
        if not (ca.decidable and cb.decidable):
            return Verdict.UNRESOLVED, "", "1 repeat: not decidable"
        if ca.lo > cb.hi:
            return Verdict.HOLDS, "", ""
        if ca.hi < cb.lo:
            return Verdict.FAILS, "", ""
        return Verdict.UNRESOLVED, "", f"the two {_PCT} CIs overlap (unpaired)"
    return a.value > b.value, "", ""


def _settings(doc: TableDoc, method: str) -> dict[tuple[str, str, str], dict[str, float]]:
    """(model, workload, budget) -> {method label: value} for recall tables, only settings where ``method`` has one."""
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for c in doc.cells:
        if c.value is not None:
            out.setdefault((c.keys["model"], c.keys["workload"], str(c.keys["budget"])), {})[c.keys["method"]] = \
                round(c.value, 2)
    return {k: v for k, v in out.items() if method in v}


@dataclass(frozen=True)
class Stated:
    """The count a count claim states: ``hits`` of ``total`` settings (``hits`` None: all of them), and where it
    comes from (the paper's text, or its table where the text gives no number)."""

    hits: int | None
    total: int
    source: str = "its text"

    def met(self, hits: int, total: int) -> bool:
        """Exactly as stated: all settings for "all N"; at least ``hits`` of the same ``total`` for "n of N" (for
        another profile's number of settings, at least the same share)."""
        if self.hits is None:
            return hits == total
        if total == self.total:
            return hits >= self.hits
        return hits * self.total >= self.hits * total

    def describe(self) -> str:
        return f"all {self.total}" if self.hits is None else f"{self.hits} of {self.total}"


def _tally(doc: TableDoc, pred: Callable[[dict[str, float]], bool | None], budget: str | None = None
           ) -> tuple[int, int]:
    hits = total = 0
    for (_, _, b), vals in _settings(doc, "SpecPrefetch").items():
        if budget is not None and b != budget:
            continue
        res = pred(vals)
        if res is None:
            continue
        total += 1
        hits += bool(res)
    return hits, total


def _count(doc: TableDoc | None, pred: Callable[[dict[str, float]], bool | None], budget: str | None = None,
           stated: Stated | None = None) -> Result:
    """"n of N" settings where ``pred`` holds; the claim holds only as ``stated`` (no stated count: n/a)."""
    if doc is None:
        return "not rendered", None
    hits, total = _tally(doc, pred, budget)
    if total == 0:
        return "no settings", None
    return f"{hits} of {total}", None if stated is None else stated.met(hits, total)


def _beats(other: str, strict: bool = True) -> Callable[[dict[str, float]], bool | None]:
    def pred(v: dict[str, float]) -> bool | None:
        if other not in v:
            return None
        return v["SpecPrefetch"] > v[other] if strict else v["SpecPrefetch"] >= v[other]
    return pred


def _best_or_tied(v: dict[str, float]) -> bool:
    return v["SpecPrefetch"] >= max(v.values())


def _largest_gain(doc: TableDoc | None, other: str) -> Result:
    if doc is None:
        return "not rendered", None
    parts, holds = [], True
    by_model: dict[str, tuple[float, str]] = {}
    for (model, workload, budget), v in _settings(doc, "SpecPrefetch").items():
        if other in v:
            gain = v["SpecPrefetch"] - v[other]
            if model not in by_model or gain > by_model[model][0]:
                by_model[model] = (gain, f"{workload} R@{budget}")
    for model, (gain, where) in by_model.items():
        parts.append(f"{model}: {gain:+.2f} pp ({where})")
        holds &= gain > 0
    return ("; ".join(parts), holds) if parts else ("no settings", None)


def _mean_gain_at(doc: TableDoc | None, other: str, budget: str) -> Result:
    if doc is None:
        return "not rendered", None
    by_model: dict[str, list[float]] = {}
    for (model, _, b), v in _settings(doc, "SpecPrefetch").items():
        if b == budget and other in v:
            by_model.setdefault(model, []).append(v["SpecPrefetch"] - v[other])
    if not by_model:
        return "no settings", None
    means = {m: sum(g) / len(g) for m, g in by_model.items()}
    return "; ".join(f"{m}: {g:+.2f} pp" for m, g in means.items()), all(g > 0 for g in means.values())


def _params_ratio(doc: TableDoc | None, other: str, below: float | None) -> Result:
    if doc is None:
        return "not rendered", None
    vals: dict[str, dict[str, float]] = {}
    for c in doc.cells:
        if c.value is not None:
            vals.setdefault(c.keys["model"], {})[c.keys["method"]] = c.value
    parts, holds = [], True
    for model, v in vals.items():
        if "SpecPrefetch" in v and v.get(other):
            ratio = 100.0 * v["SpecPrefetch"] / v[other]
            parts.append(f"{model}: {ratio:.1f}%")
            holds &= below is None or ratio < below
    if not parts:
        return "no settings", None
    return "; ".join(parts), (holds if below is not None else None)


def _cell(doc: TableDoc | None, cid: str) -> Cell | None:
    if doc is None:
        return None
    return doc.by_id().get(cid)


def _value_claim(doc: TableDoc | None, cid: str, test: Callable[[float], bool], unit: str = "%",
                 decimals: int = 2) -> Result:
    c = _cell(doc, cid)
    if c is None or c.value is None:
        return ("not rendered" if doc is None else "no value"), None
    return f"{c.value:+.{decimals}f}{unit}", test(c.value)


def _within_claim(doc: TableDoc | None, cid: str, tol: float) -> Evaluation:
    """'|value| ≤ tol' of one device cell: by its CI (``decide_within``), else by the value."""
    c = _cell(doc, cid)
    if c is None or c.value is None:
        return Evaluation("not rendered" if doc is None else "no value", None)
    ci = cell_ci(c)
    if ci is None:
        return Evaluation(f"{c.value:+.2f}%", abs(c.value) <= tol)
    v, why = decide_within(ci, tol)
    return Evaluation(_fmt_ci(ci, 2, "%"), v, why)


def _compare_cells(doc: TableDoc | None, a: str, b: str, label: str = "{a} vs {b}", decimals: int = 2,
                   unit: str = "%") -> Evaluation:
    """'a > b' of two device cells: by the paired CI of their per-repeat difference (``_greater``)."""
    ca, cb = _cell(doc, a), _cell(doc, b)
    if ca is None or cb is None or ca.value is None or cb.value is None:
        return Evaluation("not rendered" if doc is None else "no value", None)
    outcome, diff, why = _greater(ca, cb, decimals, unit)
    return Evaluation(label.format(a=f"{ca.value:.{decimals}f}{unit}", b=f"{cb.value:.{decimals}f}{unit}") + diff,
                      outcome, why)


def _profiled_at_peak(tp: list[Cell], peak: Cell, profiled: Any) -> Evaluation:
    """'The profiled budget is the fastest swept one': holds when it is the peak, fails when the peak is faster by
    the paired CI of their difference, unresolved when that CI contains 0."""
    at = next((c for c in tp if c.keys["m_max"] == profiled), None)
    if at is None:
        return Evaluation("the profiled M_max was not swept" if profiled is not None else "no profiled M_max", None)
    text = f"profiled {profiled}, peak at {peak.keys['m_max']}"
    if at is peak:
        return Evaluation(text, True)
    outcome, diff, why = _greater(peak, at, 3, " tok/s")  # the peak faster than the profiled budget: the claim fails
    v = Verdict.of(outcome)
    return Evaluation(text + diff, {Verdict.HOLDS: Verdict.FAILS, Verdict.FAILS: Verdict.HOLDS}.get(v, v), why)


def _same(rep: Reported, a: str, b: str) -> bool | None:
    x, y = rep.in_text.get(a), rep.in_text.get(b)
    return None if x is None or y is None else x.value == y.value


def _in_text(rep: Reported, *ids: str, fmt: str = "{}") -> str:
    vals = []
    for i in ids:
        it = rep.in_text.get(i)
        vals.append("?" if it is None else (f"≈{it.value:g}" if it.approx else f"{it.value:g}"))
    return fmt.format(*vals)


# The counts the paper's text states (§4.2, §4.3): "best or tied-best recall in 27 of the 30 settings",
# "outperforms the Single MLP in all 30 settings", "consistently outperforms the learned predictor baselines" (ProMoE,
# Draft Model: every setting where evaluated). The text gives no count of strict wins over FATE (only that FATE
# leads in three settings), so those two claims take their count from the paper's Table 1.
STATED_COUNTS: dict[str, Stated] = {
    "t1_best_or_tied": Stated(27, 30),
    "t1_beats_promoe": Stated(None, 30),
    "t1_beats_draft": Stated(None, 24),
    "t2_beats_single_mlp": Stated(None, 30),
}


def _table_claims(docs: Mapping[str, TableDoc], rep: Reported) -> list[Claim]:
    t = docs.get
    p = rep.tables.get
    claims = []

    def add(cid: str, source: str, statement: str, ev: Callable[[TableDoc | None], Evaluation | Result], table: str,
            device: bool = False) -> None:
        r, q = _ev(ev(t(table))), _ev(ev(p(table)))
        claims.append(Claim(cid, source, statement, r.text, q.text, Verdict.of(r.outcome), Verdict.of(q.outcome),
                            r.reason, device))

    def count(cid: str, statement: str, pred: Callable[[dict[str, float]], bool | None], table: str,
              budget: str | None = None) -> None:
        stated = STATED_COUNTS.get(cid)
        if stated is None:  # no count in the text: the paper's own table's
            paper_doc = p(table)
            if paper_doc is not None:
                h, n = _tally(paper_doc, pred, budget)
                stated = Stated(h, n, "its table") if n else None
        where = ""
        if stated is not None:
            rule = "only in every setting" if stated.hits is None else "with at least as many"
            where = f" (the paper: {stated.describe()} settings, in {stated.source}; holds {rule})"
        add(cid, "Table " + table[5], statement + where, lambda d: _count(d, pred, budget, stated), table)

    count("t1_best_or_tied", "SpecPrefetch has the best or tied-best recall", _best_or_tied, "table1_recall")
    count("t1_beats_fate_at_k", "SpecPrefetch beats FATE at R@K", _beats("FATE"), "table1_recall", budget="K")
    count("t1_beats_fate", "SpecPrefetch beats FATE (all budgets)", _beats("FATE"), "table1_recall")
    count("t1_beats_promoe", "SpecPrefetch beats ProMoE (all budgets)", _beats("ProMoE"), "table1_recall")
    count("t1_beats_draft", "SpecPrefetch beats Draft Model (where evaluated)", _beats("Draft Model"),
          "table1_recall")
    add("t1_largest_gain_fate", "Table 1", "Largest gain of SpecPrefetch over FATE is positive",
        lambda d: _largest_gain(d, "FATE"), "table1_recall")
    count("t2_beats_single_mlp", "SpecPrefetch beats the Single MLP", _beats("Single MLP"), "table2_ablation")
    add("t2_gain_at_k", "Table 2", "Mean gain over the Single MLP at R@K is positive",
        lambda d: _mean_gain_at(d, "Single MLP", "K"), "table2_ablation")
    add("t3_vs_promoe", "Table 3", "SpecPrefetch has fewer parameters than ProMoE (% of ProMoE)",
        lambda d: _params_ratio(d, "ProMoE", 100.0), "table3_params")
    add("t3_vs_draft", "Table 3", "SpecPrefetch has fewer parameters than Draft Model (% of Draft Model)",
        lambda d: _params_ratio(d, "Draft Model", 100.0), "table3_params")
    add("t3_vs_single_mlp", "Table 3", "SpecPrefetch parameters as % of the Single MLP (informational)",
        lambda d: _params_ratio(d, "Single MLP", None), "table3_params")
    add("t4_pred0_overhead", "Table 4", f"PRED0 within {PRED0_TOLERANCE_PCT:g}% of OFF (prediction overhead)",
        lambda d: _within_claim(d, "PRED0/gain", PRED0_TOLERANCE_PCT), "table4_overhead", device=True)
    add("t4_specprefetch_faster", "Table 4", "SpecPrefetch faster than OFF",
        lambda d: _positive_cell(_cell(d, "SpecPrefetch/gain"), d is None), "table4_overhead", device=True)
    add("t5_beats_naive_cold", "Table 5", "SpecPrefetch gains more than Naive Prefetch (cold storage)",
        lambda d: _compare_cells(d, "SpecPrefetch/gain_cold", "Naive Prefetch/gain_cold", "{a} vs {b}"),
        "table5_matched", device=True)
    add("t5_beats_naive_slow", "Table 5", "SpecPrefetch gains more than Naive Prefetch (slow storage)",
        lambda d: _compare_cells(d, "SpecPrefetch/gain_slow", "Naive Prefetch/gain_slow", "{a} vs {b}"),
        "table5_matched", device=True)
    add("t5_slow_over_cold", "Table 5", "SpecPrefetch's gain is larger under slow than cold storage",
        lambda d: _compare_cells(d, "SpecPrefetch/gain_slow", "SpecPrefetch/gain_cold", "{a} vs {b}"),
        "table5_matched", device=True)
    add("t5_ready_recall", "Table 5", "SpecPrefetch has higher ReadyRecall than Naive Prefetch",
        lambda d: _compare_cells(d, "SpecPrefetch/ready_recall", "Naive Prefetch/ready_recall",
                                 "{a} vs {b}", decimals=1), "table5_matched", device=True)

    def naive_no_gain(d: TableDoc | None) -> Evaluation:
        cs = [_cell(d, f"Naive Prefetch/{c}") for c in ("gain_cold", "gain_slow")]
        if d is None or any(c is None or c.value is None for c in cs):
            return Evaluation("not rendered" if d is None else "no value", None)
        cis = [cell_ci(c) for c in cs]
        if any(ci is None for ci in cis):
            return Evaluation(", ".join(f"{c.value:+.2f}%" for c in cs), all(c.value <= 0 for c in cs))
        v, why = _combine([decide_sign(ci, positive=False) for ci in cis])
        return Evaluation(", ".join(_fmt_ci(ci, 2, "%") for ci in cis), v, why)

    add("t5_naive_no_gain", "Table 5", "Naive Prefetch provides no acceleration (gain ≤ 0, both storages)",
        naive_no_gain, "table5_matched", device=True)
    return claims


def _figure_claims(figs: Mapping[str, TableDoc], rep: Reported) -> list[Claim]:
    claims = []

    def add(cid: str, source: str, statement: str, ev: Evaluation | Result, paper: str, paper_holds: bool | None,
            device: bool = False) -> None:
        e = _ev(ev)
        claims.append(Claim(cid, source, statement, e.text, paper, Verdict.of(e.outcome), Verdict.of(paper_holds),
                            e.reason, device))

    def greater(a: Cell, b: Cell, text: str, dec: int, unit: str) -> Evaluation:
        outcome, diff, why = _greater(a, b, dec, unit)
        return Evaluation(text + diff, outcome, why)

    lat = figs.get("fig1a_latency")
    if lat is not None:
        shares = [c for c in lat.cells if c.id.endswith("/expert_load_share") and c.keys.get("mode") == "on_demand"]
        text = "; ".join(f"{c.keys['platform']}: {c.value:.0f}%" for c in shares)
        add("f1a_load_share", "Figure 1(a)", "Exposed expert loading is over half of the on-demand per-layer latency",
            (text or "no value", all(c.value > 50 for c in shares) if shares else None),
            _in_text(rep, "fig1a/expert_load_share/gpu", "fig1a/expert_load_share/mobile_cold",
                     fmt="GPU {}%; mobile cold {}%"), True)
    win = figs.get("fig1b_window")
    if win is not None:
        ex = sorted((c for c in win.cells if c.id.endswith("/exceed_pct")), key=lambda c: (c.id.rsplit("/M", 1)[0],
                                                                                         c.keys["M"]))
        groups: dict[str, list[Cell]] = {}
        for c in ex:
            groups.setdefault(f"{c.keys['platform']}/{c.keys['model']}", []).append(c)
        text = "; ".join(", ".join(f"top-{c.keys['M']}: {c.value:.0f}%" for c in cs) for cs in groups.values())
        mono = all(all(a.value <= b.value for a, b in zip(cs, cs[1:], strict=False)) for cs in groups.values())
        add("f1b_exceed", "Figure 1(b)", "More candidates exceed the window more often (demand > window, % events)",
            (text or "no value", mono if groups else None),
            _in_text(rep, "fig1b/exceed_pct/M4", "fig1b/exceed_pct/M8", fmt="top-4: {}%, top-8: {}%"), True)
        wt = [c for c in win.cells if c.id.endswith("/window_transfers")]
        add("f1b_window_transfers", "Figure 1(b)", "The window fits about this many expert transfers (informational)",
            ("; ".join(f"{c.value:.1f}" for c in wt) or "no value", None),
            _in_text(rep, "fig1b/window_transfers", fmt="{}"), None)
    bud = figs.get("fig4_budget")
    if bud is not None:
        rr = sorted((c for c in bud.cells if c.id.endswith("/ready_recall") and c.value is not None),
                    key=lambda c: c.keys["m_max"])
        tp = sorted((c for c in bud.cells if c.id.startswith("M") and c.id.endswith("/throughput")),
                    key=lambda c: c.keys["m_max"])
        if rr:
            add("f4_ready_recall_rises", "Figure 4", "ReadyRecall rises from the smallest to the largest M_max",
                greater(rr[-1], rr[0], f"{rr[0].value:.1f}% → {rr[-1].value:.1f}%", 1, " pp"),
                _in_text(rep, "fig4/ready_recall/min_budget", "fig4/ready_recall/max_budget", fmt="{}% → {}%"), True,
                device=True)
        if tp:
            peak = max(tp, key=lambda c: c.value)
            text = f"peak at {peak.keys['m_max']} of {tp[0].keys['m_max']}–{tp[-1].keys['m_max']}"
            if len(tp) < 2:
                ev: Evaluation | Result = (text, None)
            else:  # the best bounded budget vs the largest swept, paired per repeat
                best = max(tp[:-1], key=lambda c: c.value)
                outcome, diff, why = _greater(best, tp[-1], 3, " tok/s")
                ev = Evaluation(text + (f" (M_max {best.keys['m_max']} vs {tp[-1].keys['m_max']}{diff})"
                                        if diff else ""), outcome, why)
            add("f4_bounded_peak", "Figure 4", "Throughput peaks at a bounded M_max (below the largest swept)", ev,
                _in_text(rep, "fig4/throughput_peak_m_max", fmt="peak at {}"), True, device=True)
            add("f4_profiled_at_peak", "Figure 4", "The window-profiled M_max is the sweep's fastest budget",
                _profiled_at_peak(tp, peak, bud.meta.get("profiled_m_max")),
                _in_text(rep, "table4/m_max", "fig4/throughput_peak_m_max", fmt="profiled {}, peak at {}"),
                _same(rep, "table4/m_max", "fig4/throughput_peak_m_max"), device=True)
    sto = figs.get("fig5_storage")
    if sto is not None:
        gains = {c.keys["storage"]: c for c in sto.cells if c.id.endswith("/gain") and c.value is not None}
        if gains:
            from specprefetch.render.style import STORAGE_ORDER

            order = [s for s in STORAGE_ORDER if s in gains]
            fastest, slowest = order[0], order[-1]
            text = ", ".join(f"{s}: {gains[s].value:+.1f}%" for s in order)
            add("f5_gain_grows", "Figure 5", "SpecPrefetch's gain grows as storage slows (fastest vs slowest)",
                greater(gains[slowest], gains[fastest], text, 2, " pp"),
                _in_text(rep, "fig5/gain/slow_ufs", "fig5/gain/sdcard", fmt="slow UFS {}%, SD card {}%"), True,
                device=True)
            if "slow_ufs" in gains:
                add("f5_slow_ufs", "Figure 5", "SpecPrefetch faster than OFF under Slow UFS",
                    _positive_cell(gains["slow_ufs"], False), _in_text(rep, "fig5/gain/slow_ufs", fmt="{}%"), True,
                    device=True)
            if "sdcard" in gains:
                add("f5_sdcard", "Figure 5", "SpecPrefetch faster than OFF on the SD card",
                    _positive_cell(gains["sdcard"], False), _in_text(rep, "fig5/gain/sdcard", fmt="{}%"), True,
                    device=True)
    comp = figs.get("fig6_component")
    if comp is not None:
        tps = {c.id.split("/")[0]: c for c in comp.cells if c.id.endswith("/throughput") and c.value is not None}
        if tps:
            best = max(tps, key=lambda k: tps[k].value)
            text = f"fastest: {best}"
            if "+ Both" not in tps:
                ev = (text, None)
            else:  # + Both faster than each other configuration, paired per repeat
                parts = [_greater(tps["+ Both"], c, 3, " tok/s") for k, c in tps.items() if k != "+ Both"]
                v, why = _combine([(Verdict.of(o), r) for o, _, r in parts])
                ev = Evaluation(text, v, why)
            add("f6_combination_best", "Figure 6", "Compute optimization + SpecPrefetch is the fastest configuration",
                ev, "fastest: + Both", True, device=True)
    return claims


def evaluate_claims(docs: Mapping[str, TableDoc], figs: Mapping[str, TableDoc], rep: Reported) -> list[Claim]:
    return _table_claims(docs, rep) + _figure_claims(figs, rep)


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


def claim_counts(claims: Sequence[Claim]) -> dict[str, int]:
    """How many claims hold, fail and are unresolved on the reproduced side, of the checkable ones (n/a left out)."""
    out = {v.value: sum(c.verdict_reproduced is v for c in claims) for v in Verdict}
    out["checkable"] = len(claims) - out[Verdict.NA.value]
    return out


def claims_summary(claims: Sequence[Claim]) -> str:
    """ "X hold, Y fail, Z unresolved of N" (reproduced, N the checkable claims), and how many agree with the paper."""
    n = claim_counts(claims)
    agree = [c.agrees for c in claims if c.agrees is not None]
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


def comparison_markdown(cfg: Mapping[str, Any], per_table: Mapping[str, list[SideBySide]],
                        titles: Mapping[str, str], claims: Sequence[Claim]) -> str:
    lines = ["# Reproduced vs reported", "", profile_sentence(cfg), ""]
    lines += [f"**Claims:** {claims_summary(claims)}", ""]
    if cfg["profile"] != "paper":
        lines += ["The models here are not the paper's checkpoints, so the numeric differences below are not "
                  "errors; the claims (directions) are the comparison that carries over.", ""]
    lines += ["## Claims", "", "| Source | Claim | Reproduced | Paper | Same? |", "|---|---|---|---|---|"]
    for c in claims:
        why = f": {c.reason}" if c.verdict_reproduced is Verdict.UNRESOLVED and c.reason else ""
        lines.append(f"| {c.source} | {_md_escape(c.statement)} | {_md_escape(c.reproduced)} "
                     f"({_holds(c.verdict_reproduced)}{_md_escape(why)}) | {_md_escape(c.paper)} "
                     f"({_holds(c.verdict_paper)}) | {_same_mark(c, False)} |")
    lines += ["", f"Reproduced device values: mean [{_PCT} CI, paired bootstrap over repeats]; the paper's: "
              "mean ± std."]
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


def compare_with_paper(cfg: Mapping[str, Any], table_jsons: Sequence[Path | str], figure_jsons: Sequence[Path | str],
                       reported: Reported, out_dir: Path | str, markdown: Path | str | None = None,
                       templates: Path | None = None) -> list[Claim]:
    """Write ``<table>_vs_paper.tex`` per table, ``figures_vs_paper.tex``, ``comparison.md`` and ``comparison.json``.

    ``table_jsons``/``figure_jsons`` are the JSON files written by render-tables/render-figures.
    """
    out_dir = Path(out_dir)
    docs = {d.name: d for d in (read_table_doc(p) for p in table_jsons)}
    figs = {d.name: d for d in (read_table_doc(p) for p in figure_jsons)}
    claims = evaluate_claims(docs, figs, reported)
    per_table: dict[str, list[SideBySide]] = {}
    titles = {}
    for name in TABLES:
        if name not in docs:
            continue
        rep_doc = reported.tables.get(name)
        blocks = side_by_side(name, docs[name], rep_doc)
        per_table[name] = blocks
        titles[name] = docs[name].title
        source = "Table " + name[5]
        tex = vs_paper_tex(name, blocks, [c for c in claims if c.source == source], cfg, docs[name].title,
                           templates)
        write_text_atomic(out_dir / f"{name}_vs_paper.tex", tex)
    fig_claims = [c for c in claims if c.source.startswith("Figure")]
    write_text_atomic(out_dir / "figures_vs_paper.tex", render_template("claims.tex.j2", {
        "caption": "Claims about the paper's figures: reproduced vs reported. " + latex_escape(profile_sentence(cfg)),
        "label": "tab:figures-vs-paper",
        "claims": [{"source": latex_escape(c.source), "statement": latex_escape(c.statement),
                    "reproduced": latex_escape(_reproduced_text(c)), "paper": latex_escape(c.paper),
                    "agrees": _same_mark(c, True)} for c in fig_claims]}, templates))
    md = comparison_markdown(cfg, per_table, titles, claims)
    write_text_atomic(Path(markdown) if markdown else out_dir / "comparison.md", md)
    write_json_atomic(out_dir / "comparison.json", {"profile": cfg["profile"], "summary": claim_counts(claims),
                                                    "claims": [c.to_json() for c in claims]})
    log.info("compared with the paper: %s", claims_summary(claims).split(";")[0])
    return claims

