"""The budget module (runtime/core/budget.py): auto vs a configured M_max, the window rule, per-storage and per-layer
budgets, which policies have one, and the simulated platform's budget from the same rule."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from specprefetch.io import SpecPrefetchError
from specprefetch.runtime.core.budget import (
    BudgetError,
    RunBudget,
    budget_storages,
    derive_m_max,
    has_budget,
    is_auto,
    layer_budget,
    layer_budgets,
    read_window_profile,
    rule_budgets,
    run_budget,
    storage_budgets,
    window_budgets,
)


def _settings(m_max: Any = "auto", **over: Any) -> dict[str, Any]:
    """The device section with each storage at its own budget (``budget_scope: storage``), so a test sees every
    storage's rule; the default, one budget per platform, has its own test."""
    from specprefetch.config import section_defaults

    return section_defaults("device", {"m_max": m_max, "reference_storage": "nvme_cold", "slow_storage": "slow_ufs",
                                       "storages": ["nvme_cold", "nvme", "ufs"], "budget_scope": "storage", **over})


def _profile(**over: Any) -> dict[str, Any]:
    return {"model": "m", "n_layers": 4, "m_max_per_storage": {"nvme_cold": 4, "slow_ufs": 1, "nvme": 7, "ufs": 3},
            "m_max_per_layer": {"nvme_cold": [4, 4, 4], "nvme": [6, 7, 6]}, **over}


def test_window_rule() -> None:
    """max(1, floor(W / t)), at most n_experts; a free transfer or an unmeasured window gives every expert."""
    assert derive_m_max(3.6, 7.0 / 3, 64) == 1 and derive_m_max(3.6, 0.5, 64) == 7
    assert derive_m_max(3.6, 0.01, 6) == 6 and derive_m_max(0.2, 0.5, 64) == 1
    assert derive_m_max(10.0, 0.0, 8) == 8 and derive_m_max(float("nan"), 1.0, 8) == 8


def test_auto_or_configured_setting() -> None:
    assert is_auto("auto") and not is_auto(0) and not is_auto(5)
    for bad in ("8", -1, True, 2.5, None):
        with pytest.raises(BudgetError, match=r"invalid config key 'device.simulator.m_max'"):
            is_auto(bad, "device.simulator.m_max")


def test_per_storage_budgets() -> None:
    """A configured integer is every storage's budget (no profile needed); auto reads the profile's per storage;
    auto without a profile, or a profile missing a storage, is one line naming what is missing."""
    assert budget_storages(_settings()) == ["nvme_cold", "slow_ufs", "nvme", "ufs"]
    assert storage_budgets(_settings(5), None) == {"nvme_cold": 5, "slow_ufs": 5, "nvme": 5, "ufs": 5}
    assert storage_budgets(_settings(), _profile()) == {"nvme_cold": 4, "slow_ufs": 1, "nvme": 7, "ufs": 3}
    assert storage_budgets(_settings(), _profile(), ["ufs"]) == {"ufs": 3}
    with pytest.raises(BudgetError, match=r"device.m_max is auto: .*give --window"):
        storage_budgets(_settings(), None, need="--window")
    with pytest.raises(BudgetError, match=r"^window profile has no window-rule M_max for storage slow_ufs, ufs: rerun"):
        storage_budgets(_settings(), _profile(m_max_per_storage={"nvme_cold": 4, "nvme": 7}))


def test_per_layer_budgets() -> None:
    """Auto: the profile's per-layer budgets, index 0 the storage's M_max; none for a configured integer or a storage
    without them; a profile with another layer count is one error."""
    m = storage_budgets(_settings(), _profile())
    assert layer_budgets(_settings(), _profile(), m) == {"nvme_cold": (4, 4, 4, 4), "nvme": (7, 6, 7, 6)}
    assert layer_budgets(_settings(5), _profile(), {"nvme": 5}) == {}
    with pytest.raises(BudgetError, match=r"m_max_per_layer\['nvme_cold'\] has 3 layers, expected 5"):
        layer_budgets(_settings(), _profile(n_layers=6), m)


def test_window_budgets_per_storage_and_layer() -> None:
    """profile_window's budgets: per storage the rule on the median window (or the configured integer), per layer
    the rule on each layer's window in layer order, whatever the setting."""
    per, layers = window_budgets("auto", 10.0, {1: 4.0, 0: 9.0}, {"a": 2.0, "b": 0.5}, 16)
    assert per == {"a": 5, "b": 16} and layers == {"a": [4, 2], "b": [16, 8]}
    per, layers = window_budgets(3, 10.0, {0: 9.0, 1: 4.0}, {"a": 2.0}, 16)
    assert per == {"a": 3} and layers == {"a": [4, 2]}


def test_policies_without_a_budget_get_zero() -> None:
    """Only policies that select at M_max have a budget (the Policy table's flag); the others run at 0 with no
    per-layer budgets; per-layer budgets equal to M_max in every layer prefetched into are the one budget."""
    from specprefetch.runtime.measurement.bench import RunConfig

    assert [p for p in ("off", "pred0", "specprefetch", "naive", "fate", "resident") if has_budget(p)] == [
        "pred0", "specprefetch", "naive", "fate"]
    with pytest.raises(BudgetError, match=r"unknown policy 'nope'"):
        has_budget("nope")
    assert run_budget("off", 5, (5, 3, 2)) == run_budget("resident", 5) == RunBudget(0, ())
    assert run_budget("pred0", 5, (2, 5, 5)) == RunBudget(5, ())
    assert run_budget("specprefetch", 5, (5, 3, 5)) == RunBudget(5, (5, 3, 5))
    for pol, layers in (("off", (4, 2, 4)), ("specprefetch", (4, 2, 4)), ("naive", (4, 4, 4))):
        cfg = RunConfig("budget", pol, "nvme", 4, True, layers)
        assert (cfg.budget, cfg.layers) == (run_budget(pol, 4, layers).m_max, run_budget(pol, 4, layers).layers)


