"""The paper's reported numbers (config/reference/paper_reported.yaml) as the same cells the renderer writes.

The YAML is laid out like the paper's tables so it can be checked against the paper by eye; ``load_reported``
flattens it into ``TableDoc``s whose cells carry the same ``keys`` (display names and budget expressions such as
"K/2") as the reproduced tables, so reproduced and reported cells meet on ``MATCH_KEYS`` even when the stand-ins'
budgets differ (the smoke profile's K is not the paper's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specprefetch.config import REPO_ROOT
from specprefetch.contracts import ContractError, read_doc
from specprefetch.io import SpecPrefetchError, write_text_atomic
from specprefetch.render.cells import Cell, TableDoc, fmt_fixed, fmt_params

REPORTED_FORMAT = "specprefetch-reported/1"
DEFAULT_REPORTED = REPO_ROOT / "config" / "reference" / "paper_reported.yaml"
MATCH_KEYS: dict[str, tuple[str, ...]] = {
    "table1_recall": ("model", "workload", "method", "budget"),
    "table2_ablation": ("model", "workload", "method", "budget"),
    "table3_params": ("model", "method"),
    "table4_overhead": ("policy", "column"),
    "table5_matched": ("policy", "column"),
}
TABLE_DECIMALS = {"recall": 2, "throughput": 3, "gain": 2, "ready_recall": 1}


class ReportedError(SpecPrefetchError):
    """The reported-numbers YAML is malformed; the message names the table and cell."""


@dataclass(frozen=True)
class InText:
    """A number stated in the paper's text or a figure caption, with the verbatim quote it comes from."""

    id: str
    value: float
    unit: str
    quote: str
    section: str = ""
    of: int | None = None
    approx: bool = False


@dataclass
class Reported:
    """Everything in paper_reported.yaml: one TableDoc per table plus the in-text numbers."""

    tables: dict[str, TableDoc]
    in_text: dict[str, InText]
    raw: dict[str, Any] = field(default_factory=dict)


def match_key(table: str, cell: Cell) -> tuple[Any, ...]:
    return tuple(cell.keys.get(k) for k in MATCH_KEYS[table])


def _check_keys(mapping: Any, where: str) -> None:
    """Every key must be a string: YAML 1.1 turns bare OFF/ON/YES/NO into booleans, which would silently rename a
    row of Table 4."""
    if not isinstance(mapping, Mapping):
        raise ReportedError(f"{where}: expected a mapping, got {mapping!r}")
    for k, v in mapping.items():
        if not isinstance(k, str):
            raise ReportedError(f"{where}: key {k!r} is not a string (quote names like \"OFF\" in YAML)")
        if isinstance(v, Mapping):
            _check_keys(v, f"{where}.{k}")


