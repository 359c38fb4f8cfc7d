"""The machine-readable side of every rendered table: one record per cell, written next to the .tex.

The .tex is for people; the JSON is what ``diff-tables`` and the comparison with the paper read, so nobody parses
LaTeX. A cell carries its identity (``id`` plus ``keys`` in display names, so a reproduced cell and the paper's
reported cell meet on the same keys), its value in display units (percent, tok/s, parameter count), the ± spread
when there is one, the quantity (which selects its diff tolerance), and the exact text printed in the table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specprefetch.contracts import TABLE_FORMAT, read_doc, require
from specprefetch.io import SpecPrefetchError, write_json_atomic
from specprefetch.metrics import CI

QUANTITIES = ("recall", "params", "throughput", "gain", "ready_recall", "latency_ms", "window_ms", "demand_ms",
              "exceed_pct", "share_pct", "m_max", "cosine", "entropy")  # cosine, entropy: table0_realism


@dataclass(frozen=True)
class Cell:
    """One number of a table or figure. ``value`` is None where the table prints a dash (not measured).

    Device cells (values over repeats) also carry ``std`` (sample std, ddof=1), ``n`` (repeats), ``lo``/``hi`` (the
    95 % CI of the mean, paired bootstrap over repeats: ``render.data.bootstrap_ci``), ``spread`` ([min, max] over
    repeats) and ``repeats`` (the per-repeat values, keyed by the repeat number as a string), so the comparison
    with the paper can settle a claim by its CI and pair two cells repeat by repeat. A learned predictor's recall
    cell trained with several seeds carries the same fields over seeds (``repeats`` keyed by the seed index,
    ``lo``/``hi`` the t-interval of :func:`seed_ci`). The four CI fields are left out of the JSON when None
    (single-seed recall, training-free methods, parameter cells), and a cell without them reads as before.
    """

    id: str
    quantity: str
    value: float | None
    keys: dict[str, Any] = field(default_factory=dict)
    std: float | None = None
    n: int | None = None
    text: str = ""
    lo: float | None = None
    hi: float | None = None
    spread: tuple[float, float] | None = None
    repeats: dict[str, float] | None = None

    @property
    def has_ci(self) -> bool:
        return self.lo is not None and self.hi is not None and self.value is not None

    @property
    def half_width(self) -> float | None:
        return None if self.lo is None or self.hi is None else (self.hi - self.lo) / 2.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("value", "std", "lo", "hi"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = None
        if d["spread"] is not None:
            d["spread"] = [None if not math.isfinite(v) else v for v in d["spread"]]
        for k in OPTIONAL_FIELDS:
            if d[k] is None:
                del d[k]
        return d

    @staticmethod
    def from_json(d: dict[str, Any], where: str) -> Cell:
        def num(k: str) -> float | None:
            return None if d.get(k) is None else float(d[k])

        try:
            spread = d.get("spread")
            reps = d.get("repeats")
            return Cell(id=str(d["id"]), quantity=str(d["quantity"]), value=num("value"),
                        keys=dict(d.get("keys") or {}), std=num("std"),
                        n=None if d.get("n") is None else int(d["n"]), text=str(d.get("text", "")),
                        lo=num("lo"), hi=num("hi"),
                        spread=None if spread is None else (float(spread[0]), float(spread[1])),
                        repeats=None if reps is None else {str(k): float(v) for k, v in dict(reps).items()})
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise SpecPrefetchError(f"{where}: malformed cell {d!r}: {exc}") from None


OPTIONAL_FIELDS = ("lo", "hi", "spread", "repeats")  # left out of a cell's JSON when None

# The key of a cell measured only because a rule chose its budget on this host (a sweep point off the configured
# grid, a budget rule's row where its budgets differ from the paper rule's): on another hour the rule may choose
# another budget, and the cell is then absent. ``diff-tables`` reports such a cell appearing or vanishing without
# failing; the move of the budget itself is judged on the cells both renderings have.
CHOSEN = "chosen"


@dataclass
class TableDoc:
    """A rendered table's cells plus what produced them (profile, models, platform) for reports and diffs."""

    name: str
    title: str
    profile: str
    cells: list[Cell]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        ids = [c.id for c in self.cells]
        if len(ids) != len(set(ids)):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise SpecPrefetchError(f"table {self.name}: duplicate cell ids {dup[:3]}")
        return {"format": TABLE_FORMAT, "name": self.name, "title": self.title, "profile": self.profile,
                "meta": self.meta, "cells": [c.to_json() for c in self.cells]}

    def write(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_json())

    def by_id(self) -> dict[str, Cell]:
        return {c.id: c for c in self.cells}


def read_table_doc(path: str | Path) -> TableDoc:
    """Read a table JSON written by ``TableDoc.write``; anything else is an error naming the file."""
    path = Path(path)
    d = read_doc(path, TABLE_FORMAT, "table JSON", required=("name",))
    cells = d.get("cells", [])
    if not isinstance(cells, list):
        raise SpecPrefetchError(f"{path}: 'cells' must be a list")
    return TableDoc(name=str(require(d, "name", str, str(path))), title=d.get("title", ""),
                    profile=d.get("profile", ""), cells=[Cell.from_json(c, str(path)) for c in cells],
                    meta=d.get("meta", {}))


# --------------------------------------------------------------------------------------------- seeds