def test_layer_budget_in_runtime_options() -> None:
    from specprefetch.runtime.core.engine import RuntimeOptions

    assert layer_budget(4, (4, 1, 2), 2) == 2 and layer_budget(4, (), 2) == 4 and layer_budget(4, (4, 1), 5) == 4
    assert RunBudget(4, (4, 1, 2)).of(1) == 1
    opts = RuntimeOptions(policy="specprefetch", m_max=4, layer_m_max=(4, 1, 2))
    assert [opts.budget_of(l) for l in range(3)] == [4, 1, 2]


def test_window_profile_reader(tmp_path: Path) -> None:
    with pytest.raises(BudgetError, match=r"nowhere/profile.json: cannot read the window profile"):
        read_window_profile(tmp_path / "nowhere", "m")
    (tmp_path / "profile.json").write_text(json.dumps(_profile()))
    assert read_window_profile(tmp_path, "m")["n_layers"] == 4
    with pytest.raises(BudgetError, match=r"is for model 'm', not 'other'"):
        read_window_profile(tmp_path, "other")


def test_lm_eval_default_budget(tmp_path: Path) -> None:
    """The lm-eval wrapper's budget when none is given: the configured one, else the window profile's."""
    from specprefetch.runtime.lm_eval_model import default_m_max

    assert default_m_max(_settings(3), "ram", None, "m") == 3
    (tmp_path / "profile.json").write_text(json.dumps(_profile()))
    assert default_m_max(_settings(), "nvme", str(tmp_path), "m") == 7
    with pytest.raises(BudgetError, match=r"give m_max= or window="):
        default_m_max(_settings(), "nvme", None, "m")


# ------------------------------------------------------------------------------------------ simulated platform
def _phone() -> tuple[dict[str, Any], Any]:
    from specprefetch.runtime.simulation.platforms import compute_profile_of, platform_profile

    p = platform_profile("snapdragon_8_elite")
    return p, compute_profile_of(p, 11)


def test_platform_window_is_the_simulated_window() -> None:
    """The phone's window is what window profiling would measure in the simulator: t_exec(l+1) - t_pred(l) - stall
    of a PRED0 run on its NVMe, equal in every layer (10.66 ms: 48 % of 266.5 ms over 12 decoder layers)."""
    from specprefetch.runtime.measurement.window import per_layer_windows
    from specprefetch.runtime.simulation.platforms import nvme_profile, platform_windows_ms
    from specprefetch.runtime.simulation.simulator import SimSequence, SimStep, simulate

    p, comp = _phone()
    n, k, L = 64, 6, 11
    g = torch.Generator().manual_seed(0)

    def step() -> SimStep:
        return SimStep(topk=[[torch.randperm(n, generator=g)[:k].tolist()] for _ in range(L)],
                       scores=[torch.rand(n, generator=g) for _ in range(L - 1)] + [None])

    res = simulate([SimSequence([step() for _ in range(6)])], "pred0", 4, 88, n, k, comp, nvme_profile(p, 600.0),
                   p["io_workers"])
    measured = per_layer_windows(res.events)
    assert measured and all(w == pytest.approx(10.66, abs=0.01) for w in measured.values())
    windows = platform_windows_ms(comp)
    assert sorted(windows) == list(range(L - 1))
    assert all(w == pytest.approx(v) for v in measured.values() for w in windows.values())


def test_platform_budget_from_the_window_rule_or_the_config() -> None:
    """``device.simulator.m_max``: the configured integer on every storage, or auto -- the median window over the
    device model's per-expert time (latency + 1.94 MB / bandwidth): the platform's NVMe's on every storage (the
    paper's one M_max per platform, ``budget_scope: platform``, the default), or per storage (``storage``)."""
    from specprefetch.runtime.simulation.platforms import platform_m_max

    p, comp = _phone()
    s = _settings(simulator={"m_max": 8}, storages=["nvme_cold", "ram", "nvme", "ufs"], emulation="bandwidth")
    assert platform_m_max(p, s, 600.0, comp, 64) == 8
    auto = {**s, "simulator": {**s["simulator"], "m_max": "auto"}, "budget_scope": "storage"}
    w = (1 - 0.52) / 3.753 / 12 * 1e3  # ms per decoder layer: 48 % of 266.5 ms over 12 layers
    expect = {"nvme_cold": math.floor(w / (0.1 + 1.94e6 / 1940e6 * 1e3)),           # 1.1 ms -> 9
              "slow_ufs": math.floor(w / (0.2 + 1.94e6 / 850e6 * 1e3)),             # UFS 2.1: 2.48 ms -> 4
              "ram": 64, "nvme": math.floor(w / (0.08 + 1.94e6 / 4200e6 * 1e3)),    # 0.54 ms -> 19
              "ufs": math.floor(w / (0.12 + 1.94e6 / 2100e6 * 1e3))}                # 1.04 ms -> 10
    assert expect == {"nvme_cold": 9, "slow_ufs": 4, "ram": 64, "nvme": 19, "ufs": 10}
    assert platform_m_max(p, auto, 1940.0, comp, 64) == expect
    # the delay emulation adds to the phone's own NVMe read (1.1 ms): no emulated device is faster than it
    delay = {**auto, "emulation": "delay"}
    assert platform_m_max(p, delay, 1940.0, comp, 64) == {**expect, "nvme": 9, "ufs": 9}
    assert platform_m_max(p, {**auto, "budget_scope": "platform"}, 1940.0, comp, 64) == dict.fromkeys(expect, 9)
    with pytest.raises(BudgetError, match=r"device.simulator.m_max"):
        platform_m_max(p, {**s, "simulator": {"m_max": "eight"}}, 600.0, comp, 64)


