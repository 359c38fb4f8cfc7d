"""``specprefetch diff-tables OLD NEW``: compare two renderings of the paper's tables cell by cell.

Every table and figure the renderer writes has a JSON twin (``paper_tables/table1_recall.json``,
``paper_tables/figures/fig4_budget.json``, ...) holding each printed number with a stable cell id. This tool
matches the twins of OLD and NEW by table name and cell id, prints every cell that moved, and fails (exit status 1)
when a cell moved past what it allows, when a cell or table appeared or disappeared, or when a value became a dash
(or the reverse).

Measured cells are judged by their uncertainty. A cell of a timing quantity (throughput, gain, ReadyRecall, share,
latency, window, demand: :data:`BETWEEN_RUN`) that carries ``n`` >= 2 and ``std`` in both renderings (the device
tables' cells, mean over repeats) passes when the difference of the two means lies within

    ± sqrt((t · SE)² + B²),   SE = sqrt(std_old²/n_old + std_new²/n_new)

``t`` is Welch's t quantile (Welch-Satterthwaite degrees of freedom) at 95 % family-wise confidence, Bonferroni over
every cell the test judges in this diff (:data:`FAMILY_LEVEL`); ``B``, the between-run allowance, is what a rerun on
another hour or host moves beyond the repeats' noise (the host's speed and disk state; the within-run CI cannot see
them): ``max(abs, rel · max(|old|, |new|))``. Absolute quantities (tok/s, ms, ReadyRecall, share of the bound) get
a relative allowance (35 % / 25 %: a host 30 % faster moves every throughput); gains, ratios inside one paired block,
get max(2 pp, 15 %) (they move with the host's compute-to-transfer ratio, far less than with its speed). A cell of
such a quantity without ``n`` >= 2 and ``std`` on both sides (one repeat, an older JSON) falls back to the fixed
tolerance below and its line says so.

Budgets the host chose. On another hour the window profile measures another W/t and its rule another budget; the
cells then measure other configurations. A budget cell with ``n``/``std`` (``m_max``: the budget-rule figure's) is
judged by the test with the allowance of a time (W/t moves as the host's compute does: 35 % of the budget, or one
step of the floor where that is more). A cell that carries the budget it ran at (key ``m_max``: Figure 5's
SpecPrefetch bars, Table 5, the rules' losses) and moved past its tolerance passes when its budget moved within that
allowance, and says so. A cell that exists only because a rule chose its budget on that host (key ``chosen``: a
sweep point off ``device.sweep_m_max``, a budget rule's row where its budgets differ from the paper rule's) may
appear or vanish. Figure 4's ``peak_m_max`` (and a variant's, the argmax of the sweep's mean throughputs,
:data:`PEAKS`) may move between two budgets whose throughputs are a tie by the test in every rendering that
measured both (one that measured only one of them cannot contradict the tie). The summary line counts the cells
passed this way. Everything else (recall, deterministic given the seeds; parameter counts; a budget without
``n``/``std``) is compared with the fixed tolerances. Both come from ``render.tolerances``::

    render:
      tolerances:
        default: {recall: {abs: 0.5}, params: {abs: 0}, throughput: {rel: 0.5}, gain: {abs: 10.0}}
        table4_overhead: {throughput: {rel: 1.0, between_run: {rel: 0.5}}}   # a per-table override
        fig1b_window: {window_ms: {ignore: true}}                           # report, never fail
        table1_recall: {recall: {abs: 0.5, between_run: {abs: 0.0}}}        # judge seed CIs by the test

``abs`` is in the cell's display unit (percentage points for recall and gains, tok/s, parameters); ``rel`` is a
fraction of the old value; a cell passes if it is within either. ``between_run`` (``{abs, rel}``) is the measured
cells' allowance ``B``: a table's entry, else ``default``'s, else the built-in :data:`BETWEEN_RUN`; ``between_run:
false`` judges the quantity by the fixed tolerance only. ``ignore: true`` lists a move without failing (and a cell
of that quantity appearing, disappearing or becoming a dash). Quantities without a tolerance must match exactly.

A ``note:`` line names every measurement setting in a table's meta that differs between the two renderings
(:data:`SETUP_KEYS`: platform, model, repeats, the budgets the window profile chose): on a faster or slower host the
profiled ``M_max`` changes, and the cells that depend on it then measure something else. The notes explain such
failures; they do not excuse them.

Accepting an intended change (a fix that moves numbers, a new table): regenerate the committed renderings
(``snakemake --cores all paper_tables``, which rewrites ``paper_tables/``), run
``specprefetch diff-tables <old copy or git worktree of paper_tables> paper_tables --config config/config.yaml`` to
review exactly which cells moved and by how much, then commit the regenerated ``paper_tables/`` (the .tex, .json,
figures and comparison) in the same commit as the code change, saying in the message why the numbers moved. CI
diffs against the committed files, so the new numbers become the reference. Loosen a tolerance in
``render.tolerances`` only when the quantity is noisier than assumed (e.g. throughput on a new CI machine).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specprefetch.contracts import ContractError, read_doc
from specprefetch.io import SpecPrefetchError
from specprefetch.metrics import CI
from specprefetch.render.cells import CHOSEN, TABLE_FORMAT, Cell, TableDoc, read_table_doc
from specprefetch.render.claims import Test, Verdict, combine, judge_across_runs

log = logging.getLogger(__name__)

class DiffError(SpecPrefetchError):
    """Inputs of diff-tables are unusable (no table JSON, malformed tolerances, a malformed measured cell)."""


# ------------------------------------------------------------------------------------------------- the statistical test

# The confidence that no measured cell of an honest rerun fails: Bonferroni over the cells the test judges in one diff
# (about 70 device cells in the embedded default's tables and figures), so a rerun is not failed by one cell in twenty.
FAMILY_LEVEL = 0.95


@dataclass(frozen=True)
class Allowance:
    """The between-run allowance ``B`` of a measured cell: ``max(abs, rel · max(|old|, |new|))`` (symmetric in the
    two renderings), added in quadrature to the CI-based half-width."""

    abs: float = 0.0
    rel: float = 0.0

    def at(self, old: float, new: float) -> float:
        return max(self.abs, self.rel * max(abs(old), abs(new)))

    def describe(self) -> str:
        parts = ([f"{self.abs:g} abs"] if self.abs else []) + ([f"{self.rel:.0%} rel"] if self.rel else [])
        return " or ".join(parts) or "none"


# Built-in between-run allowances of the measured quantities (a table's or `default`'s `between_run` overrides).
# Calibrated on the two honest runs of the embedded default on one host that exist (paper_tables/ and
# docs/precise-run/, 6 and 36 repeats, same budgets, hours apart): throughputs moved by up to 23 % (cold NVMe: the
# disk slowed), the share of the bound by 22 %, ReadyRecall by 21 % (9.5 pp: whether a prefetch lands in time is a
# timing), prefetching gains by up to 5 pp, within their CIs (those with CIs under 1 pp by under 1 pp; all-resident
# by 28 %). Across days (issue 28) the host's speed moved
# 35 % (all-resident 24.9 -> 33.7 tok/s). Gains are ratios inside one paired block: the host's speed cancels, its
# compute-to-transfer ratio does not. Recall is absent: it is deterministic given the seeds (a rerun reproduces it),
# so its seed CI is not the yardstick of a rerun; add `between_run` to judge it by the test.
# A budget a rule chose (quantity ``m_max`` with n/std: the budget-rule figure's, per repeat) is the floor of a
# measured ratio W/t (W_l/t), or the argmax of a curve the simulator drew from it. W is the host's compute, a time
# (35 % between runs); t is the disk's read, or fixed by the datasheet under the bandwidth emulation, so W/t moves
# like a time: the budget may move by 35 % of itself, and by one step of the floor where that is more. A cell measured
# at a budget (key ``m_max``) that moved past its own tolerance measured another configuration: it passes when its
# budget moved within that (:func:`judge_budget`).
BETWEEN_RUN: dict[str, Allowance] = {
    "throughput": Allowance(rel=0.35), "latency_ms": Allowance(rel=0.35), "window_ms": Allowance(rel=0.35),
    "demand_ms": Allowance(rel=0.35), "share_pct": Allowance(rel=0.25), "ready_recall": Allowance(rel=0.25),
    "gain": Allowance(abs=2.0, rel=0.15), "m_max": Allowance(abs=1.0, rel=0.35)}


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes' betacf)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) of Student's t with ``df`` (real, > 0) degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (``0.5 < p < 1``, real ``df`` > 0), by bisection on :func:`t_sf`."""
    if not 0.5 < p < 1.0 or not df > 0:
        raise ValueError(f"t_ppf: need 0.5 < p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > 1.0 - p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_sf(mid, df) > 1.0 - p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2.0


@dataclass(frozen=True)
class Welch:
    """How a measured cell was judged: the difference of the means against ``± sqrt((t·SE)² + B²)``."""

    diff: float
    se: float
    df: float
    t: float
    level: float  # two-sided confidence of t, per cell
    between: float  # B
    allowance: Allowance

    @property
    def allowed(self) -> float:
        return math.hypot(self.t * self.se, self.between)

    @property
    def passes(self) -> bool:
        return abs(self.diff) <= self.allowed * (1 + 1e-12) + 1e-12

    def describe(self) -> str:
        return (f"Welch t {self.t:.2f} (df {self.df:.1f}, {100 * self.level:.3g} % per cell) × SE {self.se:.3g} "
                f"= ±{self.t * self.se:.3g} ⊕ between-run ±{self.between:.3g} ({self.allowance.describe()})")


def welch(old: Cell, new: Cell, level: float, allowance: Allowance) -> Welch:
    """Welch's test of two cells' means (``value``, ``std``, ``n`` >= 2 each; :func:`missing_stats` is None)."""
    assert old.value is not None and new.value is not None and old.std is not None and new.std is not None
    assert old.n is not None and new.n is not None
    v1, v2 = old.std ** 2 / old.n, new.std ** 2 / new.n
    se = math.sqrt(v1 + v2)
    df = (v1 + v2) ** 2 / (v1 ** 2 / (old.n - 1) + v2 ** 2 / (new.n - 1)) if v1 + v2 > 0 else old.n + new.n - 2.0
    t = t_ppf(1.0 - (1.0 - level) / 2.0, df)
    return Welch(new.value - old.value, se, df, t, level, allowance.at(old.value, new.value), allowance)


def missing_stats(c: Cell, side: str, where: str) -> str | None:
    """Why a cell cannot be judged by the test (None: it can): no ``n``/``std`` (a single repeat, an older JSON), or
    one repeat. A negative ``std`` or an ``n`` below 1 is a malformed cell: :class:`DiffError` naming it."""
    if c.std is not None and (not math.isfinite(c.std) or c.std < 0):
        raise DiffError(f"{where}: cell {c.id!r}: std {c.std!r} is not a standard deviation")
    if c.n is not None and c.n < 1:
        raise DiffError(f"{where}: cell {c.id!r}: n {c.n!r} is not a number of repeats")
    if c.n is None and c.std is None:
        return f"no n/std in {side}"
    if c.n is None or c.std is None:
        return f"no {'n' if c.n is None else 'std'} in {side}"
    if c.n < 2:
        return f"n = {c.n} in {side}"
    return None


# Cells that are the argmax of other cells of their table (the budget sweep's fastest M_max, Figure 4): a template of
# the cells they pick from. When the argmax moves it passes if, in every rendering that measured both budgets, the
# throughputs at the two are a tie by the test (Welch, no between-run allowance: one run, one block): the sweep's
# peak is flat and noise picked another point of it (when the points' quantity is judged by the test at all: without
# `between_run` the argmax is compared exactly; also when neither rendering measured both budgets).
PEAKS: dict[str, tuple[str, str]] = {"peak_m_max": ("M{}/throughput", "throughput")}  # template, quantity


def peak_of(cid: str) -> tuple[str, str] | None:
    """(the template of its points, their quantity) for an argmax cell of :data:`PEAKS`, a variant's too (id prefix
    ``<variant>:``, its points carry the same prefix); None for any other cell."""
    variant, _, name = cid.rpartition(":")
    if name not in PEAKS:
        return None
    template, quantity = PEAKS[name]
    return (f"{variant}:{template}" if variant else template), quantity


def judge_peak(cid: str, a: Cell, b: Cell, old: Mapping[str, Cell], new: Mapping[str, Cell], level: float,
               names: tuple[str, str]) -> tuple[bool, str] | None:
    """(a tie in every rendering that measured both budgets, the evidence) for an argmax cell of :data:`PEAKS` whose
    value moved from ``a`` to ``b``. A rendering that lacks one of the two points (a point a rule chose, measured in
    one run only) cannot contradict the tie and is named as such; None when a rendering has both points without
    n/std, or neither has both (then the cell is compared exactly)."""
    assert a.value is not None and b.value is not None
    parts, tie, judged = [], True, 0
    template = peak_of(cid)
    assert template is not None
    for side, cells, where in (("OLD", old, names[0]), ("NEW", new, names[1])):
        x, y = cells.get(template[0].format(int(a.value))), cells.get(template[0].format(int(b.value)))
        if x is None or y is None or not (_finite(x.value) and _finite(y.value)):
            parts.append(f"{side} did not measure both M{int(a.value)} and M{int(b.value)}")
            continue
        if missing_stats(x, side, where) or missing_stats(y, side, where):
            return None  # measured both, but the test cannot judge them
        w = welch(x, y, level, Allowance())
        tie, judged = tie and w.passes, judged + 1
        parts.append(f"{side} {x.id} {_with_ci(x)} vs {y.id} {_with_ci(y)}: Δ {w.diff:+.3g} "
                     f"{'within' if w.passes else 'outside'} ±{w.allowed:.3g}")
    return (tie, "; ".join(parts)) if judged else None


def judge_budget(a: Cell, b: Cell, allowance: Allowance | None) -> tuple[bool, str] | None:
    """(the budget's move is one a rerun explains, the evidence) for two cells of one id measured at different
    budgets (key ``m_max`` in both, other values) whose values moved past their tolerance: they measured two
    configurations, and the move passes when the budget's does, within ``allowance`` (:data:`BETWEEN_RUN`'s
    ``m_max``). None when the cells do not carry two budgets, or they are budgets themselves, or budgets are compared
    exactly (``between_run: false``)."""
    ma, mb = a.keys.get("m_max"), b.keys.get("m_max")
    if a.quantity == "m_max" or allowance is None or not all(isinstance(m, (int, float)) for m in (ma, mb)) \
            or ma == mb:
        return None
    assert isinstance(ma, (int, float)) and isinstance(mb, (int, float))
    limit = allowance.at(float(ma), float(mb))
    ok = abs(float(mb) - float(ma)) <= limit + 1e-9
    return ok, (f"past its tolerance, but measured at M_max {ma:g} in OLD, {mb:g} in NEW: another configuration; "
                f"the budget moved by {float(mb) - float(ma):+g}, {'within' if ok else 'past'} ±{limit:g} "
                f"({allowance.describe()}, a rerun's step)")


# ------------------------------------------------------------------------------------------------- fixed tolerances


@dataclass(frozen=True)
class Tolerance:
    abs: float = 0.0
    rel: float = 0.0
    ignore: bool = False
    between_run: Allowance | None = None  # judge measured cells by the test with this B; None: fixed only

    def allows(self, old: float, new: float) -> bool:
        d = abs(new - old)
        return self.ignore or d <= self.abs + 1e-12 or d <= self.rel * abs(old) + 1e-12

    def describe(self) -> str:
        if self.ignore:
            return "ignored"
        parts = ([f"±{self.abs:g} abs"] if self.abs else []) + ([f"±{self.rel:.0%} rel"] if self.rel else [])
        return " or ".join(parts) or "exact"


class Tolerances:
    """Resolve the tolerance of (table, quantity): the table's own entry, else ``default``'s; its ``between_run``
    from the table's entry, else ``default``'s, else :data:`BETWEEN_RUN` (``false`` at any level: fixed only).

    The spec is ``render.tolerances`` as validated with the schema, which holds the defaults of ``default`` (exact
    parameter counts, tight recall, loose timings) and of every entry's ``abs``/``rel``/``ignore``.
    """

    def __init__(self, spec: Mapping[str, Any] | None = None, where: str = "render.tolerances") -> None:
        from specprefetch.config import ConfigError, section_defaults

        try:
            spec = section_defaults("render", {"tolerances": dict(spec or {})})["tolerances"]
        except ConfigError as exc:
            raise DiffError(f"{where}: {exc}") from None
        self.table = {table: {q: Tolerance(float(t["abs"]), float(t["rel"]), bool(t["ignore"]))
                              for q, t in per_q.items()} for table, per_q in spec.items()}
        # between_run as written: a mapping (an Allowance) or False; absent keys inherit
        self.between = {table: {q: (Allowance(float(t["between_run"].get("abs", 0.0)),
                                              float(t["between_run"].get("rel", 0.0)))
                                    if t["between_run"] is not False else None)
                                for q, t in per_q.items() if "between_run" in t}
                        for table, per_q in spec.items()}

    def _between_run(self, table: str, quantity: str) -> Allowance | None:
        for scope in (self.between.get(table, {}), self.between["default"]):
            if quantity in scope:
                return scope[quantity]
        return BETWEEN_RUN.get(quantity)

    def get(self, table: str, quantity: str) -> Tolerance:
        for scope in (self.table.get(table, {}), self.table["default"]):
            if quantity in scope:
                t = scope[quantity]
                break
        else:
            t = Tolerance()
        return Tolerance(t.abs, t.rel, t.ignore, self._between_run(table, quantity))

    @staticmethod
    def from_sources(cfg: Mapping[str, Any] | None = None, path: Path | None = None) -> Tolerances:
        """From a YAML file (a config with render.tolerances, or a bare tolerances mapping) or a loaded config."""
        if path is not None:
            try:
                raw = read_doc(path, None, "tolerances file", kind="yaml")
            except ContractError as exc:
                raise DiffError(str(exc)) from None
            if isinstance(raw, Mapping) and "render" in raw:
                raw = (raw.get("render") or {}).get("tolerances")
            elif isinstance(raw, Mapping) and "tolerances" in raw:
                raw = raw["tolerances"]
            return Tolerances(raw, f"{path}: tolerances")
        return Tolerances(cfg["render"]["tolerances"] if cfg is not None else None)


# ------------------------------------------------------------------------------------------------- the report


@dataclass
class Move:
    table: str
    cell_id: str
    kind: str  # changed | added | removed | dash
    old: Cell | None
    new: Cell | None
    tolerance: Tolerance | None
    failed: bool
    judged: Welch | None = None  # the statistical test decided
    fallback: str | None = None  # a measured quantity judged by the fixed tolerance: why
    peak: str | None = None  # an argmax cell (PEAKS) judged by its points' CIs: the evidence
    budget: str | None = None  # measured at another budget (judge_budget): the evidence

    @property
    def rule_point(self) -> bool:
        """A cell that appeared or vanished without failing because a rule chose its budget on one host (CHOSEN)."""
        c = self.old or self.new
        return self.kind in ("added", "removed") and not self.failed and c is not None and bool(c.keys.get(CHOSEN))

    def line(self) -> str:
        tag = "FAIL" if self.failed else "ok  "
        chosen = " (a configuration a rule chose on that host: measured only where it chose it)" \
            if self.rule_point else ""
        if self.kind == "added":
            return f"  {tag}  {self.cell_id}: added ({_show(self.new)}){chosen}"
        if self.kind == "removed":
            return f"  {tag}  {self.cell_id}: removed (was {_show(self.old)}){chosen}"
        if self.kind == "dash":
            return f"  {tag}  {self.cell_id}: {_show(self.old)} -> {_show(self.new)} (a value appeared or vanished)"
        assert self.old is not None and self.new is not None and self.tolerance is not None
        o, n = self.old.value, self.new.value
        assert o is not None and n is not None
        rel = f", {100 * (n - o) / abs(o):+.1f}%" if o else ""
        if self.budget is not None:
            return f"  {tag}  {self.cell_id}: {_show(self.old)} -> {_show(self.new)} ({self.budget})"
        if self.peak is not None:
            verdict = "a tie by CI where measured" if not self.failed else "not a tie by CI"
            return f"  {tag}  {self.cell_id}: {_show(self.old)} -> {_show(self.new)} (the sweep's argmax, {verdict}: " \
                   f"{self.peak})"
        if self.judged is not None:
            w = self.judged
            where = "within" if w.passes else "outside"
            return (f"  {tag}  {self.cell_id}: {_with_ci(self.old)} -> {_with_ci(self.new)}: Δ {w.diff:+.4g}{rel} "
                    f"{where} ±{w.allowed:.4g} [{self.old.quantity} by CI: {w.describe()}]")
        why = f"; {self.fallback}: fixed tolerance" if self.fallback else ""
        return (f"  {tag}  {self.cell_id}: {_show(self.old)} -> {_show(self.new)} ({n - o:+.4g}{rel}; "
                f"{self.old.quantity} tolerance {self.tolerance.describe()}{why})")


def _show(c: Cell | None) -> str:
    if c is None or c.value is None:
        return "–"
    v = c.value
    return f"{int(v)}" if c.quantity in ("params", "m_max") else f"{v:.6g}"


def _with_ci(c: Cell) -> str:
    """``value ± half-width (n=N)``: the cell's own 95 % CI as its table prints it, else the t-interval of std."""
    assert c.value is not None and c.n is not None and c.std is not None
    if c.half_width is not None:
        hw = c.half_width
    else:
        from specprefetch.render.cells import t_quantile

        hw = t_quantile(c.n - 1) * c.std / math.sqrt(c.n)
    return f"{c.value:.4g} ± {hw:.2g} (n={c.n})"


@dataclass
class DiffReport:
    old: str
    new: str
    moves: list[Move] = field(default_factory=list)
    tables: dict[str, int] = field(default_factory=dict)
    missing_tables: list[str] = field(default_factory=list)
    new_tables: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    n_judged: int = 0  # cells the statistical test judged (the Bonferroni family), identical ones included
    cell_level: float = FAMILY_LEVEL
    verdicts: list[str] = field(default_factory=list)  # device claims whose verdict differs (comparison.json)
    n_verdicts: int = 0  # device claims decided in both renderings
    strict_verdicts: bool = False  # a differing verdict fails the diff

    @property
    def failed(self) -> bool:
        return bool(self.missing_tables or self.new_tables or any(m.failed for m in self.moves)
                    or (self.strict_verdicts and self.verdicts))

    def render(self) -> str:
        out = [f"diff-tables {self.old} -> {self.new}"]
        out += [f"note: {n}" for n in self.notes]
        if self.n_judged:
            out.append(f"rule: {self.n_judged} measured cell(s) judged by Welch's t on the two means, "
                       f"{FAMILY_LEVEL:.0%} family-wise (Bonferroni: {100 * self.cell_level:.3g} % per cell), "
                       "⊕ a between-run allowance; every other cell by its fixed tolerance")
        for t in self.missing_tables:
            out.append(f"{t}: FAIL missing in NEW")
        for t in self.new_tables:
            out.append(f"{t}: FAIL new table (not in OLD)")
        for t, n in sorted(self.tables.items()):
            ms = [m for m in self.moves if m.table == t]
            bad = sum(m.failed for m in ms)
            if not ms:
                out.append(f"{t}: {n} cells, identical")
                continue
            out.append(f"{t}: {n} cells, {len(ms)} moved, {bad} past tolerance")
            out += [m.line() for m in ms]
        if self.n_verdicts:
            tag = "FAIL" if self.strict_verdicts else "note"
            out.append(f"claims: {self.n_verdicts} device claim(s) in both renderings, {len(self.verdicts)} with "
                       "another verdict" + ("" if self.verdicts else " (every verdict the same)"))
            out += [f"  {tag}  {v}" for v in self.verdicts]
        n_bad = (sum(m.failed for m in self.moves) + len(self.missing_tables) + len(self.new_tables)
                 + (len(self.verdicts) if self.strict_verdicts else 0))
        other = [m for m in self.moves if m.budget is not None or m.rule_point]
        out.append(f"RESULT: {'FAIL' if self.failed else 'OK'} ({n_bad} failure(s), "
                   f"{sum(not m.failed for m in self.moves)} move(s) within tolerance"
                   + (f", {len(other)} of them cells measured at another budget or only where a rule chose it: "
                      "not compared by value" if other else "") + ")")
        return "\n".join(out)


def collect_docs(path: Path | str) -> dict[str, TableDoc]:
    """Table JSONs in a directory (recursively) or one JSON file, by table name."""
    path = Path(path)
    if not path.exists():
        raise DiffError(f"{path}: not found")
    files = [path] if path.is_file() else sorted(path.rglob("*.json"))
    docs: dict[str, TableDoc] = {}
    for f in files:
        if path.is_dir():
            try:
                head = read_doc(f, None, "JSON")
            except ContractError:
                continue
            if not isinstance(head, dict) or head.get("format") != TABLE_FORMAT:
                continue  # comparison.json and other JSON files are not tables
        doc = read_table_doc(f)
        if doc.name in docs:
            raise DiffError(f"{f}: a second table named {doc.name!r} under {path}")
        docs[doc.name] = doc
    if not docs:
        hint = " (it has .tex files: render with `specprefetch render-tables`, which writes the .json twins)" \
            if path.is_dir() and any(path.rglob("*.tex")) else ""
        raise DiffError(f"{path}: no table JSON ({TABLE_FORMAT}) found{hint}")
    return docs


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


# what a table's numbers were measured under (its meta): when these differ, its cells measure something else
SETUP_KEYS = ("platform", "model", "repeats", "m_max", "profiled_m_max", "m_max_per_storage")


def setup_notes(name: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """One line per measurement setting (:data:`SETUP_KEYS`) that differs between two renderings of a table, e.g. a
    budget the window profile chose differently on a faster host: the cells that depend on it measured something
    else, which a failure past tolerance then reflects."""
    out = []
    for key in SETUP_KEYS:
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            moved = ", ".join(f"{k} {a.get(k, '-')} -> {b.get(k, '-')}" for k in sorted(set(a) | set(b), key=str)
                              if a.get(k) != b.get(k))
            what = f"{key} differs ({moved})"
        else:
            what = f"{key} {a if a is not None else '-'} in OLD, {b if b is not None else '-'} in NEW"
        out.append(f"{name}: {what}: its cells were measured under other settings")
    return out


def _pairs(old: Mapping[str, TableDoc], new: Mapping[str, TableDoc]) -> Iterator[tuple[str, str, Cell | None,
                                                                                      Cell | None]]:
    """(table, cell id, OLD cell, NEW cell) of every table in both renderings, OLD's cell order then NEW's."""
    for name in sorted(set(old) & set(new)):
        oc, nc = old[name].by_id(), new[name].by_id()
        for cid in list(oc) + [c for c in nc if c not in oc]:
            yield name, cid, oc.get(cid), nc.get(cid)


def _by_test(tol: Tolerance, a: Cell, b: Cell, names: tuple[str, str]) -> tuple[bool, str | None]:
    """(judged by the statistical test, else why the fixed tolerance) for two cells with finite values; ``names``
    say where each cell is (rendering and table) in the error of a malformed cell."""
    if tol.ignore or tol.between_run is None:
        return False, None
    why = [w for w in (missing_stats(a, "OLD", names[0]), missing_stats(b, "NEW", names[1])) if w]
    return (False, " and ".join(why)) if why else (True, None)


def diff_docs(old: Mapping[str, TableDoc], new: Mapping[str, TableDoc], tol: Tolerances, old_name: str = "OLD",
              new_name: str = "NEW") -> DiffReport:
    rep = DiffReport(old_name, new_name)
    rep.missing_tables = sorted(set(old) - set(new))
    rep.new_tables = sorted(set(new) - set(old))
    for name in sorted(set(old) & set(new)):
        o, n = old[name], new[name]
        if o.profile != n.profile:
            rep.notes.append(f"{name}: profile {o.profile!r} in OLD, {n.profile!r} in NEW")
        rep.notes += setup_notes(name, o.meta, n.meta)
        rep.tables[name] = len(set(o.by_id()) | set(n.by_id()))
    # the Bonferroni family: every cell pair the test judges, identical ones included
    rep.n_judged = sum(_by_test(tol.get(t, a.quantity), a, b, (f"{old_name}: table {t}", f"{new_name}: table {t}"))[0]
                       for t, _, a, b in _pairs(old, new)
                       if a is not None and b is not None and _finite(a.value) and _finite(b.value))
    by_id = {name: (old[name].by_id(), new[name].by_id()) for name in rep.tables}
    peaks = [(t, cid, a, b) for t, cid, a, b in _pairs(old, new) if peak_of(cid) and a is not None and b is not None
             and _finite(a.value) and _finite(b.value) and a.value != b.value and not tol.get(t, a.quantity).ignore
             and tol.get(t, peak_of(cid)[1]).between_run is not None]  # its points are judged by the test
    rep.n_judged += len(peaks)  # each moved argmax is one more test of the family
    rep.cell_level = 1.0 - (1.0 - FAMILY_LEVEL) / max(rep.n_judged, 1)
    for name, cid, a, b in _pairs(old, new):
        # a cell appearing, disappearing or becoming a dash fails, unless its quantity is ignored (e.g. the
        # M_max sweep's points move with the profiled budget on a noisy machine)
        ignored = tol.get(name, (a or b).quantity).ignore
        if a is None or b is None:
            chosen = bool((a or b).keys.get(CHOSEN))  # a configuration a rule chose on one host only
            rep.moves.append(Move(name, cid, "added" if a is None else "removed", a, b, None,
                                  not (ignored or chosen)))
            continue
        if _finite(a.value) != _finite(b.value):
            rep.moves.append(Move(name, cid, "dash", a, b, None, not ignored))
            continue
        if not _finite(a.value) or a.value == b.value:
            continue
        t = tol.get(name, a.quantity)
        assert a.value is not None and b.value is not None
        if (name, cid, a, b) in peaks:
            judged = judge_peak(cid, a, b, *by_id[name], rep.cell_level,
                                (f"{old_name}: table {name}", f"{new_name}: table {name}"))
            if judged is not None:
                rep.moves.append(Move(name, cid, "changed", a, b, t, not judged[0], peak=judged[1]))
                continue
            rep.n_judged -= 1  # compared exactly after all; the level stays as computed (conservative)
        by_test, fallback = _by_test(t, a, b, (f"{old_name}: table {name}", f"{new_name}: table {name}"))
        if by_test:
            assert t.between_run is not None
            w = welch(a, b, rep.cell_level, t.between_run)
            move = Move(name, cid, "changed", a, b, t, not w.passes, judged=w)
        else:
            move = Move(name, cid, "changed", a, b, t, not t.allows(a.value, b.value), fallback=fallback)
        # measured at another budget: a cell within its tolerance passes as any; one past it measured another
        # configuration, and passes when its budget moved by a rerun's step (judge_budget)
        moved = None if t.ignore or not move.failed else judge_budget(a, b, tol.get(name, "m_max").between_run)
        rep.moves.append(move if moved is None else Move(name, cid, "changed", a, b, t, not moved[0],
                                                         budget=moved[1]))
    return rep


def diff_tables(old: Path | str, new: Path | str, tol: Tolerances, strict_verdicts: bool = False) -> DiffReport:
    rep = diff_docs(collect_docs(old), collect_docs(new), tol, str(old), str(new))
    rep.strict_verdicts = strict_verdicts
    verdicts = [claim_verdicts(Path(p)) for p in (old, new)]
    if verdicts[0] is not None and verdicts[1] is not None:
        a, b = verdicts
        shared = [cid for cid in a if cid in b]
        rep.n_verdicts = len(shared)
        rep.verdicts = [f"{cid}: {a[cid].verdict} in OLD, {b[cid].verdict} in NEW ({a[cid].statement})"
                        for cid in shared if a[cid].verdict != b[cid].verdict]
    elif strict_verdicts:
        raise DiffError("--strict-verdicts compares the two renderings' comparison.json; "
                        f"{old if verdicts[0] is None else new} has none")
    return rep


@dataclass(frozen=True)
class RunClaim:
    """A device claim as one rendering's comparison.json has it: its verdict, statement and the CI tests it rests
    on (None: a comparison.json from before they were kept); ``own``: the verdict of the run's own CIs (its
    ``verdict_run`` where it was judged across hours with kept runs, else its verdict)."""

    verdict: str
    statement: str
    tests: tuple[Test, ...] | None = None
    verdict_run: str = ""

    @property
    def own(self) -> str:
        return self.verdict_run or self.verdict


def claim_verdicts(path: Path) -> dict[str, RunClaim] | None:
    """The device claims of a rendering's comparison.json (a directory's, or the directory of a table JSON): id ->
    ``RunClaim``; None without one. Issue 28's test of a rerun: the same verdict for every device claim."""
    comp = (path if path.is_dir() else path.parent) / "comparison.json"
    if not comp.is_file():
        return None
    try:
        doc = read_doc(comp, None, "comparison JSON", required=("claims",))
    except ContractError as exc:
        raise DiffError(str(exc)) from None
    out = {}
    for c in doc["claims"]:
        if isinstance(c, dict) and c.get("device") and "id" in c:
            tests = None
            if isinstance(c.get("tests"), list):
                try:
                    tests = tuple(Test.from_json(t) for t in c["tests"])
                except (ValueError, AttributeError) as exc:
                    raise DiffError(f"{comp}: claim {c['id']!r}: tests: {exc}") from None
            out[str(c["id"])] = RunClaim(str(c.get("verdict_reproduced")), str(c.get("statement", "")), tests,
                                         str(c.get("verdict_run", "")))
    return out


def pool_runs(per_run: Sequence[Sequence[Test]]) -> tuple[Verdict, str] | None:
    """A claim's verdict over several runs (fresh DAGs at other hours), each run one value of its effect: per test
    (matched by key), the mean of the runs' means and its 95 % t-interval (``k - 1`` degrees of freedom, the runs'
    spread as the yardstick: the host's hour is the random unit, a run's own CI is inside that spread), decided as
    the run's test is (``Test.decide``) and combined over the claim's tests. None when the runs' tests do not match
    (other keys or rules): the claim is then judged by the verdicts alone."""
    if len(per_run) < 2 or not all(per_run):
        return None
    first = {t.key: t for t in per_run[0]}
    for tests in per_run:
        own = {t.key: t for t in tests}
        if own.keys() != first.keys() or not all(first[k].same_effect(t) for k, t in own.items()):
            return None
    k = len(per_run)
    tq = t_ppf(0.975, k - 1)
    decisions, texts = [], []
    for key, template in first.items():
        means = [next(t.ci.mean for t in tests if t.key == key) for tests in per_run]
        mean = sum(means) / k
        sd = math.sqrt(sum((m - mean) ** 2 for m in means) / (k - 1))
        half = tq * sd / math.sqrt(k)
        ci = CI(mean, mean - half, mean + half, k)
        decisions.append(template.decide(ci))
        texts.append((f"{key}: " if len(first) > 1 else "") + f"{mean:+.3g} [{ci.lo:+.3g}, {ci.hi:+.3g}]")
    verdict, _ = combine(decisions)
    return verdict, "; ".join(texts)


@dataclass
class AcrossRuns:
    """Every device claim's verdict in each of several renderings of the same DAG (fresh runs at other hours) and the
    verdict they support together: the shared one where every run decides it alike (it holds, or fails, at every
    hour measured), else the runs pooled (``pool_runs``: each run's effect one value, its mean's t-interval over the
    runs), else (runs whose comparison.json keep no tests) unresolved. The project's rule for a device verdict: it
    counts when another fresh run gives the same one. Each run's verdict is its own CIs' (``RunClaim.own``);
    ``across_hours`` judges each run as a new run would be with the others as its kept runs (leave one out)."""

    runs: list[str]
    rows: list[tuple[str, str, list[RunClaim | None]]]  # (claim id, statement, the claim per run; None: not in it)

    @staticmethod
    def combined(claims: Sequence[RunClaim | None]) -> tuple[str, str]:
        """The verdict over the runs and the pooled effect's text ("" when the runs cannot be pooled)."""
        given = [c for c in claims if c is not None]
        complete = bool(given) and len(given) == len(claims)
        pooled = pool_runs([c.tests or () for c in given]) if complete else None
        text = pooled[1] if pooled else ""
        shared = {c.own for c in given}
        if complete and len(shared) == 1 and shared & {Verdict.HOLDS.value, Verdict.FAILS.value}:
            return given[0].own, text
        return (pooled[0].value if pooled else Verdict.UNRESOLVED.value), text

    @property
    def disagreeing(self) -> list[str]:
        """Claims two runs give different verdicts."""
        return [cid for cid, _, cs in self.rows if len({c.own for c in cs if c is not None}) > 1]

    @staticmethod
    def across_hours(claims: Sequence[RunClaim | None]) -> list[str | None]:
        """Each run's verdict judged across hours as a new run is with the others as its kept runs
        (``judge_across_runs``: its CIs widened by the spread between all the runs). A run without tests keeps its
        own verdict; None where the run does not have the claim."""
        runs = [c.tests or () for c in claims if c is not None]
        return [None if c is None else judge_across_runs(c.tests, runs)[0].value if c.tests else c.own
                for c in claims]

    @property
    def partial(self) -> list[str]:
        """Claims some run does not have (a claim added since): unresolved together, but not a disagreement."""
        return [cid for cid, _, cs in self.rows if None in cs and cid not in self.disagreeing]

    def render(self) -> str:
        k = len(self.runs)
        head = ["claim", *[f"run {i + 1}" for i in range(k)], "across runs", "pooled effect [95 % t-interval]"]
        out = [*(f"run {i + 1}: {r}" for i, r in enumerate(self.runs)), "",
               "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        tally: dict[str, int] = {}
        for cid, statement, cs in self.rows:
            both, pooled = self.combined(cs)
            tally[both] = tally.get(both, 0) + 1
            mark = (" (runs disagree)" if cid in self.disagreeing else " (not in every run)" if None in cs else "")
            out.append(f"| `{cid}` {statement} | " + " | ".join(c.verdict if c else "–" for c in cs)
                       + f" | **{both}**{mark} | {pooled or '–'} |")
        n = len(self.rows)
        same = n - len(self.disagreeing) - len(self.partial)
        out += ["", f"{same} of {n} device claims give the same verdict in all {k} runs"
                + (f"; {len(self.disagreeing)} differ: {', '.join(self.disagreeing)}" if self.disagreeing else "")
                + (f"; {len(self.partial)} not in every run: {', '.join(self.partial)}" if self.partial else "")
                + _contradictions([[c.own if c else None for c in cs] for _, _, cs in self.rows], self.rows),
                "Across runs: " + ", ".join(f"{tally[v]} {v}" for v in ("holds", "fails", "unresolved") if v in tally)
                + f" (the verdict every run decides alike; else, where the runs keep their tests, the runs pooled: "
                  f"each run's effect one value, its mean's 95 % t-interval over the {k} runs; else unresolved)"]
        out += ["", f"Each run judged across hours, as a new run with the other {k - 1} as its kept runs "
                f"(`render.kept_runs`): its CIs widened by the spread between the {k} runs", "",
                "| claim | " + " | ".join(f"run {i + 1}" for i in range(k)) + " |", "|" + "---|" * (k + 1)]
        hours = [self.across_hours(cs) for _, _, cs in self.rows]
        differ = [cid for (cid, _, _), vs in zip(self.rows, hours, strict=True) if len({v for v in vs if v}) > 1]
        out += [f"| `{cid}` | " + " | ".join(v or "–" for v in vs) + " |"
                for (cid, _, _), vs in zip(self.rows, hours, strict=True)]
        out += ["", f"{n - len(differ)} of {n} device claims give the same verdict in all {k} runs judged across hours"
                + (f"; {len(differ)} differ: {', '.join(differ)}" if differ else "")
                + _contradictions(hours, self.rows)]
        return "\n".join(out)


def _contradictions(verdicts: Sequence[Sequence[str | None]], rows: Sequence[tuple[str, str, Any]]) -> str:
    """"; N contradict (one run holds, another fails): ids", or that none does."""
    ids = [cid for (cid, _, _), vs in zip(rows, verdicts, strict=True)
           if {Verdict.HOLDS.value, Verdict.FAILS.value} <= set(vs)]
    return (f"; {len(ids)} contradict (one run holds, another fails): {', '.join(ids)}" if ids
            else "; none contradicts (one run holds, another fails)")


def verdicts_across_runs(paths: Sequence[Path | str]) -> AcrossRuns:
    """The device claims of two or more renderings' comparison.json, in the first rendering's order (claims only a
    later one has follow). A rendering without comparison.json is an error naming it."""
    if len(paths) < 2:
        raise DiffError(f"compare-verdicts needs two or more renderings, got {len(paths)}")
    per_run = []
    for p in map(Path, paths):
        v = claim_verdicts(p)
        if v is None:
            raise DiffError(f"{p}: no comparison.json (render it with `snakemake paper_tables`)")
        per_run.append(v)
    ids = list(dict.fromkeys(cid for v in per_run for cid in v))
    rows = [(cid, next(v[cid].statement for v in per_run if cid in v), [v.get(cid) for v in per_run]) for cid in ids]
    return AcrossRuns([str(p) for p in paths], rows)

