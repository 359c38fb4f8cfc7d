"""Using the simulator: validation against measured runs, and estimates for platforms that are not here.

``validate_simulator`` replays every recorded benchmark configuration (its routing and priorities, saved by
``bench_runtime``; the same in every repeat) and compares throughput, ReadyRecall and the counters with what the
runtime measured, averaged over the repeats (``sim_validation.csv``: one row per inputs, configuration and metric,
with the relative error). Two kinds of inputs: this machine's window profile (``profile``), and each repeat's own
compute durations and transfer time (``run``), which separates the host's drift from the simulator's model.

``simulate_platform`` replays a model's routing trace (``results/traces/{model}/{workload}``) with the trained
predictors' priorities on a platform profile (:mod:`specprefetch.runtime.simulation.platforms`) and writes runs in the
``runs.csv`` format with ``source = simulated``.
"""

from __future__ import annotations

import csv
import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specprefetch.contracts import EMULATED, RUN_COLUMNS, split_experiment, variant_experiment
from specprefetch.io import SpecPrefetchError, atomic_path
from specprefetch.registry import runtime_providers
from specprefetch.runtime.core.budget import EwmaBudget, ewma_budgets, profiled_physical_ms
from specprefetch.runtime.core.storage import StorageProfile, delayed_device, make_profile
from specprefetch.runtime.measurement.bench import (
    ONLINE_RULES,
    Signature,
    parse_layer_budgets,
    plan_experiments,
    run_batch,
    run_budget_rule,
    run_lookahead,
    write_runs_csv,
)
from specprefetch.runtime.measurement.window import CACHED_INTERFERENCE, HAND_OFFS
from specprefetch.runtime.simulation.platforms import (
    calibrate_bandwidth,
    compute_profile_of,
    platform_m_max,
    platform_profile,
    platform_storage,
)
from specprefetch.runtime.simulation.simulator import (
    ComputeProfile,
    SimSequence,
    relative_error,
    sequences_from_record,
    sequences_from_trace,
    simulate,
)

log = logging.getLogger(__name__)

VALIDATION_COLUMNS = ["inputs", "platform", "model", "experiment", "policy", "storage", "m_max", "compute_opt",
                      "layer_m_max", "lookahead", "budget_rule", "metric", "measured", "simulated", "rel_error",
                      "n_repeats"]
METRICS = ("tokens_per_s", "ready_recall", "hits", "misses", "prefetched", "wasted", "stall_ms")


def local_storage(profile: dict[str, Any], storage: str,
                  settings: dict[str, Any]) -> tuple[StorageProfile, float | None, float]:
    """(device model, fixed transfer s, per-transfer overhead s) of ``storage`` as profiled on this machine."""
    payload = int(profile["payload_bytes"])
    overshoot = profile.get("emulation_overshoot_ms", {})
    if storage in EMULATED:
        prof = make_profile(storage, settings, payload, lambda: profiled_physical_ms(profile))
        if prof.delayed:  # the disk's model plus the delay (the read's own spread is in the disk's model)
            return delayed_device(disk_model(profile, settings), prof), None, 0.0
        over = overshoot.get(storage, {}).get("mean_ms", 0.0) if isinstance(overshoot, dict) else 0.0
        return prof, None, float(over) * 1e-3
    if storage == "nvme_cold":
        return disk_model(profile, settings), None, 0.0
    fixed = float(profile["transfer_ms"].get(storage, {}).get("transfer_ms", 0.0)) * 1e-3
    return StorageProfile(storage, "ram"), fixed, 0.0


