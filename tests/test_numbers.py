"""The generated numbers page (``specprefetch write-numbers``): every number traces to its source, the committed
pages are current, and the docs quote no dated narrative (issue 29, point 6)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specprefetch.io import SpecPrefetchError
from specprefetch.render.numbers import collect_numbers, numbers_by_key, numbers_json, render_markdown

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden" / "smoke"


def _meta(doc: dict[str, Any], dotted: str) -> Any:
    value: Any = doc["meta"]
    for part in dotted.split("."):
        value = value[part]
    return value


def _check_traces(numbers: list, base: Path) -> int:
    """Each ``cell:``, ``meta:`` and ``summary:`` number equals what its source file holds; returns how many."""
    checked = 0
    for n in numbers:
        kind, _, where = n.locator.partition(":")
        if kind not in ("cell", "meta", "summary"):
            continue
        doc = json.loads((base / n.source).read_text())
        if kind == "cell":
            cell = next(c for c in doc["cells"] if c["id"] == where)
            assert cell["value"] == pytest.approx(n.value), n
            assert (n.lo, n.hi) == (cell.get("lo"), cell.get("hi")), n
        elif kind == "meta":
            assert _meta(doc, where) == n.value, n
        else:
            assert doc["summary"][where] == n.value, n
        checked += 1
    return checked


def test_numbers_from_the_smoke_golden_trace_to_their_cells(tmp_path: Path) -> None:
    tables = tmp_path / "tables"
    shutil.copytree(GOLDEN, tables)
    numbers, missing = collect_numbers(tables)
    keys = {n.key for n in numbers}
    assert {"table4.specprefetch.gain", "table4.off.throughput", "fig4.profiled_m_max", "fig6.both.gain",
            "table1.deepseek-vl2-tiny.specprefetch.recall_at_k", "table3.deepseek-vl2-tiny.specprefetch"} <= keys
    # one budget for every storage, or each storage its own (as the profiled window rule gives on the smoke run)
    assert "table5.m_max" in keys or {"table5.m_max.nvme_cold", "table5.m_max.slow_ufs"} <= keys
    assert "fig5.slow_ufs.gain" in keys and "table5.specprefetch.gain_slow" in keys
    assert _check_traces(numbers, tables) >= 30
    # what is not there is listed, never invented
    assert "comparison.json" in missing and "results/runs.csv" in missing and "results/window.csv" in missing
    assert not any(k.startswith(("claims.", "runs.", "window.", "sim.")) for k in keys)
    # a derived number: the mean of the cells it names
    t1 = json.loads((tables / "table1_recall.json").read_text())
    n = next(x for x in numbers if x.key == "table1.deepseek-vl2-tiny.specprefetch.recall_at_k")
    cells = [c["value"] for c in t1["cells"] if c["keys"]["model"] == "DeepSeek-VL2-Tiny"
             and c["keys"]["method"] == "SpecPrefetch" and c["keys"]["budget"] == "K"]
    assert len(cells) == 5 and n.value == pytest.approx(sum(cells) / 5, abs=1e-4)
    md = render_markdown(numbers, missing, "t")
    assert "| `table4.specprefetch.gain` |" in md and "[table4_overhead.json](table4_overhead.json)" in md


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


RUNS_HEAD = ("platform,model,experiment,policy,storage,m_max,compute_opt,repeat,tokens_per_s,ready_recall,n_tokens,"
             "hits,misses,prefetched,wasted,stall_ms,source,tokens_match,measured_in\n")


def test_numbers_from_hand_made_csvs_and_comparison(tmp_path: Path) -> None:
    """Claims, window, runs and the simulator's error from small inputs whose answers are known."""
    tables = tmp_path / "t"
    (tables / "figures").mkdir(parents=True)
    shutil.copy(GOLDEN / "table4_overhead.json", tables)
    _write(tables / "comparison.json", json.dumps({"summary": {"checkable": 5, "holds": 2, "fails": 1,
                                                               "unresolved": 2, "n/a": 0},
                                                   "claims": [{"id": "a", "verdict_reproduced": "fails"},
                                                              {"id": "b", "verdict_reproduced": "holds"}]}))
    _write(tables / "results" / "window.csv", "platform,model,layer,window_ms,transfer_ms,m_max\n"
           "p,m,1,3.0,1.0,3\np,m,2,5.0,1.0,3\np,m,3,4.0,1.0,4\n")
    _write(tables / "results" / "runs.csv", RUNS_HEAD
           + "p,m,main,off,nvme_cold,0,true,0,5.0,0.1,31,1,1,0,0,1.0,measured,true,main\n"
           + "p,m,main,specprefetch,nvme_cold,4,true,0,6.0,0.4,31,1,1,0,0,1.0,measured,false,main\n"
           + "p,m,matched,off,nvme_cold,0,true,0,5.0,0.1,31,1,1,0,0,1.0,measured,true,main\n"  # reused: once
           + "p,m,main,off,nvme_cold,0,true,1,5.0,0.1,31,1,1,0,0,1.0,simulated,true,main\n")  # not measured
    sim = _write(tmp_path / "sim.csv", "inputs,model,policy,metric,rel_error\n"
                 "run,m,off,tokens_per_s,0.02\nrun,m,specprefetch,tokens_per_s,-0.04\n"
                 "run,m,resident,tokens_per_s,0.5\n")
    numbers, missing = collect_numbers(tables, sim_validation=sim)
    by = numbers_by_key(numbers_json(numbers, missing))
    assert by["claims.holds"]["value"] == 2 and by["claims.unresolved"]["value"] == 2
    assert by["claims.fails.ids"]["value"] == "a"
    assert by["window.m.window_ms"]["value"] == 4.0 and by["window.m.m_max"]["value"] == 4
    assert by["window.m.transfer_ms"]["value"] == 1.0
    assert by["runs.m.count"]["value"] == 2 and by["runs.m.repeats"]["value"] == 1
    assert by["runs.m.tokens_match"]["text"] == "1 of 2"
    assert by["sim.run.m.tokens_per_s"]["value"] == pytest.approx(3.0)  # mean |error| in %, all-resident left out
    assert by["sim.run.m.tokens_per_s"]["source"] == "../sim.csv"
    assert "figures/fig5_storage.json" in missing


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    tables = tmp_path / "t"
    _write(tables / "table4_overhead.json", "{not json")
    with pytest.raises(SpecPrefetchError, match=r"table4_overhead.json:1: not valid JSON"):
        collect_numbers(tables)
    _write(tables / "table4_overhead.json", (GOLDEN / "table4_overhead.json").read_text())
    _write(tables / "comparison.json", json.dumps({"summary": {"holds": 1}}))
    with pytest.raises(SpecPrefetchError, match=r"comparison.json: summary: missing key 'checkable'"):
        collect_numbers(tables)
    with pytest.raises(SpecPrefetchError, match="not a directory"):
        collect_numbers(tmp_path / "nothing")
    res = subprocess.run([sys.executable, "-m", "specprefetch", "write-numbers", "--tables-dir", str(tables),
                          "--out", str(tmp_path / "n.md")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "missing key 'checkable'" in res.stderr
    assert not (tmp_path / "n.md").exists()


def test_cli_archives_the_simulator_validation_so_the_page_is_self_contained(tmp_path: Path) -> None:
    """The rule's call: the simulator's validation is copied beside the archived CSVs and the page cites the copy,
    so a committed page regenerates from the committed directory alone."""
    tables = tmp_path / "paper_tables"
    shutil.copytree(GOLDEN, tables)
    sim = _write(tmp_path / "results" / "device" / "sim_validation.csv", "inputs,model,policy,metric,rel_error\n"
                 "profile,m,fate,tokens_per_s,0.1\nprofile,m,fate,stall_ms,-0.3\n")
    res = subprocess.run([sys.executable, "-m", "specprefetch", "write-numbers", "--tables-dir", str(tables),
                          "--sim-validation", str(sim), "--archive-dir", str(tables / "results"),
                          "--out", str(tables / "numbers.md")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tables / "results" / "sim_validation.csv").read_bytes() == sim.read_bytes()
    page = json.loads((tables / "numbers.json").read_text())
    by = numbers_by_key(page)
    assert by["sim.profile.m.tokens_per_s"]["source"] == "results/sim_validation.csv"
    assert by["sim.profile.m.stall_ms"]["value"] == pytest.approx(30.0)
    numbers, missing = collect_numbers(tables)  # no flags: everything from the directory itself
    assert json.loads(json.dumps(numbers_json(numbers, missing))) == page
    # a variant's benchmark (its rows' experiment "<exp>@<variant>", validate-simulator --variant) gets its own keys
    both = _write(tmp_path / "both.csv", "inputs,model,experiment,policy,metric,rel_error\n"
                  "profile,m,sweep,fate,tokens_per_s,0.1\nprofile,m,sweep@fifo,fate,tokens_per_s,-0.3\n")
    by = numbers_by_key(numbers_json(*collect_numbers(tables, sim_validation=both)))
    assert by["sim.profile.m.tokens_per_s"]["value"] == pytest.approx(10.0)
    assert by["sim.profile.m@fifo.tokens_per_s"]["value"] == pytest.approx(30.0)
    assert "experiment *@fifo" in by["sim.profile.m@fifo.tokens_per_s"]["locator"]


@pytest.mark.parametrize("where, args", [
    ("paper_tables", {}),
    ("docs/precise-run", {"results_dir": "docs/precise-run"}),
])
def test_committed_numbers_pages_are_current(where: str, args: dict[str, str]) -> None:
    """The committed numbers.md/.json are what write-numbers makes from the committed files beside them: a run that
    changes a table without regenerating the page (rule write_numbers does) fails here."""
    base = REPO / where
    numbers, missing = collect_numbers(base, **{k: REPO / v for k, v in args.items()}, base=base)
    committed = json.loads((base / "numbers.json").read_text())
    assert committed == json.loads(json.dumps(numbers_json(numbers, missing)))
    title = (base / "numbers.md").read_text().splitlines()[0].removeprefix("# ")
    assert (base / "numbers.md").read_text() == render_markdown(numbers, missing, title)
    assert _check_traces(numbers, base) >= 40


# ------------------------------------------------------------------------------------------ the docs
DOC_FILES = sorted([REPO / "README.md", REPO / "ARCHITECTURE.md", *(REPO / "docs").rglob("*.md")])
GENERATED = {"numbers.md", "comparison.md", "summary.md"}  # written by the pipeline's commands, not by hand
DATED = [
    (re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a calendar date"),
    (re.compile(r"\b\d\d:\d\d(?:[–-]\d\d:\d\d)?\s*UTC\b"), "a clock time"),
    (re.compile(r"\b(?:[01]\d|2[0-3]):[0-5]\d\b"), "a clock time"),
    (re.compile(r"hours? (?:apart|earlier|later|ago)", re.I), "a run compared by when it ran"),
    (re.compile(r"\b(?:today|yesterday|this morning|this afternoon)\b", re.I), "a day"),
    (re.compile(r"\bthe committed run(?:'s)? hour\b|\bon a (?:good|bad|slow|faster) hour\b", re.I), "an hour"),
]


def test_the_docs_tell_no_dated_narrative() -> None:
    """No "on 2026-12-02", "two hours apart" or "16:15" in the hand-written docs: a measurement is cited through a
    generated file (paper_tables/numbers.md), not as a story of when it was taken."""
    bad = []
    for path in DOC_FILES:
        if path.name in GENERATED:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern, what in DATED:
                if m := pattern.search(line):
                    bad.append(f"{path.relative_to(REPO)}:{i}: {what}: {m.group(0)!r}")
    assert not bad, "\n".join(bad)


def test_the_docs_link_the_numbers_pages() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "paper_tables/numbers.md" in readme
    for path in (REPO / "paper_tables" / "numbers.md", REPO / "docs" / "precise-run" / "numbers.md"):
        assert path.is_file(), path