def test_profiles_keep_the_papers_phone_budget() -> None:
    """The paper's phone runs at M_max = 8 (Table 5); every profile states it as a config override (the schema's
    default is the window rule)."""
    from specprefetch.config import REPO_ROOT, load_config, section_defaults
    from specprefetch.runtime.core.settings import device_settings

    assert section_defaults("device")["simulator"]["m_max"] == "auto"
    for name in ("config", "paper", "smoke"):
        assert device_settings(load_config(REPO_ROOT / "config" / f"{name}.yaml"))["simulator"]["m_max"] == 8


SIMULATED = {"nvme_cold": 5, "slow_ufs": 5, "nvme": 4, "ufs": 6}


def test_the_platform_scope_runs_every_storage_at_the_reference_storages_budget() -> None:
    """device.budget_scope platform (the paper's: one M_max profiled on the target platform, kept on the emulated slow
    storage) reads every storage's budget from the reference storage's profile: by either rule, per layer, look-ahead,
    pre-attention and batch; it is the default; storage (beyond the paper) reads each storage's own; an unknown scope
    is one line."""
    from specprefetch.runtime.core.budget import (
        BATCH_KEY,
        PRE_ATTENTION_KEY,
        batch_budgets,
        budget_source,
        lookahead_budgets,
        pre_attention_budgets,
    )

    prof = _profile(m_max_simulated_per_storage=SIMULATED, n_experts=8, window_ms_median=4.0,
                    transfer_ms_used={"nvme_cold": 1.0, "slow_ufs": 3.0, "nvme": 0.5, "ufs": 1.2},
                    **{PRE_ATTENTION_KEY: {"nvme_cold": 2, "slow_ufs": 1, "nvme": 3, "ufs": 1},
                       BATCH_KEY: {"2": {"nvme_cold": 6, "slow_ufs": 2, "nvme": 8, "ufs": 5}}})
    from specprefetch.config import section_defaults

    assert section_defaults("device")["budget_scope"] == "platform"
    plat = _settings(budget_scope="platform", batch={"sizes": [1, 2], "storages": ["nvme_cold", "slow_ufs"]})
    own = {**plat, "budget_scope": "storage"}
    assert budget_source(plat, "slow_ufs") == "nvme_cold" and budget_source(own, "slow_ufs") == "slow_ufs"
    assert storage_budgets(own, prof) == {"nvme_cold": 4, "slow_ufs": 1, "nvme": 7, "ufs": 3}
    every = {"nvme_cold": 4, "slow_ufs": 4, "nvme": 4, "ufs": 4}
    assert storage_budgets(plat, prof) == every
    assert storage_budgets({**plat, "budget_rule": "simulated"}, prof) == dict.fromkeys(every, 5)
    assert rule_budgets(plat, prof) == dict.fromkeys(every, {4, 5})
    assert layer_budgets(plat, prof, every) == dict.fromkeys(every, (4, 4, 4, 4))
    assert layer_budgets(own, prof, {"nvme_cold": 4, "slow_ufs": 1}) == {"nvme_cold": (4, 4, 4, 4)}
    assert lookahead_budgets(plat, prof, {"slow_ufs": 4}, [1, 2]) == {"slow_ufs": {1: 4, 2: 8}}
    assert lookahead_budgets(own, prof, {"slow_ufs": 1}, [1, 2]) == {"slow_ufs": {1: 1, 2: 2}}
    assert pre_attention_budgets(plat, prof, every) == dict.fromkeys(every, 2)
    assert batch_budgets(plat, prof, every) == {1: {"nvme_cold": 4, "slow_ufs": 4}, 2: {"nvme_cold": 6, "slow_ufs": 6}}
    assert batch_budgets(own, prof, storage_budgets(own, prof))[2] == {"nvme_cold": 6, "slow_ufs": 2}
    with pytest.raises(BudgetError, match=r"^invalid config key 'device.budget_scope': 'disk' \(one of platform, "):
        storage_budgets({**plat, "budget_scope": "disk"}, prof)
    with pytest.raises(BudgetError, match=r"no window-rule M_max for storage nvme_cold: rerun"):
        storage_budgets(plat, _profile(m_max_per_storage={"slow_ufs": 1}))


def test_simulated_rule_budgets() -> None:
    """device.budget_rule simulated reads the profile's simulated budgets (no per-layer budgets: the simulated rule
    has one budget per storage); the window rule stays the default; the sweep measures every rule's budget; an
    unknown rule or a profile without simulated budgets is one line."""
    prof = _profile(m_max_simulated_per_storage=SIMULATED)
    sim = _settings(budget_rule="simulated")
    assert storage_budgets(sim, prof) == SIMULATED
    assert storage_budgets(_settings(), prof) == {"nvme_cold": 4, "slow_ufs": 1, "nvme": 7, "ufs": 3}
    assert layer_budgets(sim, prof, SIMULATED) == {}
    assert rule_budgets(_settings(), prof) == {"nvme_cold": {4, 5}, "slow_ufs": {1, 5}, "nvme": {7, 4}, "ufs": {3, 6}}
    assert rule_budgets(_settings(), _profile()) == {"nvme_cold": {4}, "slow_ufs": {1}, "nvme": {7}, "ufs": {3}}
    assert rule_budgets(_settings(5), prof) == {} and rule_budgets(_settings(), None) == {}
    with pytest.raises(BudgetError, match=r"no simulated-rule M_max for storage nvme_cold, slow_ufs, nvme, ufs"):
        storage_budgets(sim, _profile())
    with pytest.raises(BudgetError, match=r"'device.budget_rule': 'oracle'"):
        storage_budgets({**_settings(), "budget_rule": "oracle"}, prof)  # past the schema (a hand-made dict)