def disk_model(profile: Mapping[str, Any], settings: Mapping[str, Any]) -> StorageProfile:
    """The physical disk as the simulator models it from the window profile, from the runtime's measured service
    times (in a run, the time some transfer was running divided by their number, so the workers' overlap, their
    wake-ups and the CPU they share with compute are in it):

    - one expert per ``transfer_ms_in_runtime['nvme_cold']``, the service time of a prefetching run at M = K, whose
      I/O workers keep several loads in flight: the disk's throughput (its data phases, served in turn);
    - plus, where the profile's lockstep block measured it (``io_interference.runs.off.service_ms``: OFF, whose
      demand loads the compute thread performs one after another), the serial service time's excess over it as a
      pipelined latency (``BandwidthModel``: concurrent loads overlap it). So a load alone takes the serial service
      time and loads in flight together one expert per the overlapped one, as the runs measured: on the 2-core VM
      an expert took 1.16-1.22 ms to serve alone (OFF) and 0.97-0.99 ms at M = 8-16 (run D, DeepSeek).

    Without the serial service time the disk has no latency (each load takes the overlapped service time, which
    made loads performed alone, OFF's and a low budget's, too fast). The isolated cold read (``transfer_ms
    ['nvme_cold']``, one request after an idle disk) is not what the runtime's loads take: its excess over the service
    time, once charged to every load as a latency, made the simulator's OFF 24 % slower than the benchmark's in a
    fresh run on the 2-core VM (docs/device-benchmarks.md#simulator). A profile without the runtime's service time gets
    the disk fitted alone (``physical_model``: the concurrent throughput of the disk with nothing computing), which
    over-states it while the model computes on a small host."""
    payload = int(profile["payload_bytes"])
    demand_first = settings.get("io_order", "demand_first") == "demand_first"
    service = float((profile.get("transfer_ms_in_runtime") or {}).get("nvme_cold", float("nan")))
    if math.isfinite(service) and service > 0:
        return service_disk(payload, service, demand_first, serial_service_ms(profile))
    phys = profile.get("physical_model")
    if not phys:
        raise SpecPrefetchError("profile.json has no physical_model: nvme_cold was not profiled")
    return StorageProfile("nvme_cold", "emulated", float(phys["bandwidth_mbps"]), float(phys["latency_ms"]),
                          payload, demand_first=demand_first)


def serial_service_ms(profile: Mapping[str, Any]) -> float:
    """The disk's per-expert service time with its loads performed one after another: the OFF run of the profile's
    lockstep block on the reference storage (``window.step_load``'s ``service_ms``); NaN where not measured (a profile
    from before it was, or a window profile whose reference storage is not the disk)."""
    off = ((profile.get("io_interference") or {}).get("runs") or {}).get("off") or {}
    return float(off.get("service_ms", float("nan")))  # service_disk takes it only when finite and above the other


def profile_inputs(profile: dict[str, Any], storage: str, settings: dict[str, Any],
                   compute_opt: bool = True) -> tuple[ComputeProfile, StorageProfile, float | None]:
    """What the window profile alone says of a run on ``storage``: (compute model, device model, fixed transfer s).
    The compute is the profile's all-resident per-layer durations plus, per transfer, the worker hand-off
    (:func:`local_storage`) and the compute the I/O takes from the model. Where the profile fitted it
    (``io_interference``, ``window.fit_interference``: per demand load, per layer that issues prefetches and per
    prefetch, measured as the slowdown of the model's compute in its OFF and prefetching runs), that fit: for a
    storage whose loads read the page cache, not the disk, the one on such a storage where the profile has it
    (``io_interference_cached``, ``window.page_cache_storage``). Else the host CPU an isolated load takes
    (``transfer_cpu_ms``: the cold disk's, or a page-cache read's for the emulated and RAM storages) per prefetch.
    And, where the fit measured them (``wake_ms``, ``start_ms``), the thread hand-offs of a load a worker serves: to
    the worker, asleep when the load was offered, and back to the compute thread after a load it waited for (under
    FIFO I/O, every demand load queued behind prefetches takes both)."""
    device, fixed, overhead = local_storage(profile, storage, settings)
    fit = profile.get("io_interference")
    if not reads_disk(storage, settings) and isinstance(profile.get(CACHED_INTERFERENCE), Mapping):
        fit = profile[CACHED_INTERFERENCE]  # page-cache loads: the fit on such a storage (window.page_cache_storage)
    if isinstance(fit, Mapping):
        return ComputeProfile.from_profile(profile, compute_opt, overhead,
                                           float(fit["cpu_per_prefetch_ms"]) * 1e-3,
                                           float(fit["cpu_per_issue_ms"]) * 1e-3,
                                           float(fit["cpu_per_demand_ms"]) * 1e-3,
                                           **_hand_offs_s(fit)), device, fixed
    cpu_ms = profile.get("transfer_cpu_ms", {}).get("nvme_cold" if storage == "nvme_cold" else "ram", 0.0)
    return ComputeProfile.from_profile(profile, compute_opt, overhead, float(cpu_ms) * 1e-3), device, fixed