def _num(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReportedError(f"{where}: {value!r} is not a number")
    return float(value)


def _mean_std(value: Any, where: str) -> tuple[float | None, float | None]:
    if value is None:
        return None, None
    if not isinstance(value, Mapping) or "mean" not in value:
        raise ReportedError(f"{where}: expected {{mean: .., std: ..}} or null, got {value!r}")
    return _num(value["mean"], where + ".mean"), _num(value.get("std"), where + ".std")


def _recall_table(name: str, spec: Mapping[str, Any], where: str) -> list[Cell]:
    cells = []
    columns = spec.get("columns") or {}
    for model, benches in (spec.get("values") or {}).items():
        if model not in columns:
            raise ReportedError(f"{where}.columns: no column map for model {model!r}")
        for bench, methods in benches.items():
            for method, row in methods.items():
                for col, v in row.items():
                    if col not in columns[model]:
                        raise ReportedError(f"{where}.values.{model}.{bench}.{method}: unknown column {col!r} "
                                            f"(columns: {', '.join(columns[model])})")
                    value = _num(v, f"{where}.values.{model}.{bench}.{method}.{col}")
                    m = int(col.split("@")[1])
                    cells.append(Cell(id=f"{model}/{bench}/{method}/{col}", quantity="recall", value=value,
                                      keys={"model": model, "workload": bench, "method": method,
                                            "budget": str(columns[model][col]), "M": m},
                                      text=fmt_fixed(value, 2)))
    return cells


def _params_table(spec: Mapping[str, Any], where: str) -> list[Cell]:
    scale = float(spec.get("scale", 1.0))
    cells = []
    for model, methods in (spec.get("values") or {}).items():
        for method, v in methods.items():
            value = _num(v, f"{where}.values.{model}.{method}")
            cells.append(Cell(id=f"{model}/{method}", quantity="params",
                              value=None if value is None else round(value * scale),
                              keys={"model": model, "method": method},
                              text=fmt_params(None if value is None else value * scale)))
    return cells


def _device_table(spec: Mapping[str, Any], where: str) -> list[Cell]:
    quantities = spec.get("quantities") or {}
    cells = []
    for policy, cols in (spec.get("values") or {}).items():
        for col, v in cols.items():
            if col not in quantities:
                raise ReportedError(f"{where}.values.{policy}: unknown column {col!r} (quantities lists "
                                    f"{', '.join(quantities)})")
            mean, std = _mean_std(v, f"{where}.values.{policy}.{col}")
            q = quantities[col]
            dec = TABLE_DECIMALS.get(q, 2)
            sign = q == "gain"
            text = "–" if mean is None else (fmt_fixed(mean, dec, sign) + ("" if std is None else
                                                                         f" ± {fmt_fixed(std, dec)}"))
            keys = {"policy": policy, "column": col}
            if "storages" in spec and col in spec["storages"]:
                keys["storage"] = spec["storages"][col]
            cells.append(Cell(id=f"{policy}/{col}", quantity=q, value=mean, std=std, keys=keys, text=text))
    return cells


def parse_reported(raw: Mapping[str, Any], where: str = "paper_reported.yaml") -> Reported:
    """Turn the YAML mapping into cells; every malformed entry is an error naming its path in the file."""
    if not isinstance(raw, Mapping) or raw.get("format") != REPORTED_FORMAT:
        raise ReportedError(f"{where}: not a reported-numbers file (format must be {REPORTED_FORMAT!r})")
    _check_keys(raw.get("tables") or {}, f"{where}: tables")
    tables: dict[str, TableDoc] = {}
    for name, spec in (raw.get("tables") or {}).items():
        w = f"{where}: tables.{name}"
        if name not in MATCH_KEYS:
            raise ReportedError(f"{w}: unknown table (known: {', '.join(MATCH_KEYS)})")
        if name in ("table1_recall", "table2_ablation"):
            cells = _recall_table(name, spec, w)
        elif name == "table3_params":
            cells = _params_table(spec, w)
        else:
            cells = _device_table(spec, w)
        meta = {k: v for k, v in spec.items() if k != "values"}
        tables[name] = TableDoc(name, str(spec.get("title", name)), "paper (reported)", cells, meta=meta)
    in_text: dict[str, InText] = {}
    for i, e in enumerate(raw.get("in_text") or []):
        w = f"{where}: in_text[{i}]"
        try:
            item = InText(id=str(e["id"]), value=float(e["value"]), unit=str(e.get("unit", "")),
                          quote=str(e["quote"]), section=str(e.get("section", "")),
                          of=None if e.get("of") is None else int(e["of"]), approx=bool(e.get("approx", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportedError(f"{w}: malformed entry {e!r}: {exc}") from None
        if item.id in in_text:
            raise ReportedError(f"{w}: duplicate id {item.id!r}")
        in_text[item.id] = item
    return Reported(tables, in_text, dict(raw))


def load_reported(path: str | Path | None = None) -> Reported:
    path = Path(path or DEFAULT_REPORTED)
    try:
        raw = read_doc(path, None, "reported-numbers file", kind="yaml")
    except ContractError as exc:
        raise ReportedError(str(exc)) from None
    return parse_reported(raw, str(path))


def dump_reported(rep: Reported, path: str | Path) -> None:
    """Write the YAML back (used to prove the file round-trips: load -> dump -> load gives the same cells)."""
    write_text_atomic(path, yaml.safe_dump(rep.raw, sort_keys=False, allow_unicode=True, width=120))
