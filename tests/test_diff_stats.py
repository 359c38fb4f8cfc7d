"""The statistical table diff (``specprefetch diff-tables``, ``render/diff.py``): a measured cell (mean over repeats
with ``n`` and ``std``) is judged by Welch's t on the two means, Bonferroni over the cells judged, combined with a
between-run allowance; a cell without ``n``/``std`` falls back to the fixed tolerance and says so. Every number here
is built in the test (no committed file's values)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_render import ROOT, _run_cli

from specprefetch.render.cells import Cell, TableDoc, t_quantile
from specprefetch.render.diff import (
    BETWEEN_RUN,
    FAMILY_LEVEL,
    Allowance,
    DiffError,
    Tolerances,
    diff_docs,
    t_ppf,
    t_sf,
    welch,
)

CONFIG = str(ROOT / "config" / "config.yaml")


def measured(cid: str, quantity: str, mean: float, ci: float | None, n: int | None = 6) -> Cell:
    """A device cell as the renderer writes it: ``mean ± ci`` (the 95 % half-width of the table's text), with the
    std that gives that half-width over ``n`` repeats; ``ci=None``: a cell without n/std (one repeat, old JSON)."""
    if ci is None:
        return Cell(cid, quantity, mean, {"policy": cid.split("/")[0]})
    assert n is not None
    if n == 1:  # one repeat: the renderer writes std 0 and a CI of zero width
        return Cell(cid, quantity, mean, {"policy": cid.split("/")[0]}, std=0.0, n=1, lo=mean, hi=mean)
    std = ci * math.sqrt(n) / t_quantile(n - 1)
    return Cell(cid, quantity, mean, {"policy": cid.split("/")[0]}, std=std, n=n, lo=mean - ci, hi=mean + ci)


def write(d: Path, cells: list[Cell], name: str = "table5_matched") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    TableDoc(name, name, "embedded", cells).write(d / f"{name}.json")
    return d


def old_rule(tmp_path: Path) -> str:
    """config.yaml's tolerances with the statistical test switched off (``between_run: false``): the old rule."""
    tol = yaml.safe_load(Path(CONFIG).read_text())["render"]["tolerances"]
    for entry in tol["default"].values():
        entry["between_run"] = False
    path = tmp_path / "old_rule.yaml"
    path.write_text(yaml.safe_dump({"render": {"tolerances": tol}}))
    return str(path)


# ------------------------------------------------------------------------------------------------- the four cases


def test_a_halved_gain_fails_where_the_fixed_tolerance_passed(tmp_path: Path) -> None:
    old = write(tmp_path / "old", [measured("SpecPrefetch/gain_slow", "gain", 11.5, 1.5)])
    new = write(tmp_path / "new", [measured("SpecPrefetch/gain_slow", "gain", 5.7, 1.5)])
    rc, out = _run_cli("diff-tables", str(old), str(new), "--tolerances", old_rule(tmp_path))
    assert rc == 0 and "gain tolerance ±10 abs" in out, out  # the old ±10 pp let it through
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG)
    assert rc == 1, out
    line = next(x for x in out.splitlines() if "SpecPrefetch/gain_slow" in x)
    assert line.startswith("  FAIL  SpecPrefetch/gain_slow: 11.5 ± 1.5 (n=6) -> 5.7 ± 1.5 (n=6): Δ -5.8"), line
    assert "outside ±" in line and "gain by CI: Welch t" in line and "between-run ±2 (2 abs or 15% rel)" in line
    assert "rule: 1 measured cell(s) judged by Welch's t" in out and "95% family-wise" in out


def test_b_gains_that_differ_by_what_their_cis_allow_pass(tmp_path: Path) -> None:
    old = write(tmp_path / "old", [measured("SpecPrefetch/gain_cold", "gain", 38.3, 4.0)])
    new = write(tmp_path / "new", [measured("SpecPrefetch/gain_cold", "gain", 34.0, 4.5)])
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG)
    assert rc == 0 and "RESULT: OK (0 failure(s), 1 move(s) within tolerance)" in out, out
    assert "ok    SpecPrefetch/gain_cold: 38.3 ± 4 (n=6) -> 34 ± 4.5 (n=6): Δ -4.3" in out and "within ±" in out
    # with no between-run allowance at all the CIs alone still allow it (|t| = 1.4 on ~10 df)
    w = welch(measured("x", "gain", 38.3, 4.0), measured("x", "gain", 34.0, 4.5), 0.95, Allowance())
    assert w.passes and abs(w.diff) / w.se == pytest.approx(1.84, abs=0.01) and 9.5 < w.df < 10.5


