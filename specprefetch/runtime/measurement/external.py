"""External device logs (results measured elsewhere: a phone, another runtime) and the merge into runs.csv.

Schema of an external log (``.csv`` with a header line, or ``.jsonl`` with one JSON object per line), one row
per measured run, same meaning as ``runs.csv``:

=============  ========  ==========================================================================
column         required  value
=============  ========  ==========================================================================
platform       yes       label of the device, ``[A-Za-z0-9._-]+`` (e.g. ``snapdragon_8_elite``)
model          yes       model name (e.g. ``tiny-deepseek-vl2`` or ``deepseek-vl2-tiny``)
experiment     yes       main, matched, sweep, storage or component
policy         yes       off, pred0, specprefetch, naive, fate or resident
storage        yes       nvme_cold, nvme, ufs, slow_ufs, sdcard or ram
m_max          yes       integer >= 0 (0 for off/resident)
compute_opt    yes       true/false (also 1/0, yes/no)
repeat         yes       integer >= 0; rows of one experiment with the same repeat ran back to back
tokens_per_s   yes       decoding throughput, > 0
ready_recall   no        fraction in [0, 1] (not a percentage)
n_tokens, hits, misses, prefetched, wasted   no   integers >= 0
stall_ms       no        >= 0
device, notes  no        free text
=============  ========  ==========================================================================

Empty optional cells are allowed. Anything else (an unknown column, a bad value, a duplicate run) rejects the
file with its name and line number. Merged rows get ``source = external:<file name>``.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from specprefetch.contracts import (
    EXPERIMENTS,
    POLICIES,
    RUN_COLUMNS,
    RUN_KEY_COLUMNS,
    STORAGES,
    check_label,
    csv_rows,
    read_jsonl,
    reraise_as,
)
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.measurement.bench import run_budget_rule, run_lookahead, write_runs_csv

REQUIRED = ("platform", "model", "experiment", "policy", "storage", "m_max", "compute_opt", "repeat", "tokens_per_s")
OPTIONAL_INT = ("n_tokens", "hits", "misses", "prefetched", "wasted")
OPTIONAL_FLOAT = ("ready_recall", "stall_ms")
FREE_TEXT = ("device", "notes")
TEXT = ("platform", "model", "experiment", "policy", "storage", *FREE_TEXT)  # must be strings in a JSONL log
ALLOWED = set(REQUIRED) | set(OPTIONAL_INT) | set(OPTIONAL_FLOAT) | set(FREE_TEXT)
RUN_KEY = ("platform", "model", "experiment", "policy", "storage", "m_max", "compute_opt", "repeat")
_PLATFORM = re.compile(r"^[A-Za-z0-9._-]+$")


class ExternalLogError(SpecPrefetchError):
    """A malformed external device log; the message is ``file:line: what``."""


def _int(v: Any, col: str, where: str, minimum: int = 0) -> int:
    try:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError
        out = int(str(v).strip())
    except (TypeError, ValueError):
        raise ExternalLogError(f"{where}: column {col!r}: {v!r} is not an integer") from None
    if out < minimum:
        raise ExternalLogError(f"{where}: column {col!r}: {out} < {minimum}")
    return out


def _float(v: Any, col: str, where: str) -> float:
    try:
        out = float(str(v).strip()) if not isinstance(v, (int, float)) or isinstance(v, bool) else float(v)
        if isinstance(v, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise ExternalLogError(f"{where}: column {col!r}: {v!r} is not a number") from None
    if not math.isfinite(out):
        raise ExternalLogError(f"{where}: column {col!r}: {v!r} is not finite")
    return out


def _bool(v: Any, col: str, where: str) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    raise ExternalLogError(f"{where}: column {col!r}: {v!r} is not a boolean (true/false)")


def _choice(v: Any, col: str, where: str, allowed: Sequence[str]) -> str:
    s = str(v).strip()
    if s not in allowed:
        raise ExternalLogError(f"{where}: column {col!r}: {v!r} is not one of {', '.join(allowed)}")
    return s


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip())


def validate_row(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """One external row -> a runs.csv row (raises ExternalLogError naming ``where`` = file:line)."""
    unknown = sorted(set(raw) - ALLOWED)
    if unknown:
        raise ExternalLogError(f"{where}: unknown column {unknown[0]!r} (allowed: {', '.join(sorted(ALLOWED))})")
    for col in REQUIRED:
        if col not in raw or _empty(raw[col]):
            raise ExternalLogError(f"{where}: required column {col!r} is missing or empty")
    for col, v in raw.items():
        if isinstance(v, (dict, list)) or (col in TEXT and not _empty(v) and not isinstance(v, str)):
            raise ExternalLogError(f"{where}: column {col!r}: {type(v).__name__} {v!r:.40}, expected "
                                   f"{'text' if col in TEXT else 'a number or boolean'}")
    with reraise_as(ExternalLogError):  # names reach runs.csv and LaTeX: no newline, no control character
        for col in TEXT:
            if isinstance(raw.get(col), str):
                check_label(raw[col], where, f"column {col!r}", max_len=2000 if col == "notes" else 200)
    platform = str(raw["platform"]).strip()
    if not _PLATFORM.match(platform):
        raise ExternalLogError(f"{where}: column 'platform': {platform!r} must match [A-Za-z0-9._-]+")
    row: dict[str, Any] = {
        "platform": platform,
        "model": str(raw["model"]).strip(),
        "experiment": _choice(raw["experiment"], "experiment", where, EXPERIMENTS),
        "policy": _choice(raw["policy"], "policy", where, POLICIES),
        "storage": _choice(raw["storage"], "storage", where, STORAGES),
        "m_max": _int(raw["m_max"], "m_max", where),
        "compute_opt": _bool(raw["compute_opt"], "compute_opt", where),
        "repeat": _int(raw["repeat"], "repeat", where),
        "tokens_per_s": _float(raw["tokens_per_s"], "tokens_per_s", where),
    }
    if row["tokens_per_s"] <= 0:
        raise ExternalLogError(f"{where}: column 'tokens_per_s': {row['tokens_per_s']} must be > 0")
    for col in OPTIONAL_INT:
        row[col] = "" if _empty(raw.get(col)) else _int(raw[col], col, where)
    for col in OPTIONAL_FLOAT:
        row[col] = "" if _empty(raw.get(col)) else _float(raw[col], col, where)
    rr = row["ready_recall"]
    if rr != "" and not 0.0 <= rr <= 1.0:
        raise ExternalLogError(f"{where}: column 'ready_recall': {rr} not in [0, 1] (give a fraction, not a percent)")
    if row["stall_ms"] != "" and row["stall_ms"] < 0:
        raise ExternalLogError(f"{where}: column 'stall_ms': {row['stall_ms']} < 0")
    return row


def read_external_log(path: str | Path) -> list[dict[str, Any]]:
    """Validate one external log and return its rows as runs.csv rows (``source = external:<name>``)."""
    path = Path(path)
    if not path.is_file():
        raise ExternalLogError(f"{path}: external device log not found")
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[Any, ...], str] = {}
    for where, raw in _records(path):
        row = validate_row(raw, where)
        key = tuple(row[k] for k in RUN_KEY)
        if key in seen:
            raise ExternalLogError(f"{where}: duplicate run (same {', '.join(RUN_KEY)} as {seen[key]})")
        seen[key] = where
        row["source"] = f"external:{path.name}"
        rows.append(row)
    if not rows:
        raise ExternalLogError(f"{path}: no rows")
    return rows


def _records(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    with reraise_as(ExternalLogError):  # the file boundary's one line, as this reader's error type
        yield from _raw_records(path)


def _raw_records(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    if path.suffix == ".jsonl":
        yield from read_jsonl(path, "external device log", skip_blank=True)
    elif path.suffix == ".csv":
        rows = csv_rows(path, "external device log")
        first = next(rows, None)
        if first is None:
            raise ExternalLogError(f"{path}:1: empty file (a header line is required)")
        header = [h.strip() for h in first[1]]
        unknown = [h for h in header if h not in ALLOWED]
        if unknown:
            raise ExternalLogError(f"{path}:1: unknown column {unknown[0]!r}")
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise ExternalLogError(f"{path}:1: header lacks required column {missing[0]!r}")
        if len(set(header)) != len(header):
            raise ExternalLogError(f"{path}:1: a column is named twice in the header")
        for line, cells in rows:
            if not any(c.strip() for c in cells):
                continue
            if len(cells) != len(header):
                raise ExternalLogError(f"{path}:{line}: {len(cells)} cells, the header has {len(header)}")
            yield f"{path}:{line}", dict(zip(header, cells, strict=True))
    else:
        raise ExternalLogError(f"{path}: unsupported log format {path.suffix!r} (use .csv or .jsonl)")


def read_runs_csv(path: str | Path) -> list[dict[str, Any]]:
    """A runs CSV written by bench/simulate; checks the contract's columns are there."""
    path = Path(path)
    rows = csv_rows(path, "runs CSV")
    first = next(rows, None)
    header = first[1] if first else []
    missing = [c for c in RUN_COLUMNS[:RUN_KEY_COLUMNS] if c not in header]
    if missing:
        raise ExternalLogError(f"{path}:1: missing column {missing[0]!r}")
    out = []
    for line, cells in rows:
        if len(cells) != len(header):
            raise ExternalLogError(f"{path}:{line}: {len(cells)} cells, the header has {len(header)} (truncated?)")
        out.append(dict(zip(header, cells, strict=True)))
    return out