# Two-sided 95 % Student-t quantiles t_{0.975, df} for df = 1..30 (standard tables); above 30 the Cornish-Fisher
# expansion around the normal quantile (error < 1e-3).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile(df: int) -> float:
    """t_{0.975, df}: the multiplier of the standard error in a 95 % t-interval."""
    if df < 1:
        raise ValueError(f"t_quantile: df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def seed_ci(values: Sequence[float]) -> CI:
    """95 % t-interval of the mean of per-seed values (or of paired per-seed differences).

    Why a t-interval and not the bootstrap the device cells use: seeds are few (3 on the embedded default) and a
    percentile bootstrap of 3 values can only return means of resampled triples, an interval no wider than the
    values' range that covers the mean far less than 95 % of the time; the t-interval (t_{0.975, 2} = 4.30 for 3
    seeds) is the standard small-sample interval, wide when seeds are few, as it should be. One value: (v, v),
    not ``decidable``."""
    arr = [float(v) for v in values]
    if not arr or not all(math.isfinite(v) for v in arr):
        raise ValueError(f"seed_ci: need finite values, got {arr!r}")
    n = len(arr)
    mean = sum(arr) / n
    if n == 1:
        return CI(mean, mean, mean, 1)
    sd = math.sqrt(sum((v - mean) ** 2 for v in arr) / (n - 1))
    hw = t_quantile(n - 1) * sd / math.sqrt(n)
    return CI(mean, mean - hw, mean + hw, n)


def seed_fields(per_seed: Mapping[int, float]) -> dict[str, Any]:
    """A recall cell's value over seeds: ``value`` the mean; with two or more seeds also ``std``, ``n``,
    ``lo``/``hi`` (:func:`seed_ci`), ``spread`` and ``repeats`` (per-seed values keyed by the seed index)."""
    vals = [per_seed[k] for k in sorted(per_seed)]
    ci = seed_ci(vals)
    if ci.n == 1:
        return {"value": ci.mean}
    std = math.sqrt(sum((v - ci.mean) ** 2 for v in vals) / (ci.n - 1))
    return {"value": ci.mean, "std": std, "n": ci.n, "lo": ci.lo, "hi": ci.hi, "spread": (min(vals), max(vals)),
            "repeats": {str(k): per_seed[k] for k in sorted(per_seed)}}


# --------------------------------------------------------------------------------------------- number formatting


def fmt_fixed(value: float | None, decimals: int, sign: bool = False) -> str:
    """Fixed decimals; None/NaN prints the paper's en dash; -0.00 prints as 0.00."""
    if value is None or not math.isfinite(value):
        return "–"
    text = f"{value:+.{decimals}f}" if sign else f"{value:.{decimals}f}"
    if float(text) == 0.0:
        text = ("+" if sign else "") + f"{0.0:.{decimals}f}"
    return text


def fmt_params(n: float | None) -> str:
    """Trainable parameters the paper's way ("0.82M", "207.23M"), with K for the tiny stand-ins ("28.67K",
    "231.17K"), so small counts keep their digits instead of collapsing to "0.23M"."""
    if n is None or not math.isfinite(n):
        return "–"
    n = float(n)
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f}B"
    if abs(n) >= 5e5:  # the paper prints 0.78M for 780K; below 0.5M, K keeps 5 significant digits
        return f"{n / 1e6:.2f}M"
    if abs(n) >= 1e3:
        return f"{n / 1e3:.2f}K"
    return f"{int(round(n))}"


def throughput_decimals(value: float) -> int:
    """3 decimals like the paper's 3.753 tok/s; fewer for the CPU stand-ins' larger rates (same 4 significant)."""
    a = abs(value)
    return 3 if a < 10 else 2 if a < 100 else 1


def latex_escape(text: str) -> str:
    """Escape LaTeX specials in names coming from config (display names, platforms); math is added by templates."""
    repl = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
            "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "–": "--",
            "≈": r"$\approx$", "→": r"$\to$", "†": r"$^\dagger$", "×": r"$\times$", "·": r"$\cdot$",
            "≤": r"$\le$", "≥": r"$\ge$", "Δ": r"$\Delta$", "<": r"$<$", ">": r"$>$", "|": r"$|$"}
    return "".join(repl.get(ch, ch) for ch in str(text))


def tex_cell(text: str) -> str:
    """A cell's plain text (as stored in the JSON) made safe for LaTeX: the en dash becomes --."""
    return "--" if text == "–" else text


def best_mask(values: Sequence[float | None], decimals: int, higher_is_better: bool = True) -> list[bool]:
    """Which entries are best at the printed precision (ties are all bold, as in the paper's tied-best)."""
    rounded = [None if v is None or not math.isfinite(v) else round(v, decimals) for v in values]
    present = [r for r in rounded if r is not None]
    if not present:
        return [False] * len(values)
    best = max(present) if higher_is_better else min(present)
    return [r is not None and r == best for r in rounded]


def bold(text: str, on: bool) -> str:
    """Bold a cell; ``\\boldmath`` makes the math of a ``$m\\pm s$`` cell bold too (as the paper's Table 5)."""
    if not on:
        return text
    return rf"\textbf{{\boldmath {text}}}" if "$" in text else rf"\textbf{{{text}}}"


def pm_ci(mean: float | None, lo: float | None, hi: float | None, decimals: int, sign: bool = False,
          math_mode: bool = True) -> str:
    """``mean ± CI half-width`` ((hi - lo) / 2 of the bootstrap CI), printed like ``pm``."""
    hw = None if lo is None or hi is None else (hi - lo) / 2.0
    return pm(mean, hw, decimals, sign, math_mode)


def pm(mean: float | None, std: float | None, decimals: int, sign: bool = False, math_mode: bool = True) -> str:
    """``mean ± std`` as the paper prints it ($3.753\\pm 0.164$); a dash when there is no value."""
    if mean is None or not math.isfinite(mean):
        return "–"
    m = fmt_fixed(mean, decimals, sign)
    if std is None or not math.isfinite(std):
        return f"${m}$" if math_mode else m
    s = fmt_fixed(std, decimals)
    return f"${m}\\pm {s}$" if math_mode else f"{m} ± {s}"