def test_c_a_table_against_itself_passes(tmp_path: Path) -> None:
    cells = [measured("OFF/throughput", "throughput", 7.7, 0.6), measured("SpecPrefetch/gain", "gain", 38.3, 4.0),
             measured("SpecPrefetch/ready_recall", "ready_recall", 45.6, 3.4),
             Cell("peak_m_max", "m_max", 16.0), measured("FATE/gain", "gain", 11.1, None)]
    d = write(tmp_path / "t", cells)
    rc, out = _run_cli("diff-tables", str(d), str(d), "--config", CONFIG)
    assert rc == 0 and "table5_matched: 5 cells, identical" in out, out
    assert "RESULT: OK (0 failure(s), 0 move(s) within tolerance)" in out
    assert "rule: 3 measured cell(s)" in out  # identical cells count in the family


def test_d_a_measured_cell_without_n_or_std_falls_back_and_says_so(tmp_path: Path) -> None:
    old = write(tmp_path / "old", [measured("SpecPrefetch/gain_slow", "gain", 11.5, 1.5),
                                   measured("FATE/gain_cold", "gain", 38.3, 4.0)])
    new = write(tmp_path / "new", [measured("SpecPrefetch/gain_slow", "gain", 5.7, None),
                                   measured("FATE/gain_cold", "gain", 20.0, 4.0, n=1)])
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG)
    assert rc == 1, out
    assert ("ok    SpecPrefetch/gain_slow: 11.5 -> 5.7 (-5.8, -50.4%; gain tolerance ±10 abs; no n/std in NEW: "
            "fixed tolerance)") in out
    assert "FAIL  FATE/gain_cold: 38.3 -> 20 (-18.3, -47.8%; gain tolerance ±10 abs; n = 1 in NEW: fixed tolerance)" \
        in out
    assert "rule:" not in out  # no cell was judged by the test


# ------------------------------------------------------------------------------------------------- host drift, scope


def test_throughput_is_judged_with_the_host_drift_allowance(tmp_path: Path) -> None:
    """An absolute throughput moves with the host (a 30 % faster host moves every one) far beyond its within-run CI:
    within the stated relative allowance it passes; a halving fails; pure Welch would fail the honest move."""
    old = write(tmp_path / "old", [measured("OFF/throughput", "throughput", 7.68, 0.2),
                                   measured("All resident/throughput", "throughput", 24.9, 0.5)], "table4_overhead")
    new = write(tmp_path / "new", [measured("OFF/throughput", "throughput", 3.8, 0.2),
                                   measured("All resident/throughput", "throughput", 24.9 * 1.3, 0.5)],
                "table4_overhead")
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG)
    assert rc == 1 and "RESULT: FAIL (1 failure(s), 1 move(s) within tolerance)" in out, out
    assert "FAIL  OFF/throughput: 7.68" in out and "ok    All resident/throughput: 24.9" in out
    assert "between-run ±" in out and "(35% rel)" in out
    pure = welch(measured("x", "throughput", 24.9, 0.5), measured("x", "throughput", 24.9 * 1.3, 0.5), 0.95,
                 Allowance())
    assert not pure.passes  # the within-run CIs alone cannot see the host


def test_where_the_between_run_allowance_comes_from(tmp_path: Path) -> None:
    tol = Tolerances()
    assert tol.get("table4_overhead", "gain").between_run == BETWEEN_RUN["gain"] == Allowance(2.0, 0.15)
    for exact in ("recall", "params", "cosine"):
        assert tol.get("table1_recall", exact).between_run is None, exact
    assert tol.get("fig_budget_rules", "m_max").between_run == BETWEEN_RUN["m_max"] == Allowance(1.0, 0.35)
    spec = {"default": {"gain": {"abs": 10.0, "between_run": {"abs": 1.0}}},
            "table4_overhead": {"gain": {"abs": 5.0, "between_run": False}, "throughput": {"rel": 0.2}},
            "table1_recall": {"recall": {"abs": 0.5, "between_run": {"abs": 0.0}}}}
    tol = Tolerances(spec)
    assert tol.get("table5_matched", "gain").between_run == Allowance(1.0, 0.0)  # default's
    assert tol.get("table4_overhead", "gain").between_run is None  # the table's false: fixed only
    assert tol.get("table4_overhead", "gain").abs == 5.0
    assert tol.get("table4_overhead", "throughput").between_run == BETWEEN_RUN["throughput"]  # built-in
    assert tol.get("table1_recall", "recall").between_run == Allowance()  # seed CIs judged by the test
    assert Allowance(2.0, 0.15).at(40.0, -2.0) == pytest.approx(6.0)  # the larger magnitude: symmetric
    assert Allowance(2.0, 0.15).at(-2.0, 40.0) == Allowance(2.0, 0.15).at(40.0, -2.0)
    # recall is not judged by its seed CI unless asked: a rerun with the same seeds reproduces it exactly
    old = write(tmp_path / "old", [measured("M/OCR/ProMoE/R@6", "recall", 86.9, 1.0, n=3)], "table1_recall")
    new = write(tmp_path / "new", [measured("M/OCR/ProMoE/R@6", "recall", 87.7, 1.0, n=3)], "table1_recall")
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG)
    assert rc == 1 and "recall tolerance ±0.5 abs)" in out, out
    tol_file = tmp_path / "tol.yaml"
    tol_file.write_text(yaml.safe_dump({"tolerances": spec}))
    rc, out = _run_cli("diff-tables", str(old), str(new), "--tolerances", str(tol_file))
    assert rc == 0 and "recall by CI: Welch t" in out, out