def test_sweep_measures_every_rules_budget() -> None:
    """The sweep's budgets: device.sweep_m_max, the storage's budget and every rule's (so Figure 4 can judge the
    window rule and the simulated rule against the measured optimum)."""
    from specprefetch.runtime.measurement.bench import plan_experiments

    s = _settings(sweep_m_max=[1, 2, 4, 8], sweep_storages=["nvme_cold", "ufs"])
    plan = plan_experiments(s, {"nvme_cold": 2, "ufs": 3}, ["sweep"], None, {"nvme_cold": {2, 5}, "ufs": {3, 6}})
    got = {(c.storage, c.m_max) for c in plan["sweep"] if c.policy == "specprefetch"}
    assert got == {("nvme_cold", m) for m in (1, 2, 4, 5, 8)} | {("ufs", m) for m in (1, 2, 3, 4, 6, 8)}


def test_lookahead_budgets_sum_the_window_over_d_layers() -> None:
    """M_max at look-ahead d: the window rule on d windows (auto, window rule), d times the budget otherwise (a
    configured integer, the simulated rule), at most n_experts; d = 1 is the storage's budget. The lookahead
    experiment measures OFF, SpecPrefetch at each distance and its control (1 ahead at that budget) on each of its
    storages."""
    from specprefetch.runtime.core.budget import lookahead_budgets
    from specprefetch.runtime.measurement.bench import plan_experiments

    prof = _profile(n_experts=16, window_ms_median=3.0, transfer_ms_used={"nvme_cold": 1.1, "slow_ufs": 2.5},
                    m_max_simulated_per_storage={"nvme_cold": 5, "slow_ufs": 2})
    budgets = {"nvme_cold": 2, "slow_ufs": 1}
    assert lookahead_budgets(_settings(), prof, budgets, [1, 2, 3]) == {
        "nvme_cold": {1: 2, 2: 5, 3: 8}, "slow_ufs": {1: 1, 2: 2, 3: 3}}  # floor(6/1.1)=5, floor(9/1.1)=8, ...
    assert lookahead_budgets(_settings(7), prof, {"nvme_cold": 7}, [1, 3]) == {"nvme_cold": {1: 7, 3: 16}}
    assert lookahead_budgets(_settings(budget_rule="simulated"), prof, {"slow_ufs": 2}, [2]) == {"slow_ufs": {2: 4}}
    with pytest.raises(BudgetError, match="no transfer_ms_used for storage ufs"):
        lookahead_budgets(_settings(), prof, {"ufs": 3}, [2])
    s = _settings(lookahead={"distances": [1, 2], "storages": ["nvme_cold", "slow_ufs"]})
    plan = plan_experiments(s, {"nvme_cold": 2, "slow_ufs": 1, "nvme": 7, "ufs": 3}, ["lookahead"],
                            ahead_m_max=lookahead_budgets(s, prof, budgets, [1, 2]))
    got = [(c.policy, c.storage, c.budget, c.ahead, c.label) for c in plan["lookahead"]]
    assert got == [("off", "nvme_cold", 0, 1, "off"), ("specprefetch", "nvme_cold", 2, 1, "specprefetch M=2"),
                   ("specprefetch", "nvme_cold", 5, 2, "specprefetch M=5 d=2"),
                   ("specprefetch", "nvme_cold", 5, 1, "specprefetch M=5"),  # the control: 1 ahead at M(2)
                   ("off", "slow_ufs", 0, 1, "off"), ("specprefetch", "slow_ufs", 1, 1, "specprefetch M=1"),
                   ("specprefetch", "slow_ufs", 2, 2, "specprefetch M=2 d=2"),
                   ("specprefetch", "slow_ufs", 2, 1, "specprefetch M=2")]
    assert len({c.signature for c in plan["lookahead"]}) == 8 and plan["lookahead"][2].key.endswith("|d2")
    with pytest.raises(SpecPrefetchError, match="experiment 'lookahead' needs the budgets per distance"):
        plan_experiments(s, budgets, ["lookahead"])


def test_simulated_rule_takes_the_fastest_budget() -> None:
    from specprefetch.runtime.simulation.budget_model import fastest

    assert fastest({1: 5.0, 2: 7.0, 3: 7.0, 4: 6.0}) == 2  # a tie: the smaller budget
    assert fastest({1: float("nan"), 2: 1.0}) == 2
    with pytest.raises(ValueError, match="no budget"):
        fastest({1: float("nan")})


@pytest.mark.parametrize("emulation", ["delay", "bandwidth"])
def test_shaped_device_takes_the_asked_load_time(emulation: str) -> None:
    """The W/t axis's devices: the disk model's shape, a load of ``transfer_ms``; under the delay emulation a slower
    device is the disk plus a delay (its bandwidth kept), a faster one the disk scaled. With the isolated load time
    the disk stands for (``base_ms``), the delay and the scale are taken against it: at ``base_ms`` the disk itself."""
    from specprefetch.runtime.core.storage import StorageProfile
    from specprefetch.runtime.simulation.budget_model import shaped_device

    disk = StorageProfile("nvme_cold", "emulated", 2000.0, 0.5, 2_000_000, demand_first=False)
    base = 0.5 + 1.0  # latency + 2 MB at 2000 MB/s
    for t in (0.3, base, 4.0, 20.0):
        dev = shaped_device(disk, emulation, t)
        assert dev.transfer_s() * 1e3 == pytest.approx(t) and dev.modelled and not dev.demand_first
        assert (dev.bandwidth_mbps == 2000.0) == (emulation == "delay" and t >= base or t == base)
    iso = 2.5  # the disk's isolated read; the model (its service time under load) is faster
    for t in (0.3, iso, 4.0, 20.0):
        dev = shaped_device(disk, emulation, t, iso)
        slower = emulation == "delay" and t >= iso
        want = base + (t - iso) if slower else base * t / iso
        assert dev.transfer_s() * 1e3 == pytest.approx(want)
        assert (dev.bandwidth_mbps == pytest.approx(2000.0)) == (slower or t == iso)