def _hand_offs_s(d: Mapping[str, Any]) -> dict[str, float]:
    """A profile's or a run's measured thread hand-offs (``wake_ms``, ``start_ms``: ``window.hand_offs``) as
    :class:`ComputeProfile`'s ``wake_s`` and ``start_s``; 0 where one was not measured (a profile or record from
    before it was) or is not finite."""
    out = {}
    for ms in HAND_OFFS:
        v = float(d.get(ms, 0.0) or 0.0)
        out[ms.replace("_ms", "_s")] = v * 1e-3 if math.isfinite(v) and v > 0 else 0.0
    return out


def check_routing_record(record: Any, path: str | Path, model: str) -> None:
    """A routing record must be ``model``'s and hold, per run, its row and well-formed events (one line if not)."""
    import torch

    from specprefetch.contracts import ContractError, require

    where = str(path)
    if not isinstance(record, dict):
        raise ContractError(f"{where}: not a routing record (top level is {type(record).__name__})")
    if require(record, "model", str, where) != model:
        raise ContractError(f"{where}: routing record of model {record['model']!r}, not {model!r}")
    runs = require(record, "runs", dict, where)
    if not runs:
        raise ContractError(f"{where}: routing record holds no runs")
    for key, run in runs.items():
        at = f"{where} run {key!r}"
        if not isinstance(run, dict):
            raise ContractError(f"{at}: must be a mapping")
        row = require(run, "row", dict, at)
        for col in ("storage", "policy"):
            require(row, col, str, f"{at} row")
        for col in ("m_max", "capacity_experts", *METRICS):
            require(row, col, (int, float), f"{at} row")
        require(row, "compute_opt", (bool, int), f"{at} row")
        for i, ev in enumerate(require(run, "events", list, at)):
            if not isinstance(ev, dict):
                raise ContractError(f"{at} event {i}: must be a mapping")
            require(ev, "step", int, f"{at} event {i}")
            require(ev, "layer", int, f"{at} event {i}")
            if not isinstance(ev.get("topk"), torch.Tensor) or ev["topk"].dim() != 2:
                raise ContractError(f"{at} event {i}: 'topk' must be a 2-D tensor (tokens x K)")
            if ev.get("scores") is not None and not isinstance(ev["scores"], torch.Tensor):
                raise ContractError(f"{at} event {i}: 'scores' must be a tensor or null")
        for i, rep in enumerate(run.get("repeats") or []):
            for col in METRICS:
                require(rep, col, (int, float), f"{at} repeat {i}")
        for i, tm in enumerate(run.get("timings") or []):
            if not isinstance(tm, dict):
                raise ContractError(f"{at} timing {i}: must be a mapping")
            require(tm, "transfer_ms", (int, float), f"{at} timing {i}")
            comp = require(tm, "compute", dict, f"{at} timing {i}")
            require(comp, "head_s", (int, float), f"{at} timing {i} compute")
            for col in ("book_s", "pred_s", "post_pred_s", "moe_s", "gap_s"):
                vals = require(comp, col, list, f"{at} timing {i} compute")
                if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in vals):
                    raise ContractError(f"{at} timing {i} compute {col!r}: must be finite durations >= 0")


def reads_disk(storage: str, settings: Mapping[str, Any]) -> bool:
    """Whether a run on ``storage`` reads the physical disk: ``nvme_cold``, or an emulated storage under the ``delay``
    emulation (the disk plus a delay)."""
    return storage == "nvme_cold" or (storage in EMULATED and settings.get("emulation") == "delay")


def service_disk(payload: int, service_ms: float, demand_first: bool = True,
                 serial_ms: float = float("nan")) -> StorageProfile:
    """A disk serving one expert of ``payload`` bytes per ``service_ms``, one at a time, and, given the service time of
    a load served alone (``serial_ms``), the excess of that over ``service_ms`` as a pipelined latency (none if it is
    not measured or not larger)."""
    latency = serial_ms - service_ms if math.isfinite(serial_ms) and serial_ms > service_ms else 0.0
    return StorageProfile("nvme_cold", "emulated", payload / (service_ms * 1e-3) / 1e6, latency, payload,
                          demand_first=demand_first)