def collect_device_benchmarks(runs: Sequence[str | Path], external: Sequence[str | Path],
                              out_csv: str | Path) -> list[dict[str, Any]]:
    """Merge measured/simulated run CSVs and validated external logs into ``runs.csv`` (atomically)."""
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[str, ...], str] = {}
    for p in [*runs, *external]:
        got = read_external_log(p) if p in external else read_runs_csv(p)
        for i, r in enumerate(got):
            # the budget experiment's SpecPrefetch runs differ only in their per-layer budgets or online rule, the
            # look-ahead experiment's in their distance
            key = (*(str(r[k]).lower() for k in RUN_KEY), str(r.get("layer_m_max") or ""),
                   str(run_lookahead(r)), run_budget_rule(r))
            where = f"{p}:{i + 2}" if p not in external else f"{p} row {i + 1}"
            if key in seen:
                raise ExternalLogError(f"{where}: the same run ({', '.join(RUN_KEY)}, layer_m_max, lookahead, "
                                       "budget_rule) as "
                                       f"{seen[key]}: "
                                       "runs.csv rows must be unique (paired gains need one row per run)")
            seen[key] = where
        rows.extend(got)
    write_runs_csv(out_csv, rows)
    return rows


def concat_csvs(paths: Sequence[str | Path], out_csv: str | Path) -> int:
    """Concatenate CSVs with identical headers (window.csv, window_events.csv, latency.csv of every model)."""
    header: list[str] | None = None
    body: list[list[str]] = []
    for p in paths:
        rows = csv_rows(p, "CSV")
        first = next(rows, None)
        if first is None:
            raise ExternalLogError(f"{p}:1: empty CSV")
        h = first[1]
        if header is None:
            header = h
        elif h != header:
            raise ExternalLogError(f"{p}:1: header {h} differs from {header}")
        for line, cells in rows:
            if len(cells) != len(h):
                raise ExternalLogError(f"{p}:{line}: {len(cells)} cells, the header has {len(h)} (truncated?)")
            body.append(cells)
    from specprefetch.io import atomic_path

    with atomic_path(out_csv) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(header or [])
            w.writerows(body)
    return len(body)