def test_ignore_wins_over_the_test(tmp_path: Path) -> None:
    old = write(tmp_path / "old", [measured("SpecPrefetch/gain", "gain", 11.5, 0.5)])
    new = write(tmp_path / "new", [measured("SpecPrefetch/gain", "gain", 1.0, 0.5)])
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", str(ROOT / "config" / "smoke.yaml"))
    assert rc == 0 and "gain tolerance ignored" in out and "rule:" not in out, out


def test_bonferroni_over_the_cells_judged(tmp_path: Path) -> None:
    """The per-cell level is 1 - 0.05 / (cells judged): the same move that passes alone can fail with fewer cells
    and pass with more, and the t quantile used is Welch's at that level."""
    a, b = measured("G/gain", "gain", 20.0, 3.0), measured("G/gain", "gain", 27.0, 3.0)
    one = diff_docs({"t": TableDoc("t", "", "", [a])}, {"t": TableDoc("t", "", "", [b])}, Tolerances())
    fillers = [measured(f"F{i}/throughput", "throughput", 5.0, 0.1) for i in range(49)]
    many = diff_docs({"t": TableDoc("t", "", "", [a, *fillers])}, {"t": TableDoc("t", "", "", [b, *fillers])},
                     Tolerances())
    assert (one.n_judged, many.n_judged) == (1, 50)
    assert one.cell_level == pytest.approx(FAMILY_LEVEL) and many.cell_level == pytest.approx(1 - 0.05 / 50)
    w1, w50 = one.moves[0].judged, many.moves[0].judged
    assert w1 is not None and w50 is not None and w1.df == pytest.approx(w50.df)
    assert w1.t == pytest.approx(t_ppf(1 - 0.05 / 2, w1.df)) and w50.t == pytest.approx(t_ppf(1 - 0.05 / 100, w1.df))
    assert one.failed and not many.failed  # |Δ| 7 against ±5.5 and ±8.6


def test_t_distribution_matches_the_tables() -> None:
    for df in range(1, 31):
        assert t_ppf(0.975, df) == pytest.approx(t_quantile(df), abs=2e-3), df
    assert t_ppf(0.995, 10) == pytest.approx(3.1693, abs=1e-4)
    assert t_ppf(0.9995, 5) == pytest.approx(6.8688, abs=1e-4)
    assert t_ppf(0.975, 1e7) == pytest.approx(1.95996, abs=1e-4)
    assert t_sf(0.0, 7.3) == pytest.approx(0.5) and t_sf(-2.0, 4) == pytest.approx(1 - t_sf(2.0, 4))
    assert t_sf(t_ppf(0.99, 6.4), 6.4) == pytest.approx(0.01, rel=1e-9)
    with pytest.raises(ValueError):
        t_ppf(0.4, 3)


def test_honest_reruns_fail_at_the_stated_rate_and_a_halving_is_caught() -> None:
    """Calibration: two honest runs of one quantity (same mean, n = 6 each) fail the per-cell test at 95 % about
    5 % of the time without a between-run allowance; a halved 11.5 pp gain with ~1.5 pp CIs fails in a diff of 70
    measured cells (Bonferroni) about 83 % of the time (the point estimate: |Δ| 5.75 against ±4.5; the rest are
    draws whose std came out large)."""
    rng = np.random.default_rng(0)
    fails = halved = 0
    trials = 3000
    for _ in range(trials):
        x, y, z = rng.normal(11.5, 1.4, 6), rng.normal(11.5, 1.4, 6), rng.normal(5.75, 1.4, 6)
        cx, cy, cz = (Cell("g", "gain", float(v.mean()), std=float(v.std(ddof=1)), n=6) for v in (x, y, z))
        fails += not welch(cx, cy, 0.95, Allowance()).passes
        halved += not welch(cx, cz, 1 - 0.05 / 70, BETWEEN_RUN["gain"]).passes
    assert 0.035 < fails / trials < 0.065, fails / trials
    assert halved / trials > 0.8, halved / trials


