"""Reading the result CSVs the tables and figures are made from, and the summaries both need.

Every reader checks the file against its contract (columns, types, ranges, allowed values) and raises
``RenderInputError`` naming the file, the column and the offending line, so a malformed result never turns into a
plausible-looking but wrong table. Summaries (paired gains, sweeps, per-layer means) live here so the tables, the
figures and the comparison with the paper compute them once, the same way.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from specprefetch.contracts import check_csv, reraise_as
from specprefetch.io import SpecPrefetchError, atomic_path
from specprefetch.metrics import CI, CI_BOOT, CI_LEVEL, CI_SEED, bootstrap_ci
from specprefetch.render.targets import RESULT_PATHS

log = logging.getLogger(__name__)


class RenderInputError(SpecPrefetchError):
    """A result CSV (or the config it is rendered with) is missing or malformed; the message names file and column."""


# Where each contract's file lives in the pipeline (for error messages and CLI defaults).
DEFAULT_PATHS = RESULT_PATHS

def read_result_csv(path: str | Path, contract: str) -> pd.DataFrame:
    """Read one result CSV and check it against ``contracts.CSV_CONTRACTS[contract]`` (columns, types, ranges,
    allowed values; extra columns are kept untouched). Raises RenderInputError naming the file, column and line."""
    path = Path(path)
    if not path.is_file():
        raise RenderInputError(f"{path}: file not found (the {contract} results, expected at "
                               f"{DEFAULT_PATHS[contract]} in a pipeline run)")
    with reraise_as(RenderInputError):
        return check_csv(path, contract)


def require_inputs(name: str, needed: Sequence[str], inputs: Mapping[str, Path | str]) -> dict[str, Path | str]:
    """The inputs a table or figure needs, all given (else one line naming the first missing flag)."""
    missing = [k for k in needed if k not in inputs]
    if missing:
        raise RenderInputError(f"{name}: needs input(s) {', '.join(missing)} (e.g. --{missing[0].replace('_', '-')}"
                               " PATH)")
    return dict(inputs)


def archive_inputs(paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Copy result CSVs into ``out_dir`` under their file names, byte for byte, after checking each against its
    contract (found by file name: recall.csv, runs.csv, ...), so an archive never holds a table the renderer would
    reject. Each copy is atomic."""
    by_name = {Path(v).name: k for k, v in DEFAULT_PATHS.items()}
    written = []
    for path in map(Path, paths):
        if path.name not in by_name:
            raise RenderInputError(f"{path}: not a rendering input (expected one of {', '.join(sorted(by_name))})")
        read_result_csv(path, by_name[path.name])
        target = Path(out_dir) / path.name
        with atomic_path(target) as tmp:
            shutil.copyfile(path, tmp)
        written.append(target)
    return written


# --------------------------------------------------------------------------------------------- selection helpers


def require_rows(df: pd.DataFrame, path: Path | str, what: str, **match: Any) -> pd.DataFrame:
    """The rows where every ``column == value`` in ``match``; none at all is an input error naming the selection."""
    mask = pd.Series(True, index=df.index)
    for k, v in match.items():
        mask &= df[k] == v
    out = df[mask]
    if out.empty:
        sel = ", ".join(f"{k}={v!r}" for k, v in match.items())
        raise RenderInputError(f"{path}: no rows with {sel} ({what})")
    return out


def choose_one(df: pd.DataFrame, column: str, wanted: str | None, path: Path | str, what: str,
               prefer: pd.Series | None = None) -> str:
    """Pick the value of ``column`` a table or figure is about (e.g. the platform of runs.csv).

    ``wanted`` (from config ``render.device``) wins and must be present; otherwise the only value, or else the only
    value among the ``prefer`` rows (e.g. source == measured); an ambiguous choice is an error that lists the options
    and the config key that settles it.
    """
    values = sorted(df[column].unique())
    if wanted is not None:
        if wanted not in values:
            raise RenderInputError(f"{path}: no rows with {column}={wanted!r} ({what}); present: {', '.join(values)}")
        return wanted
    if len(values) == 1:
        return values[0]
    if prefer is not None:
        preferred = sorted(df.loc[prefer, column].unique())
        if len(preferred) == 1:
            return preferred[0]
    raise RenderInputError(f"{path}: several values of {column!r} ({', '.join(values)}) for {what}; "
                           f"choose one with config key render.device.{column}")


