"""The measured numbers the docs cite, each with the file and cell it came from: ``numbers.md`` and ``numbers.json``.

Prose that types a measured number goes stale with the next run. The docs therefore quote no measurement: they link
to this page, which ``rule write_numbers`` regenerates from the rendering's own outputs on every run (the table and
figure JSONs, ``comparison.json``, the archived result CSVs and, when given, the simulator's validation). Every
number names its source (a file, and in it a cell id, a ``meta`` key, a summary key or the CSV rows it aggregates),
so a reader, and ``tests/test_numbers.py``, can trace it back.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specprefetch.contracts import check_csv, read_csv, read_doc, require, split_experiment
from specprefetch.io import SpecPrefetchError, atomic_path, write_json_atomic, write_text_atomic
from specprefetch.render.cells import Cell, TableDoc, read_table_doc

NUMBERS_FORMAT = "specprefetch-numbers/1"
VERDICTS = ("holds", "fails", "unresolved")  # comparison.json's summary keys, besides checkable and n/a
# speedup: over the block's OFF, paired; service_ms: the disk's service time, the profile's against the run's
SIM_METRICS = ("tokens_per_s", "stall_ms", "ready_recall", "speedup", "service_ms")


@dataclass(frozen=True)
class Number:
    """One citable quantity. ``source`` is a file path (relative to the page that lists it); ``locator`` says where in
    it: ``cell:<id>`` (a table or figure cell's ``value``), ``meta:<key>[.<key>]``, ``summary:<key>``, or
    ``rows:<what>`` for an aggregate over CSV rows (the rows and the aggregate are spelled out)."""

    section: str
    key: str
    what: str
    value: float | int | str
    text: str
    source: str
    locator: str
    lo: float | None = None
    hi: float | None = None
    repeats: int | None = None


def _pct(v: float, sign: bool = True) -> str:
    return f"{v:+.1f} %" if sign else f"{v:.1f} %"


def _ci_text(c: Cell, unit: str) -> str:
    """``+38.3 % (+34.3, +42.3), 6 repeats`` (a gain: signed), ``41.3 % (38.0, 45.0)`` (a share) or
    ``7.68 tok/s (7.14, 8.34), 6 repeats``."""
    assert c.value is not None
    if unit == "%":
        sign = c.quantity == "gain"
        body = _pct(c.value, sign)
        ci = (f" ({c.lo:+.1f}, {c.hi:+.1f})" if sign else f" ({c.lo:.1f}, {c.hi:.1f})") if c.has_ci else ""
    else:
        body = f"{c.value:.2f} {unit}"
        ci = f" ({c.lo:.2f}, {c.hi:.2f})" if c.has_ci else ""
    return body + ci + (f", {c.n} repeats" if c.n else "")


class _Collector:
    """Builds the list of numbers; paths are shown relative to ``base`` (the directory of numbers.md)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.numbers: list[Number] = []
        self.missing: list[str] = []

    def rel(self, path: Path) -> str:
        return Path(os.path.relpath(Path(path).resolve(), self.base.resolve())).as_posix()

    def add(self, section: str, key: str, what: str, value: float | int | str, text: str, path: Path,
            locator: str, cell: Cell | None = None) -> None:
        if any(n.key == key for n in self.numbers):
            raise SpecPrefetchError(f"numbers: key {key!r} is produced twice (from {path})")
        self.numbers.append(Number(section, key, what, value, text, self.rel(path), locator,
                                   lo=None if cell is None else cell.lo, hi=None if cell is None else cell.hi,
                                   repeats=None if cell is None else cell.n))

    def cell(self, section: str, key: str, what: str, doc: TableDoc, path: Path, cid: str, unit: str) -> None:
        """A cell's value, when the table has that cell and it is not a dash (a missing cell is listed, not faked)."""
        c = doc.by_id().get(cid)
        if c is None or c.value is None or not math.isfinite(c.value):
            self.missing.append(f"{self.rel(path)}: cell {cid!r}")
            return
        text = _ci_text(c, unit) if c.n else (f"{c.value:g}" if unit == "" else f"{c.value:.2f} {unit}".strip())
        self.add(section, key, what, c.value, text, path, f"cell:{cid}", c)


def _doc(path: Path | None, c: _Collector) -> TableDoc | None:
    if path is None or not path.exists():
        if path is not None:
            c.missing.append(c.rel(path))
        return None
    return read_table_doc(path)


# ------------------------------------------------------------------------------------------------ sections
def _claims(path: Path, c: _Collector) -> None:
    doc = read_doc(path, None, "comparison JSON", required=("summary",))
    summary = require(doc, "summary", dict, str(path))
    for key in ("checkable", *VERDICTS):
        value = require(summary, key, int, f"{path}: summary")
        what = {"checkable": "claims checkable here", "holds": "claims that hold", "fails": "claims that fail",
                "unresolved": "claims left unresolved (the CI decides neither way)"}[key]
        c.add("Claims of the paper", f"claims.{key}", what, value, str(value), path, f"summary:{key}")
    claims = doc.get("claims")
    if isinstance(claims, list):
        for verdict in ("fails", "unresolved"):
            ids = [str(x["id"]) for x in claims if isinstance(x, dict) and "id" in x and not x.get("extension")
                   and x.get("verdict_reproduced") == verdict]
            c.add("Claims of the paper", f"claims.{verdict}.ids", f"ids of the claims that {verdict[:-1]}"
                  if verdict == "fails" else "ids of the unresolved claims", ", ".join(ids) or "none",
                  ", ".join(f"`{i}`" for i in ids) or "none", path,
                  f"claims[verdict_reproduced={verdict},extension=false].id")
        ext = [x for x in claims if isinstance(x, dict) and "id" in x and x.get("extension")]
        for x in ext:
            verdict = str(x.get("verdict_reproduced"))
            c.add("Claims beyond the paper", f"extensions.{x['id']}", str(x.get("statement", x["id"])), verdict,
                  f"{verdict}: {x.get('reproduced', '')}", path, f"claims[id={x['id']}].verdict_reproduced")


def _meta(doc: TableDoc, key: str) -> Any:
    return doc.meta.get(key)


def _table4(path: Path, doc: TableDoc, c: _Collector) -> None:
    s = "Table 4: overhead on the reference storage"
    for key in ("model", "storage", "m_max", "repeats"):
        v = _meta(doc, key)
        if v is not None:
            c.add(s, f"table4.{key}", {"m_max": "M_max (the profiled budget)", "repeats": "repeats per "
                  "configuration"}.get(key, key), v, str(v), path, f"meta:{key}")
    policies = [x.id.split("/")[0] for x in doc.cells if x.id.endswith("/throughput")]
    for pol in policies:
        slug = pol.lower().replace(" ", "_")
        c.cell(s, f"table4.{slug}.throughput", f"{pol}: decoding throughput", doc, path, f"{pol}/throughput",
               "tok/s")
        if pol != "OFF":
            c.cell(s, f"table4.{slug}.gain", f"{pol}: gain vs OFF", doc, path, f"{pol}/gain", "%")
        c.cell(s, f"table4.{slug}.of_bound", f"{pol}: share of the overlap bound", doc, path, f"{pol}/of_bound",
               "%")


def _table5(path: Path, doc: TableDoc, c: _Collector) -> None:
    s = "Table 5: matched budgets"
    per = _meta(doc, "m_max_per_storage") or {}
    for storage, m in per.items():
        c.add(s, f"table5.m_max.{storage}", f"M_max on {storage}", m, str(m), path, f"meta:m_max_per_storage.{storage}")
    if not per and _meta(doc, "m_max") is not None:  # a rendering with one budget for every storage
        c.add(s, "table5.m_max", "M_max (every storage)", doc.meta["m_max"], str(doc.meta["m_max"]), path, "meta:m_max")
    storages = {"gain_cold": _meta(doc, "cold_storage") or "the cold storage",
                "gain_slow": _meta(doc, "slow_storage") or "the slow storage"}
    for x in doc.cells:
        method, col = x.id.split("/", 1)
        slug = method.lower().replace(" ", "_")
        if x.quantity == "gain":
            c.cell(s, f"table5.{slug}.{col}", f"{method}: gain vs OFF on {storages.get(col, col)}", doc, path, x.id,
                   "%")
        elif x.quantity == "ready_recall":
            c.cell(s, f"table5.{slug}.{col}", f"{method}: ReadyRecall on {storages['gain_cold']}", doc, path, x.id,
                   "%")


def _fig4(path: Path, doc: TableDoc, c: _Collector) -> None:
    s = "Figure 4: budget sweep"
    prof = _meta(doc, "profiled_m_max")
    if prof is not None:
        c.add(s, "fig4.profiled_m_max", "profiled M_max", prof, str(prof), path, "meta:profiled_m_max")
    c.cell(s, "fig4.peak_m_max", "M_max of the highest mean throughput", doc, path, "peak_m_max", "")
    c.cell(s, "fig4.off.throughput", "OFF: decoding throughput", doc, path, "OFF/throughput", "tok/s")
    for x in doc.cells:
        if x.id.startswith("M") and x.id.endswith("/throughput"):
            m = x.id.split("/")[0]
            c.cell(s, f"fig4.{m.lower()}.throughput", f"SpecPrefetch at M = {m[1:]}: throughput", doc, path, x.id,
                   "tok/s")


def _fig5(path: Path, doc: TableDoc, c: _Collector) -> None:
    s = "Figure 5: storages"
    per = _meta(doc, "m_max_per_storage") or {}
    for storage, m in per.items():
        c.add(s, f"fig5.m_max.{storage}", f"M_max on {storage} (its own profiled budget)", m, str(m), path,
              f"meta:m_max_per_storage.{storage}")
    for x in doc.cells:
        if x.id.endswith("/gain") and x.id.count("/") == 1:
            storage = x.id.split("/")[0]
            c.cell(s, f"fig5.{storage}.gain", f"SpecPrefetch gain vs OFF on {storage}", doc, path, x.id, "%")
            c.cell(s, f"fig5.{storage}.off.throughput", f"OFF throughput on {storage}", doc, path,
                   f"{storage}/OFF/throughput", "tok/s")


def _fig6(path: Path, doc: TableDoc, c: _Collector) -> None:
    s = "Figure 6: components"
    for x in doc.cells:
        name = x.id.split("/")[0]
        if x.id.endswith("/gain") and x.value is not None and name != "Baseline":  # the baseline is OFF itself
            slug = name.lstrip("+ ").lower().replace(" ", "_").replace(".", "")
            c.cell(s, f"fig6.{slug}.gain", f"{name}: gain vs OFF without the compute optimization", doc, path,
                   x.id, "%")


def _recall(path: Path, doc: TableDoc, c: _Collector) -> None:
    """Per model and method: ExpertRecall@K, the mean over the table's workloads (the budget labelled ``K``)."""
    s = "Table 1: ExpertRecall@K (mean over workloads)"
    groups: dict[tuple[str, str], list[Cell]] = {}
    for x in doc.cells:
        if x.keys.get("budget") == "K" and x.value is not None:
            groups.setdefault((str(x.keys["model"]), str(x.keys["method"])), []).append(x)
    for (model, method), cells in groups.items():
        m = cells[0].keys.get("M")
        mean = sum(x.value for x in cells if x.value is not None) / len(cells)
        slug = f"{model}.{method}".lower().replace(" ", "_")
        c.add(s, f"table1.{slug}.recall_at_k", f"{model}, {method}: R@{m} (K)", round(mean, 4), f"{mean:.2f} %",
              path, f"rows:mean of cells {model}/<workload>/{method}/R@{m} over {len(cells)} workloads")


def _params(path: Path, doc: TableDoc, c: _Collector) -> None:
    s = "Table 3: trainable parameters"
    for x in doc.cells:
        if x.value is not None:
            slug = x.id.lower().replace(" ", "_").replace("/", ".")
            c.add(s, f"table3.{slug}", f"{x.keys.get('model')}, {x.keys.get('method')}", int(x.value),
                  x.text or f"{int(x.value):,}", path, f"cell:{x.id}", x)


def _window(path: Path, c: _Collector) -> None:
    """Per model: the per-layer windows (median, range over layers), the reference storage's transfer time, M_max."""
    s = "Window profile (reference storage)"
    df = check_csv(path, "window")
    for (platform, model), g in df.groupby(["platform", "model"], sort=False):
        w = g["window_ms"].astype(float)
        med = float(w.median())
        where = f"rows:{platform}/{model}"
        c.add(s, f"window.{model}.window_ms", f"{model}: window W_l, median over {len(g)} layers", round(med, 4),
              f"{med:.2f} ms ({w.min():.2f}–{w.max():.2f} over layers)", path, f"{where}: median of window_ms")
        t = float(g["transfer_ms"].astype(float).median())
        c.add(s, f"window.{model}.transfer_ms", f"{model}: per-expert transfer time in the runtime", round(t, 4),
              f"{t:.2f} ms", path, f"{where}: median of transfer_ms")
        m = int(g["m_max"].astype(int).max())
        c.add(s, f"window.{model}.m_max", f"{model}: M_max (largest over layers)", m, str(m), path,
              f"{where}: max of m_max")


def _runs(path: Path, c: _Collector) -> None:
    """Per model: the measured runs, their repeats and decoded tokens, and how many reproduced the plain tokens."""
    s = "Device runs"
    df = check_csv(path, "runs")
    df = df[df["source"] == "measured"]
    if "measured_in" in df:  # a run listed again under another experiment that reuses it counts once
        df = df[df["measured_in"].isna() | (df["measured_in"] == df["experiment"])]
    for model, g in df.groupby("model", sort=False):
        where = f"rows:source=measured, model={model}, measured_in=experiment"
        c.add(s, f"runs.{model}.count", f"{model}: measured runs", len(g), str(len(g)), path, f"{where}: count")
        reps = int(g["repeat"].max()) + 1
        c.add(s, f"runs.{model}.repeats", f"{model}: repeats (largest repeat + 1)", reps, str(reps), path,
              f"{where}: max of repeat + 1")
        if "n_tokens" in g:
            n = int(g["n_tokens"].astype(float).median())
            c.add(s, f"runs.{model}.n_tokens", f"{model}: decoded tokens per run (median)", n, str(n), path,
                  f"{where}: median of n_tokens")
        if "tokens_match" in g:
            ok = int(g["tokens_match"].astype(str).str.lower().isin(("true", "1")).sum())
            c.add(s, f"runs.{model}.tokens_match", f"{model}: runs that decoded the plain model's tokens", ok,
                  f"{ok} of {len(g)}", path, f"{where}: count of tokens_match = true")


def _simulator(path: Path, c: _Collector) -> None:
    """Per model, benchmark (the default's, each device.variants entry's: ``<model>@<variant>``, from the rows'
    ``experiment``) and inputs: the mean and largest |relative error| of each metric over the measured
    configurations (all-resident, a reference without transfers, left out), as ``scripts/device_summary.py`` prints
    it."""
    s = "Simulator vs measured"
    cols = ("inputs", "model", "policy", "metric", "rel_error")
    df = read_csv(path, cols, "simulator validation CSV")
    df = df[df["policy"] != "resident"]
    variants = (split_experiment(str(e))[1] for e in df["experiment"]) if "experiment" in df else (None,) * len(df)
    df = df.assign(bench=[f"{m}@{v}" if v else str(m) for m, v in zip(df["model"], variants, strict=True)])
    for (inputs, bench), g in df.groupby(["inputs", "bench"], sort=False):
        model, _, variant = bench.partition("@")
        sel = f"model={model}, experiment " + (f"*@{variant}" if variant else "without @")
        for metric in SIM_METRICS:
            e = g[g["metric"] == metric]["rel_error"].astype(float).abs().dropna()
            if e.empty:
                continue
            mean, top = float(e.mean()) * 100.0, float(e.max()) * 100.0
            c.add(s, f"sim.{inputs}.{bench}.{metric}", f"{bench}, {inputs} inputs: {metric} error (mean over "
                  f"{len(e)} configurations)", round(mean, 3), f"{mean:.1f} % (at most {top:.1f} %)", path,
                  f"rows:inputs={inputs}, {sel}, metric={metric}, policy != resident: mean of |rel_error|")


# ------------------------------------------------------------------------------------------------ public
def collect_numbers(tables_dir: str | Path, results_dir: str | Path | None = None,
                    comparison: str | Path | None = None, sim_validation: str | Path | None = None,
                    base: str | Path | None = None) -> tuple[list[Number], list[str]]:
    """Every citable number of one rendering, and the inputs that were absent (listed on the page, never guessed).

    ``tables_dir`` holds ``tableN_*.json`` and ``figures/*.json``; ``results_dir`` the archived result CSVs
    (``runs.csv``, ``window.csv``; default ``tables_dir/results``); ``comparison`` defaults to
    ``tables_dir/comparison.json``; ``sim_validation`` to ``results_dir/sim_validation.csv`` where there (the DAG gives
    ``results/device/sim_validation.csv``). ``base``: the directory the source paths are
    written relative to (default ``tables_dir``)."""
    tables_dir = Path(tables_dir)
    if not tables_dir.is_dir():
        raise SpecPrefetchError(f"{tables_dir}: not a directory (the rendered tables)")
    c = _Collector(Path(base) if base is not None else tables_dir)
    comp = Path(comparison) if comparison is not None else tables_dir / "comparison.json"
    if comp.exists() or comparison is not None:
        _claims(comp, c)
    else:
        c.missing.append(c.rel(comp))
    for name, fn in (("table4_overhead.json", _table4), ("table5_matched.json", _table5),
                     ("figures/fig4_budget.json", _fig4), ("figures/fig5_storage.json", _fig5),
                     ("figures/fig6_component.json", _fig6), ("table1_recall.json", _recall),
                     ("table3_params.json", _params)):
        path = tables_dir / name
        doc = _doc(path, c)
        if doc is not None:
            fn(path, doc, c)
    results = Path(results_dir) if results_dir is not None else tables_dir / "results"
    for name, fn2 in (("window.csv", _window), ("runs.csv", _runs)):
        path = results / name
        if path.exists():
            fn2(path, c)
        else:
            c.missing.append(c.rel(path))
    sim = Path(sim_validation) if sim_validation is not None else results / "sim_validation.csv"
    if sim.exists() or sim_validation is not None:
        _simulator(sim, c)
    else:
        c.missing.append(f"{c.rel(sim)} (the simulator's validation: give --sim-validation)")
    if not c.numbers:
        raise SpecPrefetchError(f"{tables_dir}: no rendered table, figure or comparison to take numbers from")
    return c.numbers, c.missing


def render_markdown(numbers: Sequence[Number], missing: Iterable[str], title: str) -> str:
    """One Markdown table per section: key, quantity, value, source (file and where in it)."""
    out = [f"# {title}", "",
           "Generated by `specprefetch write-numbers` (rule `write_numbers`) from the files named in the last column; "
           "do not edit by hand. Gains are paired ratios to OFF in percent with their 95 % bootstrap CI over "
           "repeats; `cell:` is a cell id of the table or figure JSON.", ""]
    section = None
    for n in numbers:
        if n.section != section:
            section = n.section
            out += ["", f"## {section}", "", "| key | quantity | value | source |", "|---|---|---|---|"]
        out.append(f"| `{n.key}` | {n.what} | {n.text} | [{n.source}]({n.source}) `{n.locator}` |")
    missing = list(missing)
    if missing:
        out += ["", "## Not available in this rendering", ""] + [f"- {m}" for m in missing]
    return "\n".join(out) + "\n"


def archive_sim_validation(src: str | Path, archive_dir: str | Path) -> Path:
    """Copy the simulator's validation CSV beside the archived result CSVs (``<out_dir>/results``), after checking it
    has the columns the page reads, so a committed numbers page cites a file that is committed with it."""
    src = Path(src)
    read_csv(src, ("inputs", "model", "policy", "metric", "rel_error"), "simulator validation CSV")
    target = Path(archive_dir) / "sim_validation.csv"
    with atomic_path(target) as tmp:
        shutil.copyfile(src, tmp)
    return target


def write_numbers(tables_dir: str | Path, out_md: str | Path, out_json: str | Path | None = None,
                  results_dir: str | Path | None = None, comparison: str | Path | None = None,
                  sim_validation: str | Path | None = None, title: str = "Measured numbers") -> list[Number]:
    """Write ``numbers.md`` (and ``numbers.json``: the same records) next to the rendering; returns the numbers."""
    out_md = Path(out_md)
    numbers, missing = collect_numbers(tables_dir, results_dir, comparison, sim_validation, base=out_md.parent)
    write_text_atomic(out_md, render_markdown(numbers, missing, title))
    if out_json is not None:
        write_json_atomic(out_json, numbers_json(numbers, missing))
    return numbers


def numbers_json(numbers: Sequence[Number], missing: Iterable[str]) -> dict[str, Any]:
    return {"format": NUMBERS_FORMAT, "numbers": [asdict(n) for n in numbers], "missing": list(missing)}


def numbers_by_key(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``numbers.json`` as key -> record (for tests and readers)."""
    return {str(n["key"]): n for n in doc["numbers"]}
