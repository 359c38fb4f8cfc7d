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
get max(3 pp, 15 %) (they move with the host's compute-to-transfer ratio, far less than with its speed). A cell of
such a quantity without ``n`` >= 2 and ``std`` on both sides (one repeat, an older JSON) falls back to the fixed
tolerance below and its line says so. Everything else (recall, deterministic given the seeds; parameter counts;
budgets chosen by a rule) is compared with the fixed tolerances. Both come from ``render.tolerances``::

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specprefetch.contracts import ContractError, read_doc
from specprefetch.io import SpecPrefetchError
from specprefetch.render.cells import TABLE_FORMAT, Cell, TableDoc, read_table_doc

log = logging.getLogger(__name__)

class DiffError(SpecPrefetchError):
    """Inputs of diff-tables are unusable (no table JSON, malformed tolerances)."""


@dataclass(frozen=True)
class Tolerance:
    abs: float = 0.0
    rel: float = 0.0
    ignore: bool = False

    def allows(self, old: float, new: float) -> bool:
        d = abs(new - old)
        return self.ignore or d <= self.abs + 1e-12 or d <= self.rel * abs(old) + 1e-12

    def describe(self) -> str:
        if self.ignore:
            return "ignored"
        parts = ([f"±{self.abs:g} abs"] if self.abs else []) + ([f"±{self.rel:.0%} rel"] if self.rel else [])
        return " or ".join(parts) or "exact"


class Tolerances:
    """Resolve the tolerance of (table, quantity): the table's own entry, else ``default``'s.

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

    def get(self, table: str, quantity: str) -> Tolerance:
        for scope in (self.table.get(table, {}), self.table["default"]):
            if quantity in scope:
                return scope[quantity]
        return Tolerance()

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


@dataclass
class Move:
    table: str
    cell_id: str
    kind: str  # changed | added | removed | dash
    old: Cell | None
    new: Cell | None
    tolerance: Tolerance | None
    failed: bool

    def line(self) -> str:
        tag = "FAIL" if self.failed else "ok  "
        if self.kind == "added":
            return f"  {tag}  {self.cell_id}: added ({_show(self.new)})"
        if self.kind == "removed":
            return f"  {tag}  {self.cell_id}: removed (was {_show(self.old)})"
        if self.kind == "dash":
            return f"  {tag}  {self.cell_id}: {_show(self.old)} -> {_show(self.new)} (a value appeared or vanished)"
        assert self.old is not None and self.new is not None and self.tolerance is not None
        o, n = self.old.value, self.new.value
        assert o is not None and n is not None
        rel = f", {100 * (n - o) / abs(o):+.1f}%" if o else ""
        return (f"  {tag}  {self.cell_id}: {_show(self.old)} -> {_show(self.new)} ({n - o:+.4g}{rel}; "
                f"{self.old.quantity} tolerance {self.tolerance.describe()})")


def _show(c: Cell | None) -> str:
    if c is None or c.value is None:
        return "–"
    v = c.value
    return f"{int(v)}" if c.quantity in ("params", "m_max") else f"{v:.6g}"


@dataclass
class DiffReport:
    old: str
    new: str
    moves: list[Move] = field(default_factory=list)
    tables: dict[str, int] = field(default_factory=dict)
    missing_tables: list[str] = field(default_factory=list)
    new_tables: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.missing_tables or self.new_tables or any(m.failed for m in self.moves))

    def render(self) -> str:
        out = [f"diff-tables {self.old} -> {self.new}"]
        out += [f"note: {n}" for n in self.notes]
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
        n_bad = sum(m.failed for m in self.moves) + len(self.missing_tables) + len(self.new_tables)
        out.append(f"RESULT: {'FAIL' if self.failed else 'OK'} ({n_bad} failure(s), "
                   f"{sum(not m.failed for m in self.moves)} move(s) within tolerance)")
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
        oc, nc = o.by_id(), n.by_id()
        rep.tables[name] = len(set(oc) | set(nc))
        for cid in list(oc) + [c for c in nc if c not in oc]:
            a, b = oc.get(cid), nc.get(cid)
            # a cell appearing, disappearing or becoming a dash fails, unless its quantity is ignored (e.g. the
            # M_max sweep's points move with the profiled budget on a noisy machine)
            ignored = tol.get(name, (a or b).quantity).ignore
            if a is None or b is None:
                rep.moves.append(Move(name, cid, "added" if a is None else "removed", a, b, None, not ignored))
                continue
            if _finite(a.value) != _finite(b.value):
                rep.moves.append(Move(name, cid, "dash", a, b, None, not ignored))
                continue
            if not _finite(a.value) or a.value == b.value:
                continue
            t = tol.get(name, a.quantity)
            assert a.value is not None and b.value is not None
            rep.moves.append(Move(name, cid, "changed", a, b, t, not t.allows(a.value, b.value)))
    return rep


def diff_tables(old: Path | str, new: Path | str, tol: Tolerances) -> DiffReport:
    return diff_docs(collect_docs(old), collect_docs(new), tol, str(old), str(new))