# ------------------------------------------------------------------------------------------------- bad input


def test_bad_tolerances_and_cells_are_one_clear_line(tmp_path: Path) -> None:
    good = write(tmp_path / "old", [measured("SpecPrefetch/gain", "gain", 11.5, 1.5)])
    for i, (spec, expect) in enumerate([
            ({"default": {"gain": {"abs": 10, "between_run": {"rel": -1}}}}, "between_run"),
            ({"default": {"gain": {"abs": 10, "between_run": True}}}, "between_run"),
            ({"default": {"gain": {"abs": 10, "between_run": {"relative": 0.1}}}}, "between_run")]):
        path = tmp_path / f"tol{i}.yaml"
        path.write_text(yaml.safe_dump({"render": {"tolerances": spec}}))
        rc, out = _run_cli("diff-tables", str(good), str(good), "--tolerances", str(path))
        errors = [x for x in out.splitlines() if x.startswith("specprefetch ")]
        assert rc == 2 and len(errors) == 1 and f"{path}: tolerances" in errors[0] and expect in errors[0], out
        assert "Traceback" not in out
    bad = write(tmp_path / "bad", [Cell("SpecPrefetch/gain", "gain", 5.7, std=-1.0, n=6)])
    rc, out = _run_cli("diff-tables", str(good), str(bad), "--config", CONFIG)
    errors = [x for x in out.splitlines() if x.startswith("specprefetch ")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in out, out
    assert f"{bad}: table table5_matched: cell 'SpecPrefetch/gain': std -1.0 is not a standard deviation" in errors[0]
    with pytest.raises(DiffError, match="tolerances"):
        Tolerances({"default": {"gain": {"between_run": {"abs": "x"}}}})


# ------------------------------------------------------------------------------------------------- the sweep's argmax


def sweep(tp: dict[int, tuple[float, float]], peak: int) -> list[Cell]:
    """Figure 4's cells: throughput ± CI per M_max, and the argmax ``peak_m_max``."""
    return [*(measured(f"M{m}/throughput", "throughput", v, ci) for m, (v, ci) in tp.items()),
            Cell("peak_m_max", "m_max", float(peak))]


def test_the_sweeps_argmax_may_move_within_a_tie_but_not_past_one(tmp_path: Path) -> None:
    """``peak_m_max`` is the argmax of noisy means: it may move between two budgets that are a tie by their CIs in
    both renderings (a flat peak), not to a budget that is clearly faster or slower; without the points' n/std it is
    compared exactly."""
    flat_old = {4: (11.06, 0.35), 8: (11.04, 0.48), 16: (11.12, 0.46)}
    flat_new = {4: (8.71, 0.14), 8: (8.64, 0.13), 16: (8.60, 0.13)}
    old = write(tmp_path / "old", sweep(flat_old, 16), "fig4_budget")
    new = write(tmp_path / "new", sweep(flat_new, 4), "fig4_budget")
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG)
    assert rc == 0, out
    assert "ok    peak_m_max: 16 -> 4 (the sweep's argmax, a tie by CI where measured: OLD M16/throughput 11.12" in out
    steep_new = {4: (10.1, 0.14), 8: (10.6, 0.13), 16: (12.4, 0.13)}  # NEW clearly peaks at 16 ...
    steep_old = {4: (12.4, 0.14), 8: (10.6, 0.13), 16: (10.1, 0.13)}  # ... where OLD clearly peaked at 4
    old = write(tmp_path / "old2", sweep(steep_old, 4), "fig4_budget")
    new = write(tmp_path / "new2", sweep(steep_new, 16), "fig4_budget")
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG)
    assert rc == 1 and "FAIL  peak_m_max: 4 -> 16 (the sweep's argmax, not a tie by CI: OLD M4/throughput" in out, out
    bare = {m: (v, None) for m, (v, _) in flat_new.items()}
    new = write(tmp_path / "new3", [*(measured(f"M{m}/throughput", "throughput", v, None) for m, (v, _) in
                                      bare.items()), Cell("peak_m_max", "m_max", 4.0)], "fig4_budget")
    rc, out = _run_cli("diff-tables", str(tmp_path / "old"), str(new), "--config", CONFIG)
    assert rc == 1 and "FAIL  peak_m_max: 16 -> 4 (-12, -75.0%; m_max tolerance exact" in out, out
    # with the throughputs judged by the fixed tolerance only (the old rule), the argmax is compared exactly
    rc, out = _run_cli("diff-tables", str(tmp_path / "old"), str(tmp_path / "new"), "--tolerances", old_rule(tmp_path))
    assert rc == 1 and "FAIL  peak_m_max: 16 -> 4 (-12, -75.0%; m_max tolerance exact" in out, out


