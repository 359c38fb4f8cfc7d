"""The device benchmarks of a run in one page: per storage, every policy's throughput, gain vs OFF (mean and 95 %
paired-bootstrap CI, as Tables 4-5 print them), ReadyRecall and both overlap bounds; the per-layer budgets; the
run-to-run spread and the repeats a 2 pp CI half-width would need; the same configuration's throughput in each block
it was measured in; the simulator's error per inputs.

    python scripts/device_summary.py [RESULTS]     # default: results (a workdir's results/ or paper_tables/results)

Reads RESULTS/device/runs.csv (or RESULTS/runs.csv), and, when there, RESULTS/device/sim_validation.csv and the
window profiles RESULTS/device/window/*/profile.json. Prints Markdown.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from specprefetch.contracts import split_experiment
from specprefetch.metrics import bootstrap_ci
from specprefetch.render.data import paired_gains
from specprefetch.render.style import POLICY_ORDER
from specprefetch.runtime.measurement.bench import RunConfig, parse_layer_budgets


def _first(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def _ci(values: pd.Series) -> str:
    ci = bootstrap_ci(values.to_numpy())
    return f"{ci.mean:+.1f} [{ci.lo:+.1f}, {ci.hi:+.1f}]"


def _share(tps: float, bound: float) -> str:
    return f"{bound:.2f} ({tps / bound:.0%})" if bound == bound and bound > 0 else "–"


def policy_table(runs: pd.DataFrame, path: Path) -> str:
    """Per (model, experiment, storage): each configuration's mean tok/s, gain [CI] (vs the OFF of its block, with
    the same ``compute_opt``), ReadyRecall, demand loads per run, bounds and shares."""
    g = paired_gains(runs, path)
    out = []
    for (model, exp, storage), sub in g.groupby(["model", "experiment", "storage"], sort=False):
        if exp not in ("main", "storage", "matched", "budget", "sweep", "component"):
            continue
        if "measured_in" in sub and (sub["measured_in"] != exp).all():
            out.append(f"\n**{model}, {exp}, {storage}**: the runs of `{sub['measured_in'].iloc[0]}` (above)")
            continue
        out.append(f"\n**{model}, {exp}, {storage}** ({sub['repeat'].nunique()} repeats, "
                   f"{int(sub['n_tokens'].iloc[0])} decoded tokens per run)\n")
        out.append("| policy | M_max | tok/s | gain vs OFF % [95 % CI] | ReadyRecall | demand loads | "
                   "bound tok/s (share) | bound, own compute (share) |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        sub = sub.assign(**{k: sub[k].astype(object).fillna("") if k in sub else ""
                            for k in ("layer_m_max", "budget_rule")})
        keys = ["policy", "m_max", "compute_opt", "layer_m_max", "budget_rule"]
        order = {p: i for i, p in enumerate(POLICY_ORDER)}
        for key, r in sorted(sub.groupby(keys, sort=False, dropna=False), key=lambda kv: order.get(kv[0][0], 99)):
            pol, m, opt, layers, rule = key
            label = (f" (compute_opt {'on' if opt in (True, 'True', 1) else 'off'})" if exp == "component"
                     else f" (per layer {layers})" if layers else "")
            label += f" ({str(rule).upper()})" if rule else ""
            tps = r["tokens_per_s"].mean()
            b = r.get("bound_tokens_per_s", pd.Series(dtype=float)).mean()
            bo = r.get("bound_own_tokens_per_s", pd.Series(dtype=float)).mean()
            gain = "–" if pol == "off" else _ci(r["gain_pct"])
            out.append(f"| {pol} | {m}{label} | {tps:.2f} | {gain} | "
                       f"{r['ready_recall'].mean():.1%} | {r['demand_loads'].mean():.0f} | {_share(tps, b)} | "
                       f"{_share(tps, bo)} |")
    return "\n".join(out)


def spread(runs: pd.DataFrame, path: Path) -> str:
    """Every policy gain vs OFF (same compute_opt; all-resident, a reference, left out): the repeats measured, the
    per-repeat gains (their range beyond 8 repeats), their std, the CI half-width and the repeats for ±2 pp."""
    g = paired_gains(runs, path)
    out = ["\n**Run-to-run spread** (per-repeat gains vs OFF, percent points)\n",
           "| model | experiment | storage | configuration | repeats | per repeat | std | CI half-width | "
           "repeats for ±2 pp |", "|---|---|---|---|---:|---|---:|---:|---:|"]
    sel = g[~g["policy"].isin(["off", "resident"])]
    sel = sel.assign(**{k: sel[k].astype(object).fillna("") if k in sel else ""
                        for k in ("layer_m_max", "budget_rule")})
    keys = ["model", "experiment", "storage", "policy", "m_max", "compute_opt", "layer_m_max", "budget_rule"]
    for (model, exp, st, pol, m, opt, per, rule), r in sel.groupby(keys, sort=False, dropna=False):
        if r["measured_in"].iloc[0] != exp:
            continue  # a group reused from an earlier experiment: listed there
        vals = r.sort_values("repeat")["gain_pct"].to_numpy()
        ci = bootstrap_ci(vals)
        sd = float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan")
        # the half-width shrinks as 1/sqrt(n): n such that hw * sqrt(R / n) <= 2
        need = math.ceil(len(vals) * (ci.half_width / 2.0) ** 2) if ci.half_width > 0 else len(vals)
        shown = (", ".join(f"{v:+.1f}" for v in vals) if len(vals) <= 8
                 else f"{vals.min():+.1f} … {vals.max():+.1f}")
        config = RunConfig(exp, pol, st, int(m), str(opt).lower() == "true", parse_layer_budgets(per, int(m)),
                           rule=str(rule)).label
        out.append(f"| {model} | {exp} | {st} | {config} | {len(vals)} | {shown} | {sd:.1f} | "
                   f"{ci.half_width:.1f} | {max(need, len(vals))} |")
    return "\n".join(out)


def storage_physics(runs: pd.DataFrame, path: Path) -> str:
    """Figure 5 against the physics: per storage, SpecPrefetch's gain and the largest gain any prefetcher could
    reach on OFF's loads (OFF's overlap bound over OFF's throughput, per repeat)."""
    if "bound_tokens_per_s" not in runs:
        return ""
    g = paired_gains(runs, path)
    st = g[g["experiment"] == "storage"]
    out = ["\n**Figure 5 against the overlap bound** (percent, mean [95 % CI] over repeats)\n",
           "| storage | M_max | SpecPrefetch gain | largest possible gain (OFF's bound / OFF − 1) |",
           "|---|---:|---:|---:|"]
    for (model, storage), sub in st.groupby(["model", "storage"], sort=False):
        off = sub[sub["policy"] == "off"].set_index("repeat")
        sp = sub[sub["policy"] == "specprefetch"]
        ideal = (off["bound_tokens_per_s"] / off["tokens_per_s"] - 1.0) * 100.0
        out.append(f"| {model} {storage} | {int(sp['m_max'].iloc[0])} | {_ci(sp['gain_pct'])} | {_ci(ideal)} |")
    return "\n".join(out)