def test_the_disk_model_serves_one_expert_per_the_runtimes_service_time() -> None:
    """The simulator's disk from a window profile: one expert per the runtime's measured service time with loads in
    flight together (a prefetching run at M = K), and the serial service time's excess over it (OFF's, from the
    lockstep block) as a pipelined latency: a load alone takes the serial time, a burst one expert per the overlapped
    one. No latency without the serial time, or when it is not larger (the isolated read is not what the runtime's
    loads take); without the runtime's service time, the disk fitted alone."""
    from specprefetch.runtime.core.storage import BandwidthModel
    from specprefetch.runtime.simulation.simrun import disk_model, serial_service_ms, service_disk

    prof = {"payload_bytes": 2_000_000, "physical_model": {"bandwidth_mbps": 2000.0, "latency_ms": 0.5},
            "transfer_ms_in_runtime": {"nvme_cold": 1.6}, "transfer_ms": {"nvme_cold": {"transfer_ms": 1.9}}}
    d = disk_model(prof, {"io_order": "fifo"})
    assert d.transfer_s() * 1e3 == pytest.approx(1.6) and d.latency_ms == 0.0 and not d.demand_first
    assert d == service_disk(2_000_000, 1.6, demand_first=False)
    serial = {**prof, "io_interference": {"runs": {"off": {"service_ms": 2.0}, "resident": {}}}}
    assert serial_service_ms(serial) == 2.0 and math.isnan(serial_service_ms(prof))
    d = disk_model(serial, {})
    assert d.latency_ms == pytest.approx(0.4) and d.transfer_s() * 1e3 == pytest.approx(2.0)
    disk = BandwidthModel(d)
    ends = [disk.schedule(0.0) * 1e3 for _ in range(4)]  # a burst of four: one expert per 1.6 ms after the first
    assert ends == pytest.approx([2.0, 3.6, 5.2, 6.8])
    faster = {**serial, "io_interference": {"runs": {"off": {"service_ms": 1.2}}}}
    assert disk_model(faster, {}) == service_disk(2_000_000, 1.6)
    fitted = disk_model({**prof, "transfer_ms_in_runtime": {"nvme_cold": float("nan")}}, {})
    assert (fitted.bandwidth_mbps, fitted.latency_ms, fitted.demand_first) == (2000.0, 0.5, True)


def test_page_cache_loads_take_the_interference_fitted_on_page_cache_loads() -> None:
    """Under the bandwidth emulation the profile fits the I/O's interference a second time, on the first emulated
    storage benchmarked (its loads read the page cache, not the disk); the simulator charges a storage's loads the fit
    of their kind, with its measured hand-offs. Under the delay emulation every storage reads the disk: one fit."""
    from specprefetch.runtime.measurement.window import CACHED_INTERFERENCE, page_cache_storage
    from specprefetch.runtime.simulation.simrun import profile_inputs

    assert page_cache_storage(_settings(emulation="bandwidth", storages=["nvme_cold", "ufs", "nvme"])) == "ufs"
    assert page_cache_storage(_settings(emulation="delay")) is None
    assert page_cache_storage(_settings(emulation="bandwidth", storages=["nvme_cold"])) is None
    comp = {"book_s": [1e-4] * 2, "pred_s": [2e-4] * 2, "post_pred_s": [1e-5] * 2, "moe_s": [1e-3] * 2,
            "gap_s": [5e-4] * 2, "head_s": 1e-3}
    disk = {"cpu_per_demand_ms": 0.3, "cpu_per_issue_ms": 0.6, "cpu_per_prefetch_ms": 0.5, "wake_ms": 0.2,
            "start_ms": 0.4}
    cached = {"cpu_per_demand_ms": 0.1, "cpu_per_issue_ms": 0.2, "cpu_per_prefetch_ms": 0.15, "wake_ms": 0.05,
              "start_ms": 0.3, "storage": "nvme"}
    prof = {"payload_bytes": 2_000_000, "transfer_ms_in_runtime": {"nvme_cold": 1.5}, "emulation_overshoot_ms": {},
            "transfer_ms": {"nvme_cold": {"transfer_ms": 1.9}},
            "compute_lockstep": {"opt": comp, "pred": comp}, "io_interference": disk, CACHED_INTERFERENCE: cached}

    def charged(storage: str, emulation: str) -> tuple[float, ...]:
        c = profile_inputs(prof, storage, _settings(emulation=emulation), True)[0]
        return c.cpu_per_demand_s, c.cpu_per_issue_s, c.cpu_per_prefetch_s, c.wake_s, c.start_s

    assert charged("nvme_cold", "bandwidth") == pytest.approx((3e-4, 6e-4, 5e-4, 2e-4, 4e-4))
    assert charged("ufs", "bandwidth") == pytest.approx((1e-4, 2e-4, 1.5e-4, 5e-5, 3e-4))
    assert charged("ufs", "delay") == charged("nvme_cold", "bandwidth")  # the disk plus a delay: the disk's fit
    del prof[CACHED_INTERFERENCE]  # a profile from before the second fit: the disk's
    assert charged("ufs", "bandwidth") == charged("nvme_cold", "bandwidth")