def mean_std(values: Sequence[float] | pd.Series) -> tuple[float, float, int]:
    """Mean, sample standard deviation (ddof=1; 0 for a single value) and count."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        raise ValueError("mean_std of nothing")
    std = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
    return float(arr.mean()), std, int(arr.size)


# --------------------------------------------------------------------------------------------- confidence intervals

CI_META = {"method": "percentile bootstrap of the mean, resampling repeats (pairs) with replacement",
           "level": CI_LEVEL, "n_boot": CI_BOOT, "seed": CI_SEED}  # what a table JSON's lo/hi are


@dataclass(frozen=True)
class RepeatStats:
    """One device number over its repeats: mean, sample std, the bootstrap CI, the per-repeat spread (min, max)
    and the per-repeat values by repeat (for paired comparisons of two cells in the comparison with the paper)."""

    mean: float
    std: float
    lo: float
    hi: float
    n: int
    spread: tuple[float, float]
    repeats: dict[int, float] | None

    @property
    def ci(self) -> CI:
        return CI(self.mean, self.lo, self.hi, self.n)

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2.0

    def cell_fields(self) -> dict[str, Any]:
        """The fields of a ``cells.Cell`` (value = mean, std, n, lo, hi, spread, repeats)."""
        return {"value": self.mean, "std": self.std, "n": self.n, "lo": self.lo, "hi": self.hi,
                "spread": self.spread,
                "repeats": None if self.repeats is None else {str(k): v for k, v in self.repeats.items()}}


def repeat_stats(values: pd.Series, repeats: pd.Series | None = None) -> RepeatStats:
    """``RepeatStats`` of one group's rows (one row per repeat; NaN values dropped). ``repeats`` (the rows' repeat
    numbers) keys the per-repeat values; duplicated repeat numbers leave them out (no pairing possible)."""
    vals = pd.Series(values, dtype=float)
    keep = vals.notna()
    vals = vals[keep]
    mean, std, _ = mean_std(vals)
    ci = bootstrap_ci(vals.to_numpy())
    by_rep = None
    if repeats is not None:
        reps = pd.Series(repeats)[keep]
        if not reps.duplicated().any():
            by_rep = {int(r): float(v) for r, v in sorted(zip(reps, vals, strict=True))}
    return RepeatStats(mean, std, ci.lo, ci.hi, ci.n, (float(vals.min()), float(vals.max())), by_rep)


# one configuration
CONFIG_KEYS = ("experiment", "storage", "policy", "m_max", "compute_opt", "layer_m_max", "lookahead", "budget_rule",
               "batch")


def repeat_count(rows: pd.DataFrame) -> int | str:
    """How many repeats each configuration of ``rows`` has: one count, or "lo–hi" when they differ (adaptive
    repeats, ``device.max_repeats``, stop each block on its own)."""
    keys = [k for k in CONFIG_KEYS if k in rows.columns]
    counts = rows.groupby(keys, dropna=False)["repeat"].nunique() if keys else pd.Series([rows["repeat"].nunique()])
    lo, hi = int(counts.min()), int(counts.max())
    return lo if lo == hi else f"{lo}–{hi}"


def repeats_note(rows: pd.DataFrame) -> str:
    """ "mean ± 95 % CI half-width, paired bootstrap over R repeats, N decoded tokens per run" from the rows shown
    (``repeat`` and, when runs.csv has it, ``n_tokens``: one N, or its range when runs decoded different counts;
    R is a range when configurations were repeated a different number of times)."""
    n_rep = repeat_count(rows)
    text = f"mean ± {CI_LEVEL * 100:g} % CI half-width, paired bootstrap over {n_rep} repeat{'s' * (n_rep != 1)}"
    if "n_tokens" in rows.columns:
        toks = pd.to_numeric(rows["n_tokens"], errors="coerce").dropna()
        if not toks.empty:
            lo, hi = int(toks.min()), int(toks.max())
            text += f", {lo if lo == hi else f'{lo}–{hi}'} decoded tokens per run"
    return text


# --------------------------------------------------------------------------------------------- device summaries

BOUND_COLUMN = "bound_tokens_per_s"  # optional runs.csv column: the run's overlap/roofline throughput bound


def bound_values(rows: pd.DataFrame, path: Path | str) -> pd.Series | None:
    """The optional ``bound_tokens_per_s`` of each row as floats (NaN where empty), or None when runs.csv has no
    such column or it is empty throughout (older runs.csv files: render as before). A filled value that is not a
    positive number is an input error naming the column and line (the line is right for the frame as read)."""
    if BOUND_COLUMN not in rows.columns:
        return None
    raw = rows[BOUND_COLUMN]
    blank = raw.isna() | (raw.astype(str).str.strip() == "")
    vals = pd.to_numeric(raw.where(~blank), errors="coerce")
    bad = ~blank & ~(vals > 0)
    if bad.any():
        i = rows.index.get_loc(bad[bad].index[0])
        raise RenderInputError(f"{path}: column {BOUND_COLUMN!r}, line {int(i) + 2}: value {raw[bad].iloc[0]!r} is "
                               "not a positive number (tok/s)")
    return None if vals.isna().all() else vals.astype(float)


PAIR_KEYS = ("platform", "model", "experiment", "storage", "repeat")


def paired_gains(runs: pd.DataFrame, path: Path | str, baseline: Mapping[str, Any] | None = None,
                 match_compute_opt: bool = True) -> pd.DataFrame:
    """Per-row gain vs OFF of the same repeat: tokens_per_s / tokens_per_s(OFF, same repeat) - 1, in percent.

    Repeats are paired and interleaved by the runtime (repeat r of every policy was measured in one block, in
    lockstep by default), so the gain is computed per repeat and then averaged; comparing means of independent
    runs would mix in slow drifts (thermal state, page cache, a shared disk) the pairing removes. ``baseline``
    selects the reference rows (default policy == 'off'); with ``match_compute_opt`` the reference must also have
    the same compute_opt. A row without its reference, or with two, is an error naming the repeat.
    """
    baseline = dict(baseline or {"policy": "off"})
    keys = list(PAIR_KEYS) + (["compute_opt"] if match_compute_opt else [])
    mask = pd.Series(True, index=runs.index)
    for k, v in baseline.items():
        mask &= runs[k] == v
    ref = runs[mask]
    dup = ref.duplicated(keys, keep=False)
    if dup.any():
        row = ref[dup].iloc[0]
        raise RenderInputError(f"{path}: two reference rows ({baseline}) for "
                               + ", ".join(f"{k}={row[k]!r}" for k in keys) + " (repeats must be unique)")
    ref = ref[keys + ["tokens_per_s"]].rename(columns={"tokens_per_s": "ref_tokens_per_s"})
    merged = runs.merge(ref, on=keys, how="left", validate="many_to_one")
    lost = merged["ref_tokens_per_s"].isna()
    if lost.any():
        row = merged[lost].iloc[0]
        raise RenderInputError(f"{path}: no reference run ({baseline}) paired with policy={row['policy']!r}, "
                               + ", ".join(f"{k}={row[k]!r}" for k in keys)
                               + " (gains are paired per repeat)")
    merged["gain_pct"] = (merged["tokens_per_s"] / merged["ref_tokens_per_s"] - 1.0) * 100.0
    return merged


def summarize(df: pd.DataFrame, by: Sequence[str], columns: Sequence[str]) -> pd.DataFrame:
    """Per group: mean, std (ddof=1), the bootstrap CI (``bootstrap_ci``) and the ``RepeatStats`` of ``columns``,
    as ``<col>_mean``, ``<col>_std``, ``<col>_lo``, ``<col>_hi``, ``<col>_stats`` (None without values), and ``n``
    (rows of the group)."""
    rows = []
    for key, g in df.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        row: dict[str, Any] = dict(zip(by, key, strict=True))
        for c in columns:
            vals = g[c].dropna()
            if vals.empty:
                for part in ("mean", "std", "lo", "hi"):
                    row[f"{c}_{part}"] = float("nan")
                row[f"{c}_stats"] = None
            else:
                st = repeat_stats(g[c], g["repeat"] if "repeat" in g.columns else None)
                row[f"{c}_mean"], row[f"{c}_std"], row[f"{c}_lo"], row[f"{c}_hi"] = st.mean, st.std, st.lo, st.hi
                row[f"{c}_stats"] = st
        row["n"] = len(g)
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class DeviceSelection:
    """Which platform, model and source of runs.csv the device tables and figures show."""

    platform: str
    model: str
    sources: tuple[str, ...]


PAPER_DEVICE_MODEL = "DeepSeek-VL2-Tiny"  # the model of the paper's on-device Tables 4-5 and Figures 4-6


def _preferred_models(cfg: Mapping[str, Any]) -> list[str]:
    """Models in the order a device table prefers them: the runtime's explicit device.models, then the model
    standing for the paper's on-device model (DeepSeek-VL2-Tiny), then the config's order."""
    dev = (cfg.get("device") or {}).get("models") or []
    models = cfg.get("models") or {}
    paper = [m for m, mc in models.items() if mc.get("display_name") == PAPER_DEVICE_MODEL]
    return list(dict.fromkeys([*dev, *paper, *models]))


def select_device(runs: pd.DataFrame, path: Path | str, cfg: Mapping[str, Any]) -> DeviceSelection:
    """Resolve the rows a device table shows: render.device.{platform, model, source} when set, else

    - platform: the only one, else the only one with measured rows (this machine's runtime);
    - model: the only one, else the first with rows there of device.models, the DeepSeek-VL2-Tiny stand-in,
      the config's models;
    - source: measured if present, else the only one (measured and simulated rows of one platform must not be
      paired with each other).
    """
    dev = cfg["render"]["device"]
    measured = runs["source"] == "measured"
    platform = choose_one(runs, "platform", dev["platform"], path, "the device tables and figures", measured)
    sub = runs[runs["platform"] == platform]
    wanted = dev["model"]
    if wanted is None and sub["model"].nunique() > 1:
        wanted = next((m for m in _preferred_models(cfg) if m in set(sub["model"])), None)
    model = choose_one(sub, "model", wanted, path, f"platform {platform!r}")
    sub = sub[sub["model"] == model]
    source = dev["source"]
    if source is None and sub["source"].nunique() > 1 and "measured" in set(sub["source"]):
        source = "measured"
    source = choose_one(sub, "source", source, path, f"platform {platform!r}, model {model!r}")
    return DeviceSelection(platform, model, (source,))


def experiment_rows(runs: pd.DataFrame, path: Path | str, sel: DeviceSelection, experiment: str) -> pd.DataFrame:
    return require_rows(runs, path, f"experiment {experiment!r} of the runtime benchmarks",
                        platform=sel.platform, model=sel.model, source=sel.sources[0], experiment=experiment)


# --------------------------------------------------------------------------------------------- window (Figure 1b)


def window_summary(window: pd.DataFrame, events: pd.DataFrame, path_events: Path | str,
                   candidates: Sequence[int]) -> pd.DataFrame:
    """Per (platform, model, layer, M): mean window, mean demand, and % of events whose demand exceeds the window.

    The curves of Figure 1(b) are per-layer means; the percentages are over individual events (a mean below the
    window can still hide many events above it, which is the paper's point).
    """
    present = sorted(events["M"].unique())
    use = [m for m in candidates if m in present]
    if not use:
        raise RenderInputError(f"{path_events}: no events with M in {list(candidates)} (present: {present})")
    ev = events[events["M"].isin(use)].copy()
    ev["exceeds"] = ev["demand_ms"] > ev["window_ms"]
    per_layer = (ev.groupby(["platform", "model", "layer", "M"], sort=True)
                 .agg(demand_ms=("demand_ms", "mean"), event_window_ms=("window_ms", "mean"),
                      exceed_pct=("exceeds", "mean"), n_events=("exceeds", "size")).reset_index())
    per_layer["exceed_pct"] *= 100.0
    win = window.groupby(["platform", "model", "layer"], sort=True).agg(
        window_ms=("window_ms", "mean"), transfer_ms=("transfer_ms", "mean"), m_max=("m_max", "max")).reset_index()
    return per_layer.merge(win, on=["platform", "model", "layer"], how="left")


def window_exceed_overall(events: pd.DataFrame, candidates: Sequence[int]) -> pd.DataFrame:
    """% of all events (every layer) with demand > window, per (platform, model, M): the figure's legend numbers."""
    ev = events[events["M"].isin(list(candidates))].copy()
    ev["exceeds"] = ev["demand_ms"] > ev["window_ms"]
    out = ev.groupby(["platform", "model", "M"], sort=True)["exceeds"].mean().reset_index(name="exceed_pct")
    out["exceed_pct"] *= 100.0
    return out


# --------------------------------------------------------------------------------------------- latency (Figure 1a)


def latency_summary(latency: pd.DataFrame) -> pd.DataFrame:
    """Mean per-layer latency of each component, per (platform, model, mode), and its share of the layer total."""
    per_layer = latency.groupby(["platform", "model", "mode", "layer", "component"], sort=True)["ms"].sum()
    per_layer = per_layer.unstack("component", fill_value=0.0).stack().rename("ms").reset_index()
    comp = per_layer.groupby(["platform", "model", "mode", "component"], sort=True)["ms"].mean().reset_index()
    total = comp.groupby(["platform", "model", "mode"])["ms"].transform("sum")
    comp["share_pct"] = np.where(total > 0, comp["ms"] / total * 100.0, 0.0)
    return comp