def test_budgets_the_host_chose_move_by_a_reruns_step(tmp_path: Path) -> None:
    """Two honest reruns whose window profiles chose other budgets (issue 28): a budget cell may move by one step of
    the floor (or 35 % of itself), a cell measured at a budget that moved within that may move past its tolerance
    (another configuration), a point a rule chose may vanish, and a variant's sweep peak may move within a tie
    measured by the one rendering that has both points. A budget moving further, a cell past its tolerance at the
    same budget, or a grid point vanishing still fail."""
    def budget(m: float) -> Cell:
        return Cell("slow_ufs/window/budget", "m_max", m, {"storage": "slow_ufs", "m_max": m}, std=0.0, n=6,
                    lo=m, hi=m)

    def gain(v: float, m: int) -> Cell:
        return Cell("bandwidth:slow_ufs/gain", "gain", v, {"storage": "slow_ufs", "m_max": m}, std=1.8, n=6,
                    lo=v - 1.9, hi=v + 1.9)

    def point(m: int, v: float, chosen: bool = False) -> Cell:
        c = measured(f"fifo:M{m}/throughput", "throughput", v, 0.2)
        return Cell(c.id, c.quantity, c.value, {"m_max": m, "variant": "fifo", **({"chosen": True} if chosen else {})},
                    std=c.std, n=c.n, lo=c.lo, hi=c.hi)

    def run(name: str, cells: list[Cell], table: str = "fig5_storage") -> str:
        return str(write(tmp_path / name, cells, table))

    rc, out = _run_cli("diff-tables", run("a", [budget(5)], "fig_budget_rules"),
                       run("b", [budget(4)], "fig_budget_rules"), "--config", CONFIG)
    assert rc == 0 and "ok    slow_ufs/window/budget: 5 ± 0 (n=6) -> 4 ± 0 (n=6)" in out and "m_max by CI" in out, out
    rc, out = _run_cli("diff-tables", str(tmp_path / "a"), run("c", [budget(2)], "fig_budget_rules"),
                       "--config", CONFIG)
    assert rc == 1 and "FAIL  slow_ufs/window/budget: 5 ± 0 (n=6) -> 2 ± 0" in out, out
    # a gain at another budget: past its tolerance (24.5 -> 38.9 %), but one step of the budget explains it
    rc, out = _run_cli("diff-tables", run("g1", [gain(24.5, 2)]), run("g2", [gain(38.9, 3)]), "--config", CONFIG)
    assert rc == 0 and "past its tolerance, but measured at M_max 2 in OLD, 3 in NEW: another configuration; the " \
        "budget moved by +1, within ±1.05" in out, out
    assert "1 of them cells measured at another budget or only where a rule chose it" in out
    rc, out = _run_cli("diff-tables", str(tmp_path / "g1"), run("g3", [gain(38.9, 2)]), "--config", CONFIG)
    assert rc == 1 and "FAIL  bandwidth:slow_ufs/gain: 24.5" in out and "by CI" in out, out  # same budget: judged
    rc, out = _run_cli("diff-tables", str(tmp_path / "g1"), run("g4", [gain(38.9, 6)]), "--config", CONFIG)
    assert rc == 1 and "the budget moved by +4, past ±2.1" in out, out
    rc, out = _run_cli("diff-tables", str(tmp_path / "g1"), run("g5", [gain(25.0, 6)]), "--config", CONFIG)
    assert rc == 0 and "another configuration" not in out, out  # within its tolerance: passes as any cell
    # FIFO sweep: OLD measured M8 (grid) and not M5 (the window rule's on NEW's host); NEW measured both, a tie
    old = [point(4, 7.1), point(8, 8.1), Cell("fifo:peak_m_max", "m_max", 8.0, {"variant": "fifo"})]
    new = [point(4, 7.2), point(5, 8.12, chosen=True), point(8, 8.08),
           Cell("fifo:peak_m_max", "m_max", 5.0, {"variant": "fifo"})]
    rc, out = _run_cli("diff-tables", run("f1", old, "fig4_budget"), run("f2", new, "fig4_budget"), "--config", CONFIG)
    assert rc == 0 and "ok    fifo:M5/throughput: added (8.12) (a configuration a rule chose" in out, out
    assert "ok    fifo:peak_m_max: 8 -> 5 (the sweep's argmax, a tie by CI where measured: OLD did not measure " \
        "both M8 and M5; NEW fifo:M8/throughput" in out, out
    steep = [point(4, 7.2), point(5, 9.5, chosen=True), point(8, 8.08),
             Cell("fifo:peak_m_max", "m_max", 5.0, {"variant": "fifo"})]
    rc, out = _run_cli("diff-tables", str(tmp_path / "f1"), run("f3", steep, "fig4_budget"), "--config", CONFIG)
    assert rc == 1 and "FAIL  fifo:peak_m_max: 8 -> 5 (the sweep's argmax, not a tie by CI" in out, out
    rc, out = _run_cli("diff-tables", str(tmp_path / "f2"), run("f4", old[1:], "fig4_budget"), "--config", CONFIG)
    assert rc == 1 and "FAIL  fifo:M4/throughput: removed" in out, out  # a grid point vanishing still fails