# ------------------------------------------------------------------------------------------ beyond the paper: DP, EWMA
def test_dp_allots_the_total_to_the_most_hits() -> None:
    """The DP rule's allotment is exact (brute force over every allotment, non-concave values too): the most value
    within the total, among equal values the smaller total; too small a total is one line."""
    import itertools
    import random

    from specprefetch.runtime.core.budget import allot_layer_budgets

    rng = random.Random(7)
    for _ in range(40):
        values = [{m: rng.choice([0.0, 0.5, 1.0, 1.5]) + 0.3 * m * rng.random() for m in range(1, 5)}
                  for _ in range(3)]
        total = rng.randint(3, 12)
        got = allot_layer_budgets(values, total)
        assert len(got) == 3 and sum(got) <= total
        best = max(sum(v[m] for v, m in zip(values, ms)) for ms in itertools.product(range(1, 5), repeat=3)
                   if sum(ms) <= total)
        assert sum(v[m] for v, m in zip(values, got)) == pytest.approx(best)
    flat = [{1: 1.0, 2: 1.0, 3: 1.0}] * 2  # nothing to gain beyond 1: the smallest total
    assert allot_layer_budgets(flat, 6) == (1, 1)
    assert allot_layer_budgets([{1: 0.2, 2: 0.9}, {1: 0.5, 2: 0.6}], 3) == (2, 1)  # the budget goes where it pays
    assert allot_layer_budgets([], 4) == ()
    with pytest.raises(BudgetError, match="need at least 3 transfers per token, the total is 2"):
        allot_layer_budgets([{1: 1.0}] * 3, 2)


def test_dp_budgets_come_from_the_profile_like_the_per_layer_window_rule() -> None:
    prof = _profile(m_max_dp_per_layer={"nvme_cold": [2, 6, 4]})
    assert layer_budgets(_settings(), prof, {"nvme_cold": 4, "nvme": 7}, "dp") == {"nvme_cold": (4, 2, 6, 4)}
    assert layer_budgets(_settings(3), prof, {"nvme_cold": 3}, "dp") == {}
    with pytest.raises(BudgetError, match=r"m_max_dp_per_layer\['nvme_cold'\] has 2 layers, expected 3"):
        layer_budgets(_settings(), _profile(m_max_dp_per_layer={"nvme_cold": [2, 6]}), {"nvme_cold": 4}, "dp")


class _Tr:
    def __init__(self, step: int, t0: float, t1: float, state: str = "done", charged: bool = True) -> None:
        self.step, self.t_start, self.t_end, self.state, self.charged = step, t0, t1, state, charged


def test_ewma_budget_folds_the_runs_windows_and_transfers() -> None:
    """The online rule: floor(d W / t) - queued, clamped to [1, n]; W and t move by the EWMA gain towards each
    window and each finished step's service time (busy time over the transfers served; uncharged, failed and the
    current step's transfers are not folded); unusable seeds are one line."""
    from specprefetch.runtime.core.budget import EWMA_ALPHA, EwmaBudget, ewma_budgets

    b = EwmaBudget(4.0, 1.0, 16)
    assert [b.budget(0), b.budget(2), b.budget(10), b.budget(0, lookahead=2)] == [4, 2, 1, 8]
    b.observe_window(12.0)
    assert b.window_ms == pytest.approx(4.0 + EWMA_ALPHA * 8.0) and b.budget(0) == 5
    b.observe_window(float("nan"))  # a layer that predicted nothing gives no window
    assert b.window_ms == pytest.approx(5.0)
    log = [_Tr(0, 0.0, 0.0), _Tr(1, 1.000, 1.002), _Tr(1, 1.001, 1.003), _Tr(1, 1.0, 1.1, "failed"),
           _Tr(1, 1.0, 1.1, charged=False), _Tr(2, 2.0, 2.004)]
    b.observe_transfers(log, step=2)  # step 1: busy 3 ms over 2 transfers; step 2 is still running
    assert b.transfer_ms == pytest.approx(1.0 + EWMA_ALPHA * 0.5)
    b.observe_transfers(log, step=2)  # nothing new
    assert b.transfer_ms == pytest.approx(1.0 + EWMA_ALPHA * 0.5)
    b.observe_transfers(log, step=3)
    assert b.transfer_ms == pytest.approx(1.0625 + EWMA_ALPHA * (4.0 - 1.0625))
    assert b.fresh().window_ms == 5.0 and b.fresh().transfer_ms == b.transfer_ms  # a new run starts from the seeds
    assert EwmaBudget(100.0, 1.0, 16).budget(0) == 16
    with pytest.raises(BudgetError, match="positive measured window and transfer time"):
        EwmaBudget(0.0, 1.0, 16)
    seeds = ewma_budgets({"window_ms_median": 3.0, "transfer_ms_used": {"nvme_cold": 1.5, "ufs": 6.0}}, 16)
    assert {st: e.budget(0) for st, e in seeds.items()} == {"nvme_cold": 2, "ufs": 1} and ewma_budgets(None, 4) == {}


def _sim_steps(n: int, k: int, L: int, steps: int, seed: int = 0) -> Any:
    from specprefetch.runtime.simulation.simulator import SimSequence, SimStep

    g = torch.Generator().manual_seed(seed)

    def step() -> SimStep:
        return SimStep(topk=[[torch.randperm(n, generator=g)[:k].tolist()] for _ in range(L)],
                       scores=[torch.rand(n, generator=g) for _ in range(L - 1)] + [None])

    return [SimSequence([step() for _ in range(steps)])]


