"""The vocabulary registry (specprefetch.registry): the schema's enums agree with it, every unknown name is one line,
a predictor plugin installed as another package is trained, evaluated, run and rendered, a broken or clashing plugin
is one line naming its entry point, and a storage added in one place reaches the config and Figure 5."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from specprefetch import registry
from specprefetch.config import (
    SCHEMA_ENUMS,
    SCHEMA_PATH,
    STORAGE_PROFILES_PATH,
    ConfigError,
    load_config,
    schema_node,
    storage_profile_defaults,
    validate_config,
    vocabularies,
)
from specprefetch.io import SpecPrefetchError

REPO = Path(__file__).resolve().parent.parent
PLUGIN = "linear_probe"
PLUGIN_LABEL = "Linear Probe"

PLUGIN_SOURCE = '''
"""A predictor from another package: one linear map x^l -> logits of layer l+1 per MoE pair."""
import torch
import torch.nn.functional as F
from torch import nn

from specprefetch.predictors.base import Predictor


class LinearProbe(Predictor):
    label = "Linear Probe"
    color = "#117733"
    learned = True
    runtime_policy = True

    def __init__(self, dims, method_cfg=None):
        super().__init__(dims, method_cfg)
        self.proj = nn.ModuleList(nn.Linear(dims.hidden_size, dims.n_experts) for _ in range(dims.n_pairs))

    def forward(self, batch):
        self.check_batch(batch)
        return [self.proj[l](self._x(batch, l)) for l in range(self.dims.n_pairs)]

    def layer_token_scores(self, layer, x):
        return F.softmax(self.proj[layer](x.to(self._param_dtype())).float(), dim=-1)
'''


def install_plugin(site: Path, dist: str, entries: dict[str, str], modules: dict[str, str]) -> Path:
    """What ``pip install`` leaves for a package: its modules and a ``*.dist-info`` with ``entry_points.txt``."""
    site.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")
    return site


@pytest.fixture(autouse=True)
def _fresh_registry() -> Any:
    """Every test sees the registry as its sys.path and tables say (autouse: set up first, torn down last, after
    monkeypatch has restored sys.path and the tables); plugin classes and modules are forgotten afterwards."""
    registry.refresh()
    yield
    from specprefetch.predictors import base

    for name in [n for n, cls in base._REGISTRY.items() if not cls.__module__.startswith("specprefetch.")]:
        del base._REGISTRY[name]
    for mod in [m for m in sys.modules if m.startswith("sp_")]:
        del sys.modules[mod]
    registry.refresh()


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = install_plugin(tmp_path / "site", "sp-linear-probe", {PLUGIN: "sp_linear_probe:LinearProbe"},
                          {"sp_linear_probe": PLUGIN_SOURCE})
    monkeypatch.syspath_prepend(str(site))
    registry.refresh()
    return site


def _one_line(exc: BaseException, *needles: str) -> str:
    msg = str(exc)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# --------------------------------------------------------------------------------------------- schema and code agree
def test_schema_enums_are_the_registry() -> None:
    """The schema file spells out the built-in vocabularies (for readers and snakemake's own validate); each enum
    equals its registry, and the code's own tables (platform numbers, generators, predictor classes) match it."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    names = vocabularies(plugins=False)
    for vocab, paths in SCHEMA_ENUMS.items():
        for path in paths:
            assert schema_node(schema, path) == names[vocab], f"schema {'.'.join(path)} != registry {vocab}"
    assert schema_node(schema, STORAGE_PROFILES_PATH) == storage_profile_defaults()
    assert [s for s in registry.storages() if registry.storage(s).emulated] == list(storage_profile_defaults())

    from specprefetch.data.corpus import STDLIB_SOURCES
    from specprefetch.data.generators import GENERATORS
    from specprefetch.data.workloads import SYNTH_GENERATORS
    from specprefetch.predictors.base import predictor_class
    from specprefetch.runtime.simulation.platforms import PLATFORMS

    assert tuple(PLATFORMS) == registry.PLATFORMS
    assert set(SYNTH_GENERATORS) <= set(registry.WORKLOAD_GENERATORS)
    assert set(registry.CORPUS_SOURCES) == set(GENERATORS) | set(STDLIB_SOURCES)
    for m in registry.BUILTIN_METHODS:
        cls = predictor_class(m.name)
        assert (cls.method, cls.learned) == (m.name, m.learned), m.name
    for p in registry.BUILTIN_POLICIES:  # every policy has a label and a colour, from itself or its method
        assert registry.policy_label(p.name) and registry.policy_color(p.name).startswith("#")
        assert p.provider is None or p.provider in registry.methods()
    assert set(registry.POLICY_DISPLAY_ORDER) == {p.name for p in registry.BUILTIN_POLICIES}
    assert sorted(s.speed_rank for s in registry.BUILTIN_STORAGES) == list(range(len(registry.BUILTIN_STORAGES)))
    # the budget rules beyond the paper: the runs' vocabulary and the figure's (beside the paper's window rule per
    # storage and per layer)
    from specprefetch.render.figures import BUDGET_RULES
    from specprefetch.runtime.measurement.bench import EXTRA_RULES

    assert EXTRA_RULES == registry.EXTRA_BUDGET_RULES
    assert list(BUDGET_RULES) == ["window", "layer", *registry.EXTRA_BUDGET_RULES]


def test_every_profile_validates_against_the_filled_schema() -> None:
    for path in sorted((REPO / "config").glob("*.yaml")):
        load_config(path)


# --------------------------------------------------------------------------------------------- unknown names
def test_an_unknown_name_is_one_line(tmp_path: Path) -> None:
    from specprefetch.contracts import POLICY, check_csv
    from specprefetch.predictors.base import predictor_class
    from specprefetch.render.style import POLICY_LABELS, color, method_label, storage_label
    from specprefetch.runtime.core.storage import make_profile

    for call in (lambda: color("nope"), lambda: method_label("nope"), lambda: storage_label("nope"),
                 lambda: POLICY_LABELS["nope"], lambda: POLICY["nope"], lambda: make_profile("nope", {}),
                 lambda: predictor_class("nope"), lambda: registry.method("nope"), lambda: registry.storage("nope")):
        with pytest.raises(SpecPrefetchError) as err:
            call()
        _one_line(err.value, "'nope'")
    assert POLICY.get("nope") is None and "nope" not in POLICY  # a Mapping still: .get and `in` do not raise
    bad = tmp_path / "recall.csv"
    bad.write_text("model,workload,method,M,expert_recall,n_tokens\nm,w,nope,2,0.5,10\n")
    with pytest.raises(SpecPrefetchError) as err:
        check_csv(bad, "recall")
    _one_line(err.value, "'method'", "line 2", "'nope'")
    cfg = load_config(REPO / "config" / "config.yaml")
    for key, value in ((("predictors", "methods"), ["specprefetch", "nope"]), (("device", "storages"), ["nope"]),
                       (("device", "main_policies"), ["off", "nope"])):
        c = copy.deepcopy(cfg)
        c[key[0]][key[1]] = value
        with pytest.raises(ConfigError) as err:
            validate_config(c)
        _one_line(err.value, ".".join(key))


# --------------------------------------------------------------------------------------------- a predictor plugin
def test_a_plugin_is_trained_evaluated_and_rendered(plugin: Path, tmp_path: Path) -> None:
    """One entry point and one config entry: the schema accepts the name, training and recall evaluation run it,
    its parameters are gathered, and Tables 1 and 3 and the per-layer figure show its row under its label."""
    from test_predictors import MODEL, make_trace
    from test_render import write_fixture_results

    from specprefetch.config import LEARNED_METHODS, METHOD_LABELS
    from specprefetch.contracts import check_csv
    from specprefetch.predictors.evaluate import evaluate_recall, gather_params
    from specprefetch.predictors.train import train_predictor
    from specprefetch.render.figures import render_figure
    from specprefetch.render.style import color
    from specprefetch.render.tables import render_table

    assert registry.is_plugin(PLUGIN) and registry.method(PLUGIN).source.startswith(f"entry point '{PLUGIN} =")
    assert METHOD_LABELS[PLUGIN] == PLUGIN_LABEL and PLUGIN in LEARNED_METHODS and color(PLUGIN) == "#117733"

    cfg = copy.deepcopy(load_config(REPO / "config" / "smoke.yaml"))
    cfg["predictors"]["methods"] = [*cfg["predictors"]["methods"], PLUGIN]
    cfg["predictors"]["training"].update(batch_tokens=64, lr=1e-2)
    cfg["predictors"][PLUGIN] = {"note": "its own block"}  # the plugin's config section: handed to its class
    validate_config(cfg)
    corpus = make_trace(tmp_path / "corpus", n_samples=40)
    meta = train_predictor(cfg, MODEL, PLUGIN, corpus, tmp_path / "pred" / PLUGIN)
    assert meta["method"] == PLUGIN and meta["trainable_params"] == 2 * (32 * 16 + 16)  # L-1 = 2 pairs, D=32, n=16
    assert meta["final_loss"] < meta["loss_curve"][0] and meta["method_cfg"] == {"note": "its own block"}
    train_predictor(cfg, MODEL, "previous_token", corpus, tmp_path / "pred" / "previous_token")

    trace = make_trace(tmp_path / "eval", workload="w", n_samples=12)  # the same model (seed), a workload's name
    dirs = {m: tmp_path / "pred" / m for m in (PLUGIN, "previous_token")}
    evaluate_recall(cfg, MODEL, "w", trace, dirs, tmp_path / "recall" / "w.csv")
    recall = check_csv(tmp_path / "recall" / "w.csv", "recall")
    probe = recall[(recall["method"] == PLUGIN) & (recall["M"] == 4)]["expert_recall"].item()
    assert probe > 0.4  # a random choice of K=4 of 16 experts has 0.25: it learned the routing
    params = gather_params(dirs.values(), tmp_path / "params.csv")
    assert params.set_index("method").loc[PLUGIN, "trainable_params"] == meta["trainable_params"]

    # the rendered tables and figure of a profile that lists the plugin (fixture results in the contract formats)
    rcfg = copy.deepcopy(load_config(REPO / "config" / "config.yaml"))
    rcfg["predictors"]["methods"] = [*rcfg["predictors"]["methods"], PLUGIN]
    validate_config(rcfg)
    results = write_fixture_results(tmp_path / "results", rcfg)
    pframe = pd.read_csv(results["params"])
    extra = [{"model": m, "method": PLUGIN, "trainable_params": 1234} for m in rcfg["models"]]
    pd.concat([pframe, pd.DataFrame(extra)]).to_csv(results["params"], index=False)
    out = tmp_path / "paper_tables"
    rows = {}
    for table in ("table1_recall", "table2_ablation", "table3_params"):
        render_table(table, rcfg, results, out / f"{table}.tex")
        rows[table] = (out / f"{table}.tex").read_text()
    t1 = rows["table1_recall"]
    assert t1.index("ProMoE &") < t1.index(f"{PLUGIN_LABEL} &") < t1.index("SpecPrefetch &")  # rows of a benchmark
    assert PLUGIN_LABEL not in rows["table2_ablation"]  # SpecPrefetch's own ablation
    t3 = rows["table3_params"]
    # the header: the extension's and the plugin's columns before the paper's method
    assert f"ProMoE & Pre-Attention$^\\star$ & {PLUGIN_LABEL} & SpecPrefetch" in t3
    import json

    doc = json.loads((out / "table3_params.json").read_text())
    assert {c["keys"]["method"] for c in doc["cells"]} >= {PLUGIN_LABEL, "SpecPrefetch"}
    render_figure("fig_recall_per_layer", rcfg, results, out / "figures")
    fig = json.loads((out / "figures" / "fig_recall_per_layer.json").read_text())
    assert any(c["keys"]["method"] == PLUGIN_LABEL for c in fig["cells"])


def test_a_plugin_runtime_policy_prefetches(plugin: Path, tmp_path: Path) -> None:
    """A plugin that declares ``runtime_policy`` is a policy of its own name: the schema takes it in the device
    section, the workflow hands its predictor to the runtime, and the runtime's provider and simulator run it."""
    import torch
    from test_predictors import DIMS, make_trace

    from specprefetch.contracts import POLICY
    from specprefetch.predictors import build_predictor
    from specprefetch.predictors.data import iter_trace_batches
    from specprefetch.runtime.core.priority import PredictorPriority
    from specprefetch.runtime.core.storage import StorageProfile
    from specprefetch.runtime.simulation.simulator import ComputeProfile, sequences_from_trace, simulate
    from specprefetch.traces.store import TraceReader
    from specprefetch.workflow import Pipeline

    pol = POLICY[PLUGIN]
    assert (pol.predicts, pol.issues, pol.provider) == (True, True, PLUGIN)
    assert registry.runtime_providers() == ("specprefetch", "fate", "pre_attention", PLUGIN)
    cfg = copy.deepcopy(load_config(REPO / "config" / "config.yaml"))
    cfg["predictors"]["methods"] = [*cfg["predictors"]["methods"], PLUGIN]
    cfg["device"]["main_policies"] = ["off", "specprefetch", PLUGIN]
    assert Pipeline(cfg, tmp_path).device_predictors == ["specprefetch", "fate", "pre_attention", PLUGIN]

    torch.manual_seed(0)
    pred = build_predictor(PLUGIN, None, DIMS).eval()
    trace = make_trace(tmp_path / "trace", n_samples=4)
    batch = next(iter_trace_batches(TraceReader(trace), 10_000))
    provider = PredictorPriority(pred)
    with torch.no_grad():
        want = pred.priorities(batch, "batch")
    torch.testing.assert_close(provider.scores(0, batch["x"][0].float()), want[0])
    seqs = sequences_from_trace(TraceReader(trace), provider, 4)
    prof = ComputeProfile([1e-5] * 3, [1e-5] * 3, [0.0] * 3, [1e-3] * 3, [1e-3] * 3, 1e-3)
    storage = StorageProfile("nvme", "emulated", 1000.0, 0.0, 0.4e6)
    off = simulate(seqs, "off", 0, 8, 16, 4, prof, storage, io_workers=2)
    mine = simulate(seqs, PLUGIN, 4, 8, 16, 4, prof, storage, io_workers=2)
    assert mine.stats.prefetched > 0 and off.stats.prefetched == 0


def test_a_broken_or_clashing_plugin_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = {
        "import": ({"broken": "sp_broken:Thing"}, {"sp_broken": "raise ImportError('no module named torchvision')\n"},
                   ("entry point 'broken = sp_broken:Thing'", "cannot be loaded", "torchvision")),
        "builtin": ({"fate": "sp_fate:Thing"}, {"sp_fate": "Thing = 1\n"},
                    ("entry point 'fate = sp_fate:Thing'", "already a built-in")),
        "metadata": ({"bare": "sp_bare:Bare"}, {"sp_bare": "class Bare:\n    learned = False\n"},
                     ("entry point 'bare = sp_bare:Bare'", "label and color")),
    }
    for case, (entries, modules, needles) in cases.items():
        site = install_plugin(tmp_path / case, f"sp-{case}", entries, modules)
        with monkeypatch.context() as mp:
            mp.syspath_prepend(str(site))
            registry.refresh()
            with pytest.raises(registry.RegistryError) as err:
                registry.policies()
            _one_line(err.value, *needles)
            with pytest.raises(ConfigError) as err:
                load_config(REPO / "config" / "config.yaml")
            _one_line(err.value, *needles)
        registry.refresh()
    # the same name from two packages
    a = install_plugin(tmp_path / "a", "sp-one", {PLUGIN: "sp_linear_probe:LinearProbe"},
                       {"sp_linear_probe": PLUGIN_SOURCE})
    b = install_plugin(tmp_path / "b", "sp-two", {PLUGIN: "sp_other:LinearProbe"}, {"sp_other": PLUGIN_SOURCE})
    monkeypatch.syspath_prepend(str(a))
    monkeypatch.syspath_prepend(str(b))
    registry.refresh()
    with pytest.raises(registry.RegistryError) as err:
        registry.method_names()
    _one_line(err.value, f"method {PLUGIN!r} is registered twice", "sp-one", "sp-two")


def test_the_cli_reports_a_broken_plugin_in_one_line(tmp_path: Path) -> None:
    site = install_plugin(tmp_path / "site", "sp-broken", {"broken": "sp_broken:Thing"},
                          {"sp_broken": "import sp_no_such_module\n"})
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "specprefetch", "validate-config", "--config", "config/config.yaml"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "entry point 'broken = sp_broken:Thing'" in lines[0] and "sp-broken" in lines[0], lines


# --------------------------------------------------------------------------------------------- a new storage
def test_a_storage_added_in_one_place_reaches_config_and_figure5(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One registry entry: the schema takes the name and fills its emulated numbers, the runtime builds its device
    model, runs.csv accepts it, and Figure 5 shows it under its label in its place (slowest last)."""
    import matplotlib.pyplot as plt
    from test_render import _runs_rows

    from specprefetch.render.data import read_result_csv
    from specprefetch.render.figures import figure_storage
    from specprefetch.runtime.core.storage import make_profile

    emmc = registry.Storage("emmc", "eMMC", speed_rank=6, bandwidth_mbps=250.0, latency_ms=0.3)
    monkeypatch.setattr(registry, "BUILTIN_STORAGES", (*registry.BUILTIN_STORAGES, emmc))
    registry.refresh()

    cfg = copy.deepcopy(load_config(REPO / "config" / "config.yaml"))
    cfg["device"]["storages"] = [*cfg["device"]["storages"], "emmc"]
    cfg["device"]["storage_profiles"].pop("emmc", None)
    validate_config(cfg)
    assert cfg["device"]["storage_profiles"]["emmc"] == {"bandwidth_mbps": 250.0, "latency_ms": 0.3}
    prof = make_profile("emmc", cfg["device"], 1_000_000, 1.0)  # the delay emulation over a 1 ms physical read
    assert (prof.kind, prof.bandwidth_mbps, prof.latency_ms) == ("emulated", 250.0, 0.3)
    assert prof.delay_ms == pytest.approx(0.3 + 1e6 / 250e6 * 1e3 - 1.0)

    runs = _runs_rows()
    slow = runs[(runs["experiment"] == "storage") & (runs["storage"] == "sdcard")].copy()
    slow["storage"] = "emmc"
    slow["tokens_per_s"] = slow["tokens_per_s"] * 0.5
    path = tmp_path / "runs.csv"
    pd.concat([runs, slow]).to_csv(path, index=False)
    result = figure_storage(read_result_csv(path, "runs"), cfg, path)
    try:
        ticks = [t.get_text().replace("\n", " ") for t in result.fig.axes[0].get_xticklabels()]  # side by side
        # with the bandwidth variant's panel, the names wrap onto two lines
    finally:
        plt.close(result.fig)
    assert ticks == ["NVMe", "NVMe (cold)", "UFS", "Slow UFS", "SD card", "eMMC"]
    assert any(c.id.startswith("emmc/") for c in result.doc.cells)
    assert result.doc.meta["m_max_per_storage"]["emmc"] == 8