def _comparison(d: Path, verdicts: dict[str, str], tests: dict[str, list[dict]] | None = None) -> None:
    import json

    claims = [{"id": cid, "statement": f"claim {cid}", "verdict_reproduced": v, "device": not cid.startswith("t1"),
               **({"tests": tests[cid]} if tests and cid in tests else {})} for cid, v in verdicts.items()]
    (d / "comparison.json").write_text(json.dumps({"profile": "embedded", "claims": claims}))


def _test(mean: float, half: float = 1.0, key: str = "", **kw: object) -> dict:
    return {"key": key, "mean": mean, "lo": mean - half, "hi": mean + half, "n": 6, **kw}


def test_device_claim_verdicts_of_a_rerun(tmp_path: Path) -> None:
    """Issue 28's test of a rerun, the same verdict for every device claim: diff-tables lists the device claims
    whose verdict moved (a note; a failure with --strict-verdicts), never a recall claim; --strict-verdicts without
    a comparison.json is one line."""
    cells = [measured("SpecPrefetch/gain_slow", "gain", 11.5, 1.5)]
    old, new = write(tmp_path / "old", cells), write(tmp_path / "new", cells)
    _comparison(old, {"t4_specprefetch_faster": "holds", "f5_gain_grows": "unresolved", "t1_best": "fails"})
    _comparison(new, {"t4_specprefetch_faster": "holds", "f5_gain_grows": "holds", "t1_best": "holds"})
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG)
    assert rc == 0 and "claims: 2 device claim(s) in both renderings, 1 with another verdict" in out, out
    assert "  note  f5_gain_grows: unresolved in OLD, holds in NEW (claim f5_gain_grows)" in out
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG, "--strict-verdicts")
    assert rc == 1 and "  FAIL  f5_gain_grows" in out and "RESULT: FAIL (1 failure(s)" in out, out
    _comparison(new, {"t4_specprefetch_faster": "holds", "f5_gain_grows": "unresolved"})
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG, "--strict-verdicts")
    assert rc == 0 and "1 with another verdict" not in out and "(every verdict the same)" in out, out
    (new / "comparison.json").unlink()
    rc, out = _run_cli("diff-tables", str(old), str(new), "--config", CONFIG, "--strict-verdicts")
    assert rc == 2 and "Traceback" not in out and "has none" in out, out