def test_ewma_budget_adapts_in_the_shared_loop() -> None:
    """In the per-layer loop (here the simulator's; the runtime runs the same one): a window seeded 50 times too wide
    starts at every expert and comes down towards what the run measures, one seeded 50 times too narrow starts at
    one and goes up; every prediction records its budget, a fixed budget as given."""
    from specprefetch.runtime.core.budget import EwmaBudget
    from specprefetch.runtime.simulation.simulator import ComputeProfile, simulate

    n, k, L = 16, 2, 4
    comp = ComputeProfile.of({"book_s": [1e-4] * L, "moe_s": [1e-3] * L, "gap_s": [1e-3] * L, "head_s": 2e-3},
                             {"pred_s": [3e-4] * L, "post_pred_s": [1e-4] * L})
    from specprefetch.runtime.core.storage import StorageProfile

    disk = StorageProfile("nvme_cold", "emulated", 2000.0, 0.0, 1_000_000)  # 0.5 ms per expert
    seqs = _sim_steps(n, k, L, 30)
    fixed = simulate(seqs, "specprefetch", 3, 40, n, k, comp, disk, io_workers=1)
    assert {ev.m_max for ev in fixed.events if ev.n_tokens == 1 and ev.layer < L - 1} == {3}
    true_w = statistics.median(w for w in _windows(fixed.events))
    wide = simulate(seqs, "specprefetch", 3, 40, n, k, comp, disk, io_workers=1,
                    ewma=EwmaBudget(50 * true_w, 0.5, n))
    narrow = simulate(seqs, "specprefetch", 3, 40, n, k, comp, disk, io_workers=1,
                      ewma=EwmaBudget(true_w / 50, 0.5, n))
    for res, first in ((wide, n), (narrow, 1)):
        ms = [ev.m_max for ev in res.events if ev.n_tokens == 1 and ev.m_max is not None]
        assert ms[0] == first and len(ms) == 30 * (L - 1)
        late = statistics.fmean(ms[-3 * (L - 1):])
        assert (late < first) if first == n else (late > first)
    off = simulate(seqs, "off", 0, 40, n, k, comp, disk, io_workers=1, ewma=EwmaBudget(true_w, 0.5, n))
    assert all(ev.m_max is None for ev in off.events)  # a policy without a budget has no online rule either


def _windows(events: Any) -> list[float]:
    from specprefetch.runtime.measurement.window import per_layer_windows

    return list(per_layer_windows(events).values())


def test_budget_experiment_runs_the_extra_rules() -> None:
    """device.extra_rules: the budget experiment adds SpecPrefetch at the DP rule's per-layer budgets and with the
    online EWMA rule on every storage (its own configuration: same seed budget, another signature); the DP rule
    without the profile's DP budgets is one line."""
    from specprefetch.runtime.measurement.bench import plan_experiments

    s = _settings(storages=["nvme_cold"], slow_storage="nvme_cold", extra_rules=["dp", "ewma"])
    per_layer = {"nvme_cold": (2, 2, 3, 2)}
    dp = {"nvme_cold": (2, 1, 4, 2)}
    plan = plan_experiments(s, {"nvme_cold": 2}, ["budget"], per_layer, dp_m_max=dp)
    assert [c.label for c in plan["budget"]] == ["off", "specprefetch M=2", "specprefetch M=2 per layer 2/3/2",
                                                 "specprefetch M=2 per layer 1/4/2 (DP)",
                                                 "specprefetch M=2 (EWMA)"]
    assert plan["budget"][-1].key.endswith("|ewma") and len({c.signature for c in plan["budget"]}) == 5
    # the DP rule landing on the window rule's per-layer budgets: a row of that run under the DP rule's name
    same = plan_experiments(s, {"nvme_cold": 2}, ["budget"], per_layer, dp_m_max=per_layer)["budget"]
    assert len(same) == 5 and len({c.signature for c in same}) == 4 and same[3].rule == "dp"
    assert same[3].key == same[2].key  # one run, one routing record
    only = plan_experiments(_settings(storages=["nvme_cold"], slow_storage="nvme_cold"), {"nvme_cold": 2},
                            ["budget"], per_layer)
    assert len(only["budget"]) == 3
    with pytest.raises(SpecPrefetchError, match="no dp-rule budget for nvme_cold"):
        plan_experiments(s, {"nvme_cold": 2}, ["budget"], per_layer)
    # the simulated rule's budget in the same block: its own run where it differs from the window rule's, else a row
    # of that run under its name
    sim = _settings(storages=["nvme_cold"], slow_storage="nvme_cold", extra_rules=["simulated"])
    got = plan_experiments(sim, {"nvme_cold": 2}, ["budget"], per_layer, sim_m_max={"nvme_cold": 4})["budget"]
    assert [(c.label, c.rule) for c in got][-1] == ("specprefetch M=4 (SIMULATED)", "simulated")
    same = plan_experiments(sim, {"nvme_cold": 2}, ["budget"], per_layer, sim_m_max={"nvme_cold": 2})["budget"]
    assert same[-1].signature == same[1].signature and same[-1].rule == "simulated"
    with pytest.raises(SpecPrefetchError, match="no simulated-rule budget for nvme_cold"):
        plan_experiments(sim, {"nvme_cold": 2}, ["budget"], per_layer)


def test_dp_values_are_the_right_candidates_among_the_first_m() -> None:
    """The DP rule's worth of the M-th prefetch into a layer: how often the M-th candidate (as selected, absent
    experts in priority order) was among the layer's experts, averaged over decoding steps; non-decreasing in M."""
    from specprefetch.runtime.core.timeline import LayerEvent
    from specprefetch.runtime.simulation.budget_model import right_candidates

    def ev(step: int, layer: int, required: list[int], cands: list[int]) -> LayerEvent:
        e = LayerEvent(step=step, layer=layer, n_tokens=1, t_exec=0.0, required=required, hits=0, inflight=0,
                       misses=0, ready_pairs=0, t_pred=0.0 if cands else None)
        e.candidates = cands
        return e

    events = [ev(0, 0, [0, 1], [3, 5, 7]), ev(0, 1, [5, 7], []), ev(1, 0, [0, 1], [5, 2, 9]), ev(1, 1, [5, 6], [])]
    (layer1,) = right_candidates(events, 2, 3)
    assert layer1 == {1: 0.5, 2: 1.0, 3: 1.5}  # step 0: 3 no, 5 yes, 7 yes; step 1: 5 yes, then none