def across_blocks(runs: pd.DataFrame) -> str:
    """The same configuration measured in several blocks of one run (each block its own lockstep set of runs, of
    its size): its mean tok/s per block and the largest over the smallest. No prediction that does not know the
    block (the simulator from the profile) can be closer per configuration than this spread allows."""
    if "block" not in runs:
        return ""
    keys = [k for k in ("model", "policy", "storage", "m_max", "compute_opt", "layer_m_max", "budget_rule",
                        "lookahead", "batch", "emulation", "io_order") if k in runs]
    # a device.variants benchmark (rows "<experiment>@<variant>") has blocks of its own under the same names
    r = runs.assign(**{k: runs[k].astype(object).fillna("") for k in keys},
                    block=runs["block"] + runs["experiment"].str.extract(r"(@.*)$")[0].fillna(""))
    size = r.drop_duplicates([*keys, "block"]).groupby(["model", "block"]).size()  # the runs a round of a block
    out = ["\n**The same configuration in several blocks** (mean tok/s per block over its repeats)\n",
           "| configuration | per block | largest / smallest |", "|---|---|---:|"]
    for key, g in r.groupby(keys, sort=False):
        per = g.groupby("block", sort=True)["tokens_per_s"].mean()
        if len(per) < 2:
            continue
        cfg = dict(zip(keys, key, strict=True))
        label = f"{cfg['model']} {cfg['policy']} {cfg['storage']} M={cfg['m_max']} opt={cfg['compute_opt']}"
        reps = g.groupby("block", sort=True)["repeat"].nunique()
        shown = ", ".join(f"{b} ({size[cfg['model'], b]} runs a round, {reps[b]} repeats): {v:.2f}"
                          for b, v in per.items())
        out.append(f"| {label} | {shown} | {per.max() / per.min() - 1:+.1%} |")
    return "\n".join(out) if len(out) > 3 else ""


