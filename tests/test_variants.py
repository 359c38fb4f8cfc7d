"""device.variants: experiments measured again under another emulation or I/O order (issue 28).

A variant is a benchmark of its own (its own window profile and budgets), its runs named ``<experiment>@<variant>``
in runs.csv so every reader of an experiment sees the default's runs only; Figure 5 draws the storage experiment
under each emulation and Figure 4 the sweep under each I/O order, and a claim about a variant names it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from specprefetch.config import REPO_ROOT, ConfigError, load_config, validate_config
from specprefetch.contracts import ContractError, check_csv, split_experiment, variant_experiment
from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.settings import device_settings, variant_experiments, variant_settings, variants_for


def _cfg() -> dict:
    return copy.deepcopy(load_config(REPO_ROOT / "config" / "config.yaml"))


def test_a_variant_is_the_default_with_its_emulation_io_order_and_experiments() -> None:
    d = device_settings(_cfg())
    assert d["variants"] == {"bandwidth": {"emulation": "bandwidth", "experiments": ["storage"]},
                             "fifo": {"io_order": "fifo", "experiments": ["sweep"]}}
    bw = variant_settings(d, "bandwidth")
    assert (bw["emulation"], bw["io_order"], bw["experiments"]) == ("bandwidth", "demand_first", ["storage"])
    fifo = variant_settings(d, "fifo")
    assert (fifo["emulation"], fifo["io_order"]) == ("delay", "fifo")
    assert variant_settings(d, None) is d
    # the Qwen stand-in runs `main` only: no variant measures anything of it
    assert variants_for(d, "tiny-deepseek-vl2") == ["bandwidth", "fifo"] and variants_for(d, "tiny-qwen3-vl-moe") == []
    assert variant_experiments(d, "tiny-deepseek-vl2", "fifo") == ["sweep"]
    assert variant_experiments(d, "tiny-qwen3-vl-moe", None) == ["main"]
    with pytest.raises(SpecPrefetchError, match="unknown device variant 'slow'; device.variants has bandwidth, fifo"):
        variant_settings(d, "slow")


def test_a_variant_that_measures_the_default_is_one_line() -> None:
    cfg = _cfg()
    cfg["device"]["variants"] = {"same": {"emulation": "delay", "experiments": ["storage"]}}
    with pytest.raises(ConfigError, match=r"device.variants.same': it measures what the default does"):
        validate_config(cfg)
    cfg["device"]["variants"] = {"Bad-Name": {"emulation": "bandwidth", "experiments": ["storage"]}}
    with pytest.raises(ConfigError, match="variants"):
        validate_config(cfg)
    cfg["device"]["variants"] = {"nothing": {"experiments": ["storage"]}}  # no emulation, no io_order
    with pytest.raises(ConfigError, match="variants"):
        validate_config(cfg)


def test_sweep_storages_must_be_benchmarked_storages() -> None:
    cfg = _cfg()
    cfg["device"]["sweep_storages"] = ["nvme_cold", "sdcard"]  # sdcard is not among the embedded default's storages
    with pytest.raises(ConfigError, match=r"device.sweep_storages': 'sdcard' is not one of device.storages"):
        validate_config(cfg)
    cfg["device"]["sweep_storages"] = ["nvme_cold", "slow_ufs"]
    validate_config(cfg)
    from specprefetch.runtime.measurement.bench import plan_experiments

    plan = plan_experiments(device_settings(cfg), {"nvme_cold": 3, "slow_ufs": 1}, ["sweep"])
    swept = {(c.storage, c.m_max) for c in plan["sweep"] if c.policy == "specprefetch"}
    assert {m for st, m in swept if st == "slow_ufs"} == {1, 2, 4, 8, 16}  # sweep_m_max and its own budget
    assert {m for st, m in swept if st == "nvme_cold"} == {1, 2, 3, 4, 8, 16}


def test_variant_runs_are_named_and_checked(tmp_path: Path) -> None:
    assert variant_experiment("storage", "bandwidth") == "storage@bandwidth"
    assert variant_experiment("storage", None) == "storage"
    assert split_experiment("sweep@fifo") == ("sweep", "fifo") and split_experiment("main") == ("main", None)
    from tests.test_render import _runs_rows

    runs = _runs_rows()
    path = tmp_path / "runs.csv"
    runs.to_csv(path, index=False)
    assert {"storage@bandwidth", "sweep@fifo"} <= set(check_csv(path, "runs")["experiment"])
    for bad in ("storage@", "storage@Band", "bogus@fifo"):
        runs.loc[runs.index[0], "experiment"] = bad
        runs.to_csv(path, index=False)
        with pytest.raises(ContractError, match=f"column 'experiment', line 2: value '{bad}' does not match"):
            check_csv(path, "runs")


def test_the_dag_measures_each_variant_on_its_own(tmp_path: Path) -> None:
    from specprefetch.workflow import Pipeline

    cfg = _cfg()
    validate_config(cfg)
    p = Pipeline(cfg)
    assert p.device_benchmarks() == [("tiny-deepseek-vl2", ""), ("tiny-qwen3-vl-moe", ""),
                                     ("tiny-deepseek-vl2", "@bandwidth"), ("tiny-deepseek-vl2", "@fifo")]
    assert p.window_dir("m", "@fifo") == "results/device/window/m@fifo"
    assert p.window_dir("m") == "results/device/window/m"
    assert p.measured_csv("m", "@bandwidth") == "results/device/measured/m@bandwidth.csv"
    assert p.variant_arg("@fifo") == "--variant fifo" and p.variant_arg("") == ""


def test_figures_draw_each_variant_and_claims_name_theirs(tmp_path: Path) -> None:
    """Figure 5: a panel per emulation, the variant's cells keyed and prefixed by its name; Figure 4: the FIFO
    sweep beside the default's; a claim selects a variant's cells only when it names the variant."""
    from specprefetch.render.claims import load_claims
    from specprefetch.render.figures import figure_budget, figure_storage
    from tests.test_render import _runs_rows

    cfg = _cfg()
    validate_config(cfg)
    runs = _runs_rows()
    res = figure_storage(runs, cfg)
    cells = res.doc.by_id()
    assert len(res.fig.axes) == 2 and [ax.get_title() for ax in res.fig.axes] == [
        "delay emulation (the paper's)", "bandwidth emulation"]
    bw = runs[(runs.experiment == "storage@bandwidth") & (runs.storage == "slow_ufs")].pivot(
        index="repeat", columns="policy", values="tokens_per_s")
    assert cells["bandwidth:slow_ufs/gain"].value == pytest.approx(((bw.specprefetch / bw.off - 1) * 100).mean())
    assert cells["bandwidth:slow_ufs/gain"].keys == {"storage": "slow_ufs", "policy": "SpecPrefetch",
                                                     "variant": "bandwidth", "m_max": 2}  # the variant's budget
    assert "variant" not in cells["slow_ufs/gain"].keys and cells["slow_ufs/gain"].value > 15
    assert res.doc.meta["variants"] == {"bandwidth": {"emulation": "bandwidth",
                                                      "m_max_per_storage": {"nvme": 8, "nvme_cold": 8, "slow_ufs": 2}}}
    assert res.doc.meta["emulation"] == "delay"
    f4 = figure_budget(runs, cfg).doc.by_id()
    assert f4["fifo:peak_m_max"].value == 8 and f4["fifo:M16/throughput"].keys == {"m_max": 16, "variant": "fifo"}
    assert f4["peak_m_max"].value == 8 and "fifo:M10/throughput" not in f4
    specs = {c.id: c for c in load_claims()}
    plain, variant = specs["f5_slow_ufs"].ops["cells"][0], specs["f5_slow_ufs_bandwidth"].ops["cells"][0]
    assert [c.id for c in res.doc.cells if plain.matches(c)] == ["slow_ufs/gain"]
    assert [c.id for c in res.doc.cells if variant.matches(c)] == ["bandwidth:slow_ufs/gain"]
    fifo = specs["f4_bounded_peak_fifo"].ops["select"]
    assert {c.id for c in figure_budget(runs, cfg).doc.cells if fifo.matches(c) and "m_max" in c.keys} == {
        f"fifo:M{m}/throughput" for m in (2, 4, 8, 16)}


def test_comparison_judges_the_storage_claims_under_each_emulation(tmp_path: Path) -> None:
    from specprefetch.render.compare import compare_with_paper
    from specprefetch.render.figures import render_figure
    from specprefetch.render.reported import load_reported
    from specprefetch.render.targets import figure_names
    from tests.test_render import write_fixture_results

    cfg = _cfg()
    validate_config(cfg)
    results = write_fixture_results(tmp_path / "results", cfg)
    out = tmp_path / "out"
    for name in figure_names(cfg):
        render_figure(name, cfg, results, out / "figures")
    compare_with_paper(cfg, [], sorted((out / "figures").glob("*.json")), load_reported(), out)
    claims = {c["id"]: c for c in json.loads((out / "comparison.json").read_text())["claims"]}
    # the fixture's bandwidth emulation: the slow storage gains +3 %, less than cold NVMe's +7 %; delay: +20 %
    assert claims["f5_slow_over_cold"]["verdict_reproduced"] == "holds"
    assert claims["f5_slow_over_cold_bandwidth"]["verdict_reproduced"] in ("fails", "unresolved")
    assert "bandwidth emulation (not the paper's)" in claims["f5_slow_ufs_bandwidth"]["statement"]
    assert claims["f4_bounded_peak_fifo"]["verdict_reproduced"] in ("holds", "unresolved")
    md = (out / "comparison.md").read_text()
    assert "f5_gain_grows_bandwidth" in md or "bandwidth emulation" in md


def test_extra_budget_rules_need_the_window_rule() -> None:
    """device.extra_rules start from the window rule's budgets: a configured M_max or the simulated rule is one line;
    an unknown rule is the schema's error."""
    cfg = _cfg()
    cfg["device"]["extra_rules"] = ["dp", "ewma", "simulated"]
    validate_config(cfg)
    for key, value in (("m_max", 4), ("budget_rule", "simulated")):
        bad = _cfg()
        bad["device"].update({"extra_rules": ["ewma"], key: value})
        with pytest.raises(ConfigError, match=r"'device.extra_rules': the extra rules start from the window"):
            validate_config(bad)
    cfg["device"]["extra_rules"] = ["oracle"]
    with pytest.raises(ConfigError, match="extra_rules"):
        validate_config(cfg)