def test_pre_attention_budgets_and_plan() -> None:
    """Beyond the paper: the pre-attention policy's budget is the window rule on the attention window (the profile's
    per-storage key) when the budget is auto by the window rule, else the storage's budget; its experiment measures,
    per reference and slow storage, OFF, SpecPrefetch, and the pre-attention policy at its own budget and at
    SpecPrefetch's (one run where they are equal); the attention window is t_exec(l+1) - t_done(l)."""
    from specprefetch.config import section_defaults
    from specprefetch.runtime.core.budget import pre_attention_budgets
    from specprefetch.runtime.core.timeline import LayerEvent
    from specprefetch.runtime.measurement.bench import plan_experiments
    from specprefetch.runtime.measurement.window import pre_attention_windows

    s = section_defaults("device")
    prof = {"m_max_pre_attention_per_storage": {"nvme_cold": 1, "slow_ufs": 1}}
    budgets = {"nvme_cold": 3, "slow_ufs": 1}
    assert pre_attention_budgets(s, prof, budgets) == {"nvme_cold": 1, "slow_ufs": 1}
    assert pre_attention_budgets({**s, "m_max": 4}, prof, budgets) == budgets  # a configured budget: the storage's
    with pytest.raises(BudgetError, match="no pre-attention M_max for storage nvme_cold"):
        pre_attention_budgets(s, {}, budgets)
    plan = plan_experiments(s, budgets, ["pre_attention"], pre_m_max={"nvme_cold": 1, "slow_ufs": 1})
    assert {(c.storage, c.policy, c.m_max) for c in plan["pre_attention"]} == {
        ("nvme_cold", "off", 0), ("nvme_cold", "specprefetch", 3), ("nvme_cold", "pre_attention", 1),
        ("nvme_cold", "pre_attention", 3), ("slow_ufs", "off", 0), ("slow_ufs", "specprefetch", 1),
        ("slow_ufs", "pre_attention", 1)}
    with pytest.raises(SpecPrefetchError, match="needs its budgets per storage"):
        plan_experiments(s, budgets, ["pre_attention"])

    def ev(step: int, layer: int, t_exec: float, t_done: float, n: int = 1) -> LayerEvent:
        return LayerEvent(step=step, layer=layer, n_tokens=n, t_exec=t_exec, required=[], hits=0, inflight=0,
                          misses=0, ready_pairs=0, t_done=t_done)

    events = [ev(0, 0, 0.0, 0.01, n=5), ev(0, 1, 0.012, 0.02, n=5),  # a prefill: no window
              ev(1, 0, 0.1, 0.103), ev(1, 1, 0.1045, 0.108), ev(1, 2, 0.1095, 0.111)]
    assert pre_attention_windows(events) == pytest.approx([1.5, 1.5])


def test_batch_budgets_plan_and_blocks() -> None:
    """Beyond the paper: the batch experiment's budget for a batch of B is the window rule on the window measured at
    that batch (the profile's key) when the budget is auto by the window rule, the storage's budget for B = 1 and for
    a configured budget; each (storage, batch) is a block of its own, named <storage>@b<B>; a row's batch reads back
    into its signature (1 where the column is absent)."""
    from specprefetch.config import ConfigError, section_defaults, validate_config
    from specprefetch.runtime.core.budget import batch_budgets
    from specprefetch.runtime.measurement.bench import plan_experiments, row_signature, storage_blocks

    s = section_defaults("device", {"batch": {"sizes": [1, 4], "storages": ["nvme_cold", "slow_ufs"]},
                                    "budget_scope": "storage"})
    prof = {"m_max_batch_per_storage": {"4": {"nvme_cold": 7, "slow_ufs": 9}}}
    budgets = {"nvme_cold": 3, "slow_ufs": 4}
    got = batch_budgets(s, prof, budgets)
    assert got == {1: {"nvme_cold": 3, "slow_ufs": 4}, 4: {"nvme_cold": 7, "slow_ufs": 9}}
    assert batch_budgets({**s, "m_max": 2}, prof, budgets) == {1: budgets, 4: budgets}
    with pytest.raises(BudgetError, match="no M_max for a batch of 4 for storage nvme_cold, slow_ufs"):
        batch_budgets(s, {}, budgets)
    plan = plan_experiments(s, budgets, ["main", "batch"], batch_m_max=got)
    assert {(c.storage, c.batch, c.policy, c.m_max) for c in plan["batch"]} == {
        (st, b, p, m) for st in ("nvme_cold", "slow_ufs") for b in (1, 4)
        for p, m in (("off", 0), ("specprefetch", got[b][st]), ("resident", 0))}
    with pytest.raises(SpecPrefetchError, match="needs its budgets per batch size"):
        plan_experiments(s, budgets, ["batch"])
    blocks = {b.name: b for b in storage_blocks(plan)}
    assert set(blocks) == {"nvme_cold", "nvme_cold@b4", "slow_ufs", "slow_ufs@b4"}
    assert {c.batch for c in blocks["nvme_cold@b4"].configs} == {4} and blocks["nvme_cold@b4"].batch == 4
    assert blocks["nvme_cold"].experiments == ("main", "batch")  # batch 1 shares main's runs on the cold disk
    four = next(c for c in plan["batch"] if c.batch == 4 and c.policy == "specprefetch")
    assert "batch 4" in four.label and four.key.endswith("|b4")
    row = {"policy": "specprefetch", "storage": four.storage, "m_max": four.m_max, "compute_opt": True, "batch": "4"}
    assert row_signature(row) == four.signature
    assert row_signature({k: v for k, v in row.items() if k != "batch"})[7] == 1
    from specprefetch.config import REPO_ROOT, load_config

    cfg = load_config(REPO_ROOT / "config" / "config.yaml")
    cfg["device"]["batch"] = {"sizes": [1, 2], "storages": ["ram_offload"]}
    with pytest.raises(ConfigError, match="device.batch.storages.*'ram_offload'"):
        validate_config(cfg)