def test_verdicts_across_runs(tmp_path: Path) -> None:
    """compare-verdicts: each device claim's verdict per run and the one they support together (the shared one,
    else unresolved); a claim one run lacks is 'not in every run', not a disagreement; --strict fails on a
    disagreement; a rendering without comparison.json, or a single one, is one line."""
    runs = [tmp_path / f"r{i}" for i in range(3)]
    for d, (a, b) in zip(runs, [("holds", "holds"), ("holds", "unresolved"), ("holds", "fails")], strict=True):
        d.mkdir()
        _comparison(d, {"t4_specprefetch_faster": a, "f5_slow_over_cold": b, "t1_best": "fails"})
    _comparison(runs[2], {"t4_specprefetch_faster": "holds", "f5_slow_over_cold": "fails", "t1_best": "fails",
                          "x_new_claim": "holds"})
    rc, out = _run_cli("compare-verdicts", *map(str, runs))
    assert rc == 0, out
    assert "| `t4_specprefetch_faster` claim t4_specprefetch_faster | holds | holds | holds | **holds** |" in out
    assert "| holds | unresolved | fails | **unresolved** (runs disagree) |" in out
    assert "| – | – | holds | **unresolved** (not in every run) |" in out and "t1_best" not in out
    assert ("1 of 3 device claims give the same verdict in all 3 runs; 1 differ: f5_slow_over_cold; 1 not in every "
            "run: x_new_claim; 1 contradict (one run holds, another fails): f5_slow_over_cold") in out
    rc, out = _run_cli("compare-verdicts", "--strict", *map(str, runs))
    assert rc == 1, out
    rc, out = _run_cli("compare-verdicts", "--strict", str(runs[0]), str(runs[0]))
    assert rc == 0 and "2 of 2 device claims give the same verdict in all 2 runs" in out, out
    for bad in ([str(runs[0])], [str(runs[0]), str(tmp_path)]):
        rc, out = _run_cli("compare-verdicts", *bad)
        assert rc == 2 and "Traceback" not in out and ("two or more" in out or "no comparison.json" in out), out


def test_verdicts_across_runs_pool_the_runs_effects(tmp_path: Path) -> None:
    """Runs that keep their tests are pooled where they do not all decide a claim alike: each run's effect one value,
    its mean's 95 % t-interval over the runs (t with k - 1 df), decided as the run's test is; runs that all hold (or
    all fail) keep that verdict; tests that do not match (other keys) fall back to the verdicts; a malformed test is
    one line."""
    from specprefetch.render.claims import Test, Verdict
    from specprefetch.render.diff import pool_runs

    runs = [tmp_path / f"r{i}" for i in range(3)]
    rows = {  # claim: (verdict per run, effect per run)
        "f5_slow_over_cold": (["holds", "unresolved", "holds"], [10.2, -2.5, 15.5]),  # the hours disagree
        "t5_slow_over_cold": (["holds", "unresolved", "holds"], [5.0, 6.0, 7.0]),  # one run's CI too wide
        "f4_bounded_peak": (["holds", "holds", "holds"], [0.56, 0.80, 0.30]),  # every hour: holds
    }
    for i, d in enumerate(runs):
        d.mkdir()
        _comparison(d, {cid: vs[i] for cid, (vs, _) in rows.items()} | {"x_keys": "unresolved"},
                    {cid: [_test(es[i], rule="positive")] for cid, (_, es) in rows.items()}
                    | {"x_keys": [_test(1.0, key=f"k{i}")]})
    rc, out = _run_cli("compare-verdicts", *map(str, runs))
    assert rc == 0, out
    assert "| holds | unresolved | holds | **unresolved** (runs disagree) | +7.73 [-15.2, +30.7] |" in out, out
    assert "| holds | unresolved | holds | **holds** (runs disagree) | +6 [+3.52, +8.48] |" in out, out
    assert "| holds | holds | holds | **holds** | +0.553 [-0.0679, +1.17] |" in out, out
    assert "| unresolved | unresolved | unresolved | **unresolved** | – |" in out, out  # keys differ: not pooled
    assert "Across runs: 2 holds, 2 unresolved" in out, out
    # an inverted test (profiled_at_peak: a lead of the peak fails the claim) and a tolerance, pooled
    lead = [(Test.from_json(_test(m, inverted=True)),) for m in (1.0, 1.2, 1.1)]
    assert pool_runs(lead)[0] is Verdict.FAILS
    loss = [(Test.from_json(_test(m, rule="within", tolerance=3.0, key="nvme_cold")),) for m in (0.5, 1.0, 0.0)]
    assert pool_runs(loss) == (Verdict.HOLDS, "+0.5 [-0.742, +1.74]")
    assert pool_runs(loss[:1]) is None and pool_runs([*loss[:2], ()]) is None
    _comparison(runs[2], {"f4_bounded_peak": "holds"}, {"f4_bounded_peak": [{"mean": 1.0, "rule": "sideways"}]})
    rc, out = _run_cli("compare-verdicts", *map(str, runs))
    assert rc == 2 and "Traceback" not in out and "claim 'f4_bounded_peak': tests:" in out, out


