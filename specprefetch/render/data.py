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


# --------------------------------------------------------------------------------------------- device summaries

PAIR_KEYS = ("platform", "model", "experiment", "storage", "repeat")


def paired_gains(runs: pd.DataFrame, path: Path | str, baseline: Mapping[str, Any] | None = None,
                 match_compute_opt: bool = True) -> pd.DataFrame:
    """Per-row gain vs OFF of the same repeat: tokens_per_s / tokens_per_s(OFF, same repeat) - 1, in percent.

    Repeats are paired and interleaved by the runtime (repeat r of every policy ran back to back), so the gain is
    computed per repeat and then averaged; comparing means of independent runs would mix in slow drifts (thermal
    state, page cache) the pairing removes. ``baseline`` selects the reference rows (default policy == 'off');
    with ``match_compute_opt`` the reference must also have the same compute_opt. A row without its reference, or
    with two, is an error naming the repeat.
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
    """Mean, std (ddof=1) and n of ``columns`` per group, as ``<col>_mean``, ``<col>_std``, ``n``."""
    rows = []
    for key, g in df.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        row: dict[str, Any] = dict(zip(by, key, strict=True))
        for c in columns:
            vals = g[c].dropna()
            if vals.empty:
                row[f"{c}_mean"], row[f"{c}_std"] = float("nan"), float("nan")
            else:
                row[f"{c}_mean"], row[f"{c}_std"], _ = mean_std(vals)
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