def validation(path: Path | None) -> str:
    if path is None:
        return ""
    v = pd.read_csv(path)
    if "experiment" in v:  # a variant's benchmark (rows "<experiment>@<variant>") is a model of its own here
        v["model"] = [f"{m}@{var}" if (var := split_experiment(str(e))[1]) else m
                      for m, e in zip(v["model"], v["experiment"])]
    out = ["\n**Simulator vs measured** (mean |relative error|; max over configurations in brackets)\n",
           "| model | inputs | tok/s | stall | ReadyRecall | hits |", "|---|---|---:|---:|---:|---:|"]
    for (model, inputs), r in v.groupby(["model", "inputs"] if "inputs" in v else ["model"], sort=False):
        cells = []
        for metric in ("tokens_per_s", "stall_ms", "ready_recall", "hits"):
            e = r[(r["metric"] == metric) & (r["policy"] != "resident")]["rel_error"].abs().dropna()
            cells.append(f"{e.mean():.1%} [{e.max():.1%}]" if len(e) else "–")
        out.append(f"| {model} | {inputs} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def profiles(root: Path) -> str:
    out = []
    for p in sorted((root / "device" / "window").glob("*/profile.json")):
        prof = json.loads(p.read_text())
        tr = prof.get("transfer_ms", {})
        out.append(f"\n**{prof['model']}**: window median {prof['window_ms_median']:.2f} ms over "
                   f"{prof['window_samples']} events; per storage M_max {prof['m_max_per_storage']}, transfer in the "
                   f"runtime (ms) {({k: round(v, 3) for k, v in prof['transfer_ms_in_runtime'].items()})}; cold read "
                   f"{tr.get('nvme_cold', {}).get('transfer_ms', float('nan')):.3f} ms "
                   f"({tr.get('nvme_cold', {}).get('cold_read_mode', '?')}); overshoot % "
                   f"{({k: round(v['pct_of_model'], 2) for k, v in prof.get('emulation_overshoot_ms', {}).items()})}; "
                   f"per-layer M_max {prof.get('m_max_per_layer')}")
        fl = prof.get("disk_fluctuation")
        if fl:
            out.append(f"cold disk over {fl['batches']} batches of {fl['reads_per_batch']} reads "
                       f"({fl['batch_s']:.2f} s each): batch medians {fl['min_ms']:.2f}–{fl['max_ms']:.2f} ms, "
                       f"cv {fl['cv_pct']:.1f} %; read p99 {fl['read_p99_ms']:.2f} ms, max {fl['read_max_ms']:.2f} ms")
    return "\n".join(out)


def main(argv: list[str]) -> None:
    root = Path(argv[1] if len(argv) > 1 else "results")
    path = _first(root / "device" / "runs.csv", root / "runs.csv")
    if path is None:
        raise SystemExit(f"{root}: no device/runs.csv or runs.csv")
    runs = pd.read_csv(path)
    runs = runs[runs["source"] == "measured"]
    print(profiles(root))
    print(policy_table(runs, path))
    print(storage_physics(runs, path))
    print(spread(runs, path))
    print(across_blocks(runs))
    print(validation(_first(root / "device" / "sim_validation.csv", root / "sim_validation.csv")))


if __name__ == "__main__":
    main(sys.argv)