def test_a_run_judged_across_hours_with_the_spread_between_runs(tmp_path: Path) -> None:
    """A device claim judged across hours: each run's CI widened by t_{0.975, k-1} times the runs' standard
    deviation beyond their own CIs (method of moments), in quadrature. An effect the hours move across 0 is
    unresolved in every run; a large one holds in every run; runs that agree within their CIs keep their own CI; no
    run contradicts another; compare-verdicts shows each run judged so."""
    from specprefetch.render.claims import Spread, Test, Verdict, judge_across_runs

    def tests(means: list[float], half: float, **kw: object) -> list[tuple[Test, ...]]:
        return [(Test.from_json(_test(m, half, **kw)),) for m in means]

    near_zero = tests([10.2, -2.5, 15.5], 1.0)  # the slow-over-cold gain in three runs: the hours disagree
    sp = Spread.of([t for (t,) in near_zero])
    between, within = np.var([10.2, -2.5, 15.5], ddof=1), (1.0 / 1.959964) ** 2
    assert sp is not None and sp.k == 3 and sp.tau == pytest.approx(math.sqrt(between - within))
    assert sp.margin == pytest.approx(4.303 * sp.tau)
    wide = sp.widen(near_zero[0][0].ci)
    assert wide.mean == 10.2 and wide.lo == pytest.approx(10.2 - math.hypot(1.0, sp.margin))
    assert [judge_across_runs(run, near_zero)[0] for run in near_zero] == [Verdict.UNRESOLVED] * 3
    assert "with the spread between runs contains 0" in judge_across_runs(near_zero[0], near_zero)[1]
    large = tests([30.0, 25.0, 35.0], 2.0)
    assert [judge_across_runs(run, large)[0] for run in large] == [Verdict.HOLDS] * 3
    agreeing = tests([5.0, 5.1, 4.9], 1.0)  # the runs agree within their own CIs: tau 0, each CI as it was
    sp = Spread.of([t for (t,) in agreeing])
    assert sp is not None and sp.tau == 0.0 and sp.widen(agreeing[0][0].ci) == agreeing[0][0].ci
    assert Spread.of([agreeing[0][0]]) is None  # one run: no spread, the run's own CI
    assert judge_across_runs(agreeing[0], agreeing[:1]) == (Verdict.HOLDS, "", (None,))
    other_key = tests([1.0], 1.0, key="k")[0]  # another effect: not pooled with these
    assert judge_across_runs(other_key, [*agreeing, other_key])[2] == (None,)

    runs = [tmp_path / f"r{i}" for i in range(3)]
    for i, d in enumerate(runs):
        d.mkdir()
        _comparison(d, {"f5_slow_over_cold": "holds" if i != 1 else "fails", "t4_specprefetch_faster": "holds"},
                    {"f5_slow_over_cold": [_test([10.2, -2.5, 15.5][i], rule="positive")],
                     "t4_specprefetch_faster": [_test([30.0, 25.0, 35.0][i], 2.0)]})
    rc, out = _run_cli("compare-verdicts", *map(str, runs))
    assert rc == 0, out
    assert "1 contradict (one run holds, another fails): f5_slow_over_cold" in out, out
    assert "| `f5_slow_over_cold` | unresolved | unresolved | unresolved |" in out, out
    assert "| `t4_specprefetch_faster` | holds | holds | holds |" in out, out
    assert ("2 of 2 device claims give the same verdict in all 3 runs judged across hours; none contradicts (one "
            "run holds, another fails)") in out, out


def test_the_kept_runs_verdicts_table_is_current() -> None:
    """docs/runs/verdicts.md is what compare-verdicts gives for the runs it lists (every kept run of docs/runs/, the
    committed paper_tables' among them), every kept run's device claims read (their tests included) without error,
    and the overlay config/overlays/kept-runs.yaml lists the same runs in the same order."""
    readme = (ROOT / "docs" / "runs" / "verdicts.md").read_text()
    runs = [line.split(": ", 1)[1] for line in readme.splitlines() if line.startswith("run ")]
    kept = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "runs").glob("*/comparison.json"))
    assert sorted(runs) == kept, (runs, kept)
    overlay = yaml.safe_load((ROOT / "config" / "overlays" / "kept-runs.yaml").read_text())
    assert overlay["render"]["kept_runs"] == runs
    committed = (ROOT / "paper_tables" / "comparison.json").read_bytes()
    assert any((ROOT / r / "comparison.json").read_bytes() == committed for r in runs), "paper_tables is not kept"
    rc, out = _run_cli("compare-verdicts", *(str(ROOT / r) for r in runs))
    assert rc == 0, out
    assert out.replace(str(ROOT) + "/", "").strip() == readme.strip()
