"""CLI of the runtime stage: expert store, window profiling, benchmarks, simulator, device-log collection,
and the accuracy check through lm-eval.

    specprefetch build-expert-store --config C --model M --model-dir D --out results/device/store/M
    specprefetch profile-window --config C --model M --model-dir D --store S --workload-dir W \\
        --predictor specprefetch=P --out results/device/window/M
    specprefetch bench-runtime --config C --model M --model-dir D --store S --window results/device/window/M \\
        --workload-dir W --predictor specprefetch=P --predictor fate=F --out results/device/measured/M.csv \\
        --routing-out results/device/measured/M.routing.safetensors [--device cuda]
    specprefetch simulate --config C --model M --traces T... --predictor ... --out results/device/simulated/M.csv
    specprefetch validate-simulator --config C --model M --window results/device/window/M \\
        --routing results/device/measured/M.routing.safetensors --out results/device/sim_validation/M.csv
    specprefetch collect-device-benchmarks --runs a.csv b.csv --external logs/*.csv --windows DIR... \\
        --validation V... --out-dir results/device
    specprefetch evaluate-offloaded --config C --model M --model-dir D --store S --predictor ... \\
        --tasks-dir results/workloads --out results/device/accuracy/M.csv
    specprefetch lm-eval --model specprefetch-offloaded --model_args config=C,model=M,model_dir=D,store=S \\
        --tasks T --include_path results/workloads/W/lm_eval [any other lm-eval argument]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from specprefetch.io import SpecPrefetchError, seed_everything, write_json_atomic
from specprefetch.stages.common import add_model_args, load_args_config, parse_predictor_args

log = logging.getLogger(__name__)


def _predictor_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--predictor", action="append", default=[], metavar="METHOD=DIR",
                   help="a trained predictor (specprefetch, fate); repeatable")


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default=None,
                   help="accelerator (default: config device.accelerator)")


def _setup(args: argparse.Namespace, need_prompts: bool = True) -> dict[str, Any]:
    """Config, settings, accelerator, model bundle, store, prompts and providers shared by the commands."""
    import torch

    from specprefetch.models import load_bundle
    from specprefetch.runtime.core.settings import (
        device_settings,
        platform_label,
        resolve_accelerator,
        variant_settings,
    )
    from specprefetch.runtime.core.store import ExpertStore
    from specprefetch.runtime.measurement.decode import prompts_from_workload

    cfg = load_args_config(args)
    settings = variant_settings(device_settings(cfg), getattr(args, "variant", None))
    accel = resolve_accelerator(settings, getattr(args, "device", None))
    torch.set_num_threads(int(settings["threads"]))
    seed_everything(int(cfg["seed"]))
    torch.use_deterministic_algorithms(False)  # inference only; keeps CUDA kernels available
    bundle = load_bundle(cfg, args.model, args.model_dir)
    store = ExpertStore(args.store)
    if store.manifest.get("model") not in ("", None, args.model):
        raise SpecPrefetchError(f"{args.store}: expert store of model {store.manifest['model']!r}, not {args.model!r}")
    prompts: list[Any] = []
    if need_prompts:
        from specprefetch.runtime.core.settings import experiments_for

        n = int(settings["n_prompts"])
        if "batch" in experiments_for(settings, args.model):  # a batch of B decodes the workload's first B prompts
            n = max(n, *(int(b) for b in settings["batch"]["sizes"]))
        prompts = prompts_from_workload(bundle, args.workload_dir, n, int(settings["max_prompt_tokens"]))
    from specprefetch.runtime.core.priority import provider_factories

    providers = provider_factories(parse_predictor_args(args.predictor), bundle.routing, accel, args.model)
    return {"cfg": cfg, "settings": settings, "accel": accel, "platform": platform_label(settings, accel),
            "bundle": bundle, "store": store, "prompts": prompts, "providers": providers}


def _harness(env: dict[str, Any]) -> Any:
    from specprefetch.runtime.measurement.session import Harness

    b = env["bundle"]
    pool = env["prompts"]
    return Harness(b.model, b.routing, env["store"], env["settings"], pool[:int(env["settings"]["n_prompts"])],
                   env["providers"], env["accel"], tokenizer=b.tokenizer, batch_pool=pool)


def _fragment(cfg: dict[str, Any], model: str) -> dict[str, Any]:
    return {"device": cfg.get("device"), "model": cfg["models"][model], "seed": cfg["seed"]}



def _window_profile(window: Path, model: str) -> dict[str, Any]:
    """``profile-window``'s profile.json for ``model`` (a clear error when missing, malformed or another model's)."""
    from specprefetch.runtime.core.budget import read_window_profile

    return read_window_profile(window, model)


# ------------------------------------------------------------------------------------------ commands
def _cmd_build_store(args: argparse.Namespace) -> None:
    from specprefetch.models import load_bundle
    from specprefetch.runtime.core.paper_scale import ExpertScale
    from specprefetch.runtime.core.settings import device_settings
    from specprefetch.runtime.core.store import build_expert_store

    cfg = load_args_config(args)
    sc = device_settings(cfg)["paper_scale"].get(args.model)
    scale = ExpertScale(**sc, seed=int(cfg["seed"])) if sc is not None else None
    bundle = load_bundle(cfg, args.model, args.model_dir)
    build_expert_store(bundle.model, args.out, bundle.routing, model_name=args.model,
                       config_fragment=_fragment(cfg, args.model), scale=scale)


def _cmd_profile_window(args: argparse.Namespace) -> None:
    from specprefetch.runtime.measurement.window import profile_window
    from specprefetch.runtime.simulation.budget_model import budget_curves

    env = _setup(args)
    harness = _harness(env)
    try:
        profile_window(harness, args.model, env["platform"], args.out, _fragment(env["cfg"], args.model),
                       budget_model=lambda profile, rows: budget_curves(profile, rows, harness.settings))
    finally:
        harness.close()


def _cmd_bench(args: argparse.Namespace) -> None:
    from specprefetch.runtime.measurement.bench import bench_runtime

    env = _setup(args)
    profile = _window_profile(args.window, args.model)
    harness = _harness(env)
    from specprefetch.runtime.core.settings import device_settings, variant_experiments

    experiments = (args.experiments.split(",") if args.experiments else
                   variant_experiments(device_settings(env["cfg"]), args.model, args.variant))
    if not experiments:
        raise SpecPrefetchError(f"variant {args.variant!r} measures none of {args.model}'s experiments "
                                "(device.model_experiments)")
    try:
        bench_runtime(harness, profile, args.model, env["platform"], args.out, experiments, args.routing_out,
                      _fragment(env["cfg"], args.model), seed=int(env["cfg"]["seed"]), variant=args.variant)
    finally:
        harness.close()


def _cmd_validate_simulator(args: argparse.Namespace) -> None:
    import torch

    from specprefetch.contracts import (
        ROUTING_FORMAT,
        WINDOW_SHAPE_KEYS,
        check_routing_values,
        check_window_profile,
        load_tensor_tree,
    )
    from specprefetch.runtime.core.settings import device_settings, variant_settings
    from specprefetch.runtime.simulation.simrun import (
        check_routing_record,
        summarize_validation,
        validate_simulator,
        write_validation_csv,
    )

    cfg = load_args_config(args)
    settings = variant_settings(device_settings(cfg), args.variant)  # the variant's emulation and I/O order
    torch.set_num_threads(int(settings["threads"]))
    profile = _window_profile(args.window, args.model)
    record = load_tensor_tree(args.routing, ROUTING_FORMAT, "routing record of bench-runtime")
    check_routing_record(record, args.routing, args.model)
    check_window_profile(profile, str(Path(args.window) / "profile.json"), required=WINDOW_SHAPE_KEYS)
    check_routing_values(record, str(args.routing), profile["n_layers"], profile["n_experts"], profile["top_k"])
    val = validate_simulator(record, profile, settings, args.variant)
    summary = summarize_validation(val)
    for inputs, errs in summary.items():
        log.info("simulator vs measured (%s inputs), mean |relative error|: %s", inputs,
                 ", ".join(f"{k} {v:.1%}" for k, v in errs.items() if v == v))  # NaN: no such row
    write_validation_csv(args.out, val)
    write_json_atomic(Path(args.out).with_suffix(".json"), {"validation_mean_abs_rel_error": summary})


def _cmd_simulate(args: argparse.Namespace) -> None:
    import torch

    from specprefetch.runtime.core.settings import device_settings, experiments_for
    from specprefetch.runtime.measurement.bench import write_runs_csv
    from specprefetch.runtime.simulation.simrun import simulate_platform
    from specprefetch.traces.store import TraceReader

    cfg = load_args_config(args)
    settings = device_settings(cfg)
    torch.set_num_threads(int(settings["threads"]))
    rows: list[dict[str, Any]] = []
    platforms: list[dict[str, Any]] = []
    arch = cfg["models"][args.model]["arch"]
    readers = [TraceReader(tdir) for tdir in args.traces]
    for reader in readers:
        if reader.manifest["model"] != args.model:
            raise SpecPrefetchError(f"{reader.dir}: trace of model {reader.manifest['model']!r}, not {args.model!r}")
    spec_like = _TraceSpec(readers[0])
    from specprefetch.runtime.core.priority import provider_factories

    providers = (provider_factories(parse_predictor_args(args.predictor), spec_like, "cpu", args.model)
                 if args.predictor else {})
    for platform in settings["simulator"]["platforms"]:
        r, meta = simulate_platform(platform, args.model, arch, readers, providers, settings,
                                    experiments_for(settings, args.model))
        rows.extend(r)
        platforms.append({"traces": [str(t) for t in args.traces], **meta})
    write_runs_csv(args.out, rows)
    write_json_atomic(Path(args.out).with_suffix(".json"), {"platforms": platforms})


class _TraceSpec:
    """The routing facts a trace carries (enough for FATE from its routers and for shape checks)."""

    def __init__(self, reader: Any) -> None:
        m = reader.manifest
        self.n_layers, self.n_experts, self.top_k = reader.n_layers, reader.n_experts, reader.top_k
        self.hidden_size, self.scoring, self.arch = reader.hidden_size, m.get("scoring", "softmax"), m.get("arch", "")
        self._reader = reader

    def router_tensors(self) -> dict[str, Any]:
        return self._reader.routers()


def _cmd_collect(args: argparse.Namespace) -> None:
    from specprefetch.runtime.measurement.external import collect_device_benchmarks, concat_csvs

    out = Path(args.out_dir)
    rows = collect_device_benchmarks(args.runs, args.external or [], out / "runs.csv")
    for name in ("window.csv", "window_events.csv", "latency.csv", "host.csv"):
        concat_csvs([Path(d) / name for d in args.windows], out / name)
    # the simulator's curves of every benchmark's window profile, the variants' too (each row names its emulation and
    # I/O order); the other window files are the default benchmarks' (Figure 1, the host of Tables 4-5)
    concat_csvs([Path(d) / "budget_curve.csv" for d in [*args.windows, *args.variant_windows]],
                out / "budget_curve.csv")
    if args.validation:
        concat_csvs(args.validation, out / "sim_validation.csv")
    log.info("runs.csv: %d rows (%d external logs)", len(rows), len(args.external or []))


def _cmd_evaluate_offloaded(args: argparse.Namespace) -> None:
    from specprefetch.runtime.core.budget import storage_budgets
    from specprefetch.runtime.lm_eval_model import evaluate_offloaded

    env = _setup(args, need_prompts=False)
    settings = env["settings"]
    profile = _window_profile(args.window, args.model) if args.window is not None else None
    ref = settings["reference_storage"]
    m_max = storage_budgets(settings, profile, [ref], need="--window (a profile-window directory)")[ref]
    evaluate_offloaded(env["cfg"], settings, args.model, env["bundle"], env["store"], env["providers"],
                       Path(args.tasks_dir), args.out, device=env["accel"], m_max=m_max)


def _cmd_lm_eval(args: argparse.Namespace) -> None:
    """lm-eval's command line (``lm-eval [run|ls|validate] ...``) with ``specprefetch-offloaded`` registered.

    lm-eval discovers no plugins: a model exists for its CLI only once the module that registers it is imported,
    so a bare ``lm_eval --model specprefetch-offloaded`` fails with "no model for this name found".
    """
    import sys

    from lm_eval.__main__ import cli_evaluate  # lm-eval's console-script entry point; it reads sys.argv

    import specprefetch.runtime.lm_eval_model  # noqa: F401  (registers "specprefetch-offloaded")

    argv = sys.argv
    sys.argv = ["lm-eval", *args.lm_eval_args]
    try:
        cli_evaluate()
    finally:
        sys.argv = argv


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-expert-store", help="write a model's routed experts as one aligned record each")
    add_model_args(p)
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=_cmd_build_store)

    p = sub.add_parser("profile-window", help="measure W_l, per-expert transfer time, M_max, layer latency")
    add_model_args(p)
    p.add_argument("--store", required=True, type=Path)
    p.add_argument("--workload-dir", required=True, type=Path)
    _predictor_arg(p)
    _device_arg(p)
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--variant", default=None, help="a device.variants name: profile under its emulation and I/O order")
    p.set_defaults(func=_cmd_profile_window)

    p = sub.add_parser("bench-runtime", help="paired interleaved runtime benchmarks -> runs CSV")
    add_model_args(p)
    p.add_argument("--store", required=True, type=Path)
    p.add_argument("--window", required=True, type=Path, help="profile-window output directory")
    p.add_argument("--workload-dir", required=True, type=Path)
    _predictor_arg(p)
    _device_arg(p)
    p.add_argument("--experiments", default=None, help="comma-separated subset (default: config)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--routing-out", type=Path, default=None, help="recorded routing for the simulator (.pt)")
    p.add_argument("--variant", default=None,
                   help="a device.variants name: its experiments under its emulation and I/O order (rows named "
                        "<experiment>@<variant>); --window must be that variant's profile")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("simulate", help="trace-driven simulator: platform estimates from routing traces")
    add_model_args(p, model_dir=False)
    p.add_argument("--traces", nargs="+", required=True, type=Path, help="routing traces (results/traces/M/W)")
    _predictor_arg(p)
    p.add_argument("--out", required=True, type=Path, help="simulated runs CSV (runs.csv format)")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("validate-simulator", help="replay every measured run in the simulator: error per metric")
    add_model_args(p, model_dir=False)
    p.add_argument("--window", required=True, type=Path, help="profile-window output directory")
    p.add_argument("--routing", required=True, type=Path, help="bench-runtime --routing-out file")
    p.add_argument("--out", required=True, type=Path, help="simulator-vs-measured CSV")
    p.add_argument("--variant", default=None,
                   help="a device.variants name: replay its benchmark under its emulation and I/O order (--window "
                        "and --routing must be that variant's)")
    p.set_defaults(func=_cmd_validate_simulator)

    p = sub.add_parser("collect-device-benchmarks", help="validate external logs, merge everything into runs.csv")
    p.add_argument("--runs", nargs="+", required=True, type=Path, help="measured and simulated run CSVs")
    p.add_argument("--external", nargs="*", default=[], type=Path, help="external device logs (.csv/.jsonl)")
    p.add_argument("--windows", nargs="+", required=True, type=Path, help="profile-window directories")
    p.add_argument("--variant-windows", nargs="*", default=[], type=Path,
                   help="the device.variants' profile-window directories (their budget_curve.csv only)")
    p.add_argument("--validation", nargs="*", default=[], type=Path)
    p.add_argument("--out-dir", required=True, type=Path)
    p.set_defaults(func=_cmd_collect)

    p = sub.add_parser("evaluate-offloaded", help="lm-eval through the offloaded runtime vs the plain model")
    add_model_args(p)
    p.add_argument("--store", required=True, type=Path)
    _predictor_arg(p)
    _device_arg(p)
    p.add_argument("--tasks-dir", required=True, type=Path, help="results/workloads (each with lm_eval/)")
    p.add_argument("--window", type=Path, default=None,
                   help="profile-window directory (its M_max, when device.m_max is auto)")
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=_cmd_evaluate_offloaded)

    # Everything after ``lm-eval`` is lm-eval's, ``--help`` included: no option prefix of our own ("\0" cannot
    # occur in a command-line argument), so argparse hands every word to the REMAINDER positional unread.
    p = sub.add_parser("lm-eval", prefix_chars="\0", add_help=False,
                       help="lm-eval's own CLI with the specprefetch-offloaded model registered "
                            "(arguments are lm-eval's; `specprefetch lm-eval --help` shows them)")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments, passed on unchanged")
    p.set_defaults(func=_cmd_lm_eval)