def _run_storage(profile: dict[str, Any], timing: dict[str, Any], storage: str,
                 dev: StorageProfile) -> StorageProfile:
    """The device of the ``run`` inputs: on the disk itself (``nvme_cold``) the disk serves one expert per the run's
    own service time, as :func:`disk_model` models it at the profiled one; other devices keep ``dev``: RAM, the
    ``bandwidth`` emulation, and a ``delay``-emulated storage, whose loads read the disk too but whose measured service
    time holds their delays (taking it for the disk's charged every delay twice: 28 % too slow an OFF on UFS 2.1)."""
    t = float(timing.get("service_ms", float("nan")))
    if storage != "nvme_cold" or not (math.isfinite(t) and t > 0):
        return dev
    return service_disk(int(profile["payload_bytes"]), t, dev.demand_first)


def _simulate_run(run: dict[str, Any], seqs: list[SimSequence], profile: dict[str, Any], compute: ComputeProfile,
                  storage: StorageProfile, fixed: float | None) -> dict[str, float]:
    """The simulated metrics of one recorded configuration on the given inputs."""
    m = run["row"]
    res = simulate(seqs, m["policy"], int(m["m_max"]), int(m["capacity_experts"]), int(profile["n_experts"]),
                   int(profile["top_k"]), compute, storage, int(profile["io_workers"]), bool(m["compute_opt"]),
                   fixed_transfer_s=fixed, layer_m_max=parse_layer_budgets(m.get("layer_m_max"), int(m["m_max"])),
                   lookahead=run_lookahead(m), ewma=_online(m, profile))
    return {"tokens_per_s": res.tokens_per_s, **{k: float(getattr(res.stats, k)) for k in METRICS[1:]}}


def _online(row: dict[str, Any], profile: dict[str, Any]) -> EwmaBudget | None:
    """The online budget rule of a recorded run, seeded from the window profile as the benchmark seeded it."""
    rule = run_budget_rule(row)
    if rule not in ONLINE_RULES:
        return None
    online = ewma_budgets(profile, int(profile["n_experts"]))
    if row["storage"] not in online:
        raise SpecPrefetchError(f"run on {row['storage']} used the online {rule} budget, but the window profile has no "
                              "service time for that storage")
    return online[row["storage"]]


def validate_simulator(record: dict[str, Any], profile: dict[str, Any], settings: dict[str, Any],
                       variant: str | None = None) -> list[dict[str, Any]]:
    """Simulate every recorded run and compare it with what the runtime measured (mean over the repeats), twice:

    - ``inputs = profile``: this machine's window profile (compute per layer, the cold disk's fitted bandwidth, the
      emulated devices' models, the CPU a transfer takes) -- what a prediction made before the runs would use;
    - ``inputs = run``: each repeat simulated with that repeat's own compute durations and, on the cold disk, its
      per-expert service time (``timings``), the simulated metrics then averaged -- the host's drift between
      profiling and benchmarking and the CPU the transfers took from compute are in the inputs, so what is left is
      the simulator's model of overlap, queueing and the runtime's decisions.

    ``variant``: the device.variants entry whose benchmark ``record`` is (its rows are named "<experiment>@<variant>",
    as runs.csv names them); ``settings`` must be that variant's (``settings.variant_settings``).
    """
    n_layers = int(profile["n_layers"])
    rows = []
    simulated: dict[str, dict[str, float]] = {}  # run key -> inputs -> simulated tok/s
    for key, run in tqdm(sorted(record["runs"].items()), desc="simulator validation", disable=None):
        m = run["row"]
        if run_batch(m) != 1:
            continue  # the simulator replays one sequence: a batch's compute is not in the window profile
        seqs = sequences_from_record(run["events"], n_layers)
        compute, storage, fixed = profile_inputs(profile, m["storage"], settings, bool(m["compute_opt"]))
        sims = {"profile": _simulate_run(run, seqs, profile, compute, storage, fixed)}
        overhead = compute.io_overhead_s
        timings = run.get("timings") or []
        if timings:  # the run's own compute includes what its transfers took from it: no separate CPU charge
            per = [_simulate_run(run, seqs, profile, ComputeProfile.of(t["compute"], io_overhead_s=overhead,
                                                                        **_hand_offs_s(t)),
                                 _run_storage(profile, t, m["storage"], storage), fixed) for t in timings]
            sims["run"] = {k: statistics.fmean(p[k] for p in per) for k in METRICS}
        repeats = run.get("repeats") or [m]
        simulated[key] = {inputs: float(got["tokens_per_s"]) for inputs, got in sims.items()}
        for inputs, got in sims.items():
            for metric in METRICS:
                measured = statistics.fmean(float(r[metric]) for r in repeats)
                rows.append({"inputs": inputs, **{k: m.get(k, "") for k in VALIDATION_COLUMNS[1:11]},
                             "metric": metric, "measured": measured, "simulated": float(got[metric]),
                             "rel_error": relative_error(float(got[metric]), measured), "n_repeats": len(repeats)})
        rows += _service_rows(m, timings, storage, settings)
    rows += _speedup_rows(record["runs"], simulated)
    if variant:  # a device.variants benchmark's rows are named as runs.csv names them: "<experiment>@<variant>"
        rows = [{**r, "experiment": variant_experiment(split_experiment(str(r["experiment"]))[0], variant)}
                for r in rows]
    return rows


def _service_rows(row: Mapping[str, Any], timings: Sequence[Mapping[str, Any]], device: StorageProfile,
                  settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``service_ms`` (``profile`` inputs): the disk's per-expert service time the profile gave the simulator against
    the one the run measured (mean over its repeats), for a run on the disk itself (``nvme_cold``): how far the disk
    moved between profiling and benchmarking, the part of the throughput's error from the profile that no model of
    the runtime can remove. Not for a ``delay``-emulated storage: its loads read the same disk but their measured
    service time holds their delays too, so it is not the disk's."""
    got = [float(t["service_ms"]) for t in timings if math.isfinite(float(t.get("service_ms", float("nan"))))]
    if not (row["storage"] == "nvme_cold" and got and device.bandwidth_mbps > 0):
        return []
    measured, sim = statistics.fmean(got), device.charged_bytes / (device.bandwidth_mbps * 1e6) * 1e3
    return [{"inputs": "profile", **{k: row.get(k, "") for k in VALIDATION_COLUMNS[1:11]}, "metric": "service_ms",
             "measured": measured, "simulated": sim, "rel_error": relative_error(sim, measured), "n_repeats": len(got)}]


def _block_of(row: Mapping[str, Any]) -> tuple[str, bool]:
    return str(row.get("block") or f"{row['measured_in'] if row.get('measured_in') else row['experiment']}|"
               f"{row['storage']}"), bool(row["compute_opt"])


def _speedup_rows(runs: Mapping[str, Any], simulated: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    """``speedup``: each configuration's throughput over its block's OFF (same block, same compute_opt), measured
    as the mean of the per-repeat ratios (paired: one block's runs share each repeat's seconds) and simulated as the
    ratio of the simulated throughputs. It is what a prediction for another host can be held to: the host's speed
    at the hour of the run (and the lockstep protocol's cost) moves OFF and the configuration alike, the absolute
    ``tokens_per_s`` with it."""
    offs = {_block_of(r["row"]): k for k, r in runs.items() if r["row"]["policy"] == "off"}
    rows = []
    for key, run in sorted(runs.items()):
        m = run["row"]
        off_key = offs.get(_block_of(m))
        if m["policy"] == "off" or off_key is None or key not in simulated or off_key not in simulated:
            continue  # OFF itself, or a run the simulator does not replay (a batch)
        mine = {int(r["repeat"]): float(r["tokens_per_s"]) for r in run.get("repeats") or [m]}
        base = {int(r["repeat"]): float(r["tokens_per_s"]) for r in runs[off_key].get("repeats") or
                [runs[off_key]["row"]]}
        shared = sorted(set(mine) & set(base))
        if not shared:
            continue
        measured = statistics.fmean(mine[i] / base[i] for i in shared)
        for inputs, tps in simulated[key].items():
            off_tps = simulated[off_key].get(inputs, float("nan"))
            sim = tps / off_tps if off_tps > 0 else float("nan")
            rows.append({"inputs": inputs, **{k: m.get(k, "") for k in VALIDATION_COLUMNS[1:11]}, "metric": "speedup",
                         "measured": measured, "simulated": sim, "rel_error": relative_error(sim, measured),
                         "n_repeats": len(shared)})
    return rows


def summarize_validation(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean absolute relative error per inputs and metric (NaNs, e.g. zero measured counts, skipped)."""
    out: dict[str, dict[str, float]] = {}
    for inputs in dict.fromkeys(r["inputs"] for r in rows):
        out[inputs] = {}
        for metric in (*METRICS, "speedup", "service_ms"):
            errs = [abs(r["rel_error"]) for r in rows
                    if r["inputs"] == inputs and r["metric"] == metric and math.isfinite(r["rel_error"])]
            out[inputs][metric] = statistics.fmean(errs) if errs else float("nan")
    return out


def simulate_platform(platform: str, model: str, arch: str, trace_readers: Sequence[Any],
                      providers: dict[str, Callable[[], Any]], settings: dict[str, Any],
                      experiments: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Estimate the platform's runs (runs.csv rows, source=simulated) from routing traces (the sequences of every
    trace, ``simulator.max_samples`` per trace, replayed as one run); returns (rows, info)."""
    p = platform_profile(platform)
    if arch not in p["archs"]:
        log.info("%s: platform %s describes %s, not %s; skipped", model, platform, "/".join(p["archs"]), arch)
        return [], {"platform": platform, "skipped": f"arch {arch}"}
    first = trace_readers[0]
    n_layers, n_experts, top_k = first.n_layers, first.n_experts, first.top_k
    max_samples = int(settings["simulator"]["max_samples"])
    seqs_by_policy: dict[str, list[SimSequence]] = {}
    base = [s for r in trace_readers for s in sequences_from_trace(r, None, max_samples)]
    for pol in runtime_providers():  # SpecPrefetch, FATE, plugin policies: each named as its provider
        if pol in providers:
            seqs_by_policy[pol] = [s for r in trace_readers
                                   for s in sequences_from_trace(r, providers[pol](), max_samples)]
    seqs_by_policy["pred0"] = seqs_by_policy.get("specprefetch", base)
    from specprefetch.runtime.core.settings import cache_capacity

    capacity = cache_capacity(settings, n_layers * n_experts, top_k)
    compute = compute_profile_of(p, n_layers)
    bw = calibrate_bandwidth(p, base, capacity, n_experts, top_k, compute)
    log.info("%s: NVMe bandwidth fitted to OFF = %.3f tok/s: %.0f MB/s", platform, p["off_tokens_per_s"], bw)
    m_max = platform_m_max(p, settings, bw, compute, n_experts)  # runtime.core.budget's rule or the configured one
    s = {**settings, "reference_storage": "nvme_cold"}
    plan = plan_experiments(s, m_max, [e for e in experiments
                                       if e not in ("component", "budget", "lookahead", "batch")])
    rows = []
    results: dict[Signature, Any] = {}  # deterministic: a configuration of several experiments is simulated once
    for exp, configs in plan.items():
        for cfg in configs:
            if cfg.storage not in ("nvme_cold", *EMULATED):
                continue  # no RAM-offload figure for the phone
            storage = platform_storage(p, cfg.storage, settings, bw)
            if cfg.signature not in results:
                results[cfg.signature] = simulate(seqs_by_policy.get(cfg.policy, base), cfg.policy, cfg.m_max,
                                                  capacity, n_experts, top_k, compute, storage, p["io_workers"], True)
            res = results[cfg.signature]
            st = res.stats
            rows.append({"platform": platform, "model": model, "experiment": exp, "policy": cfg.policy,
                         "storage": cfg.storage, "m_max": cfg.budget,
                         "compute_opt": True, "repeat": 0, "tokens_per_s": res.tokens_per_s,
                         "ready_recall": st.ready_recall, "n_tokens": res.n_tokens, "hits": st.hits,
                         "misses": st.misses, "prefetched": st.prefetched, "wasted": st.wasted,
                         "stall_ms": st.stall_ms, "source": "simulated", "inflight": st.inflight,
                         "cancelled": st.cancelled, "demand_loads": st.demand_loads, "io_errors": 0,
                         "peak_cache_experts": st.peak_cache_experts, "capacity_experts": capacity,
                         "record_bytes": int(p["expert_mb"] * 1e6), "expert_format": "int4"})
    return rows, {"platform": platform, "nvme_bandwidth_mbps": bw, "capacity": capacity, "m_max": m_max,
                  "n_sequences": len(base), "n_traces": len(trace_readers), "compute": compute.__dict__}


def write_validation_csv(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=VALIDATION_COLUMNS, lineterminator="\n")
            w.writeheader()
            for r in rows:
                w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


__all__ = ["RUN_COLUMNS", "local_storage", "profile_inputs", "simulate_platform", "summarize_validation",
           "validate_simulator", "write_runs_csv", "write_validation_csv"]
