# Offloaded-MoE runtime (issue 5): expert store, window profiling, paired runtime benchmarks, the trace-driven
# simulator, external device logs, and accuracy through lm-eval (Tables 4-5, Figures 1, 4, 5, 6).
# Timing rules take every core (threads: EXCLUSIVE_THREADS) so nothing else runs while they measure.

# Every core when --cores is given; 1 when it is not (e.g. `snakemake --report`, which runs nothing).
EXCLUSIVE_THREADS = workflow._cores or 1


from specprefetch.runtime.settings import device_settings

DEV = device_settings(P.cfg)
DEV_MODELS = DEV["models"]
DEV_WORKLOAD = DEV["workload"]
DEV_PREDICTORS = [m for m in ("specprefetch", "fate") if m in P.methods]
DEV_SIM_WORKLOADS = DEV["simulator"]["workloads"] or [DEV_WORKLOAD]


def dev_predictor_dirs(model):
    return [P.predictor_dir(model, m) for m in DEV_PREDICTORS]


def dev_predictor_args(model):
    """``--predictor METHOD=DIR ...``, already quoted shell words (the rules insert it as {params.predictors})."""
    return P.predictor_args(model, DEV_PREDICTORS)


localrules:
    collect_device_benchmarks,


rule build_expert_store:
    """Routed experts of a model, one aligned record each (+ manifest with sizes and sha256)."""
    input:
        model=lambda w: P.model_inputs(w.model),
    output:
        directory("results/device/store/{model}"),
    params:
        cfg=lambda w: P.hash_of(model=w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
    log:
        "logs/build_expert_store/{model}.log",
    benchmark:
        "benchmarks/build_expert_store/{model}.tsv"
    threads: 1
    resources:
        **P.resources("build_expert_store"),
    shell:
        "{SP} build-expert-store --config {CFG:q} --model {wildcards.model:q} {params.model_dir} --out {output:q} "
        "2>&1 | tee {log:q}"


rule profile_window:
    """W_l, per-expert transfer time per storage, M_max, event-level demand vs window, per-layer latency."""
    input:
        store="results/device/store/{model}",
        model=lambda w: P.model_inputs(w.model),
        workload=P.workload_dir(DEV_WORKLOAD),
        predictors=lambda w: dev_predictor_dirs(w.model),
    output:
        directory("results/device/window/{model}"),
    params:
        cfg=lambda w: P.hash_of("device", model=w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
        predictors=lambda w: dev_predictor_args(w.model),
    log:
        "logs/profile_window/{model}.log",
    benchmark:
        "benchmarks/profile_window/{model}.tsv"
    threads: EXCLUSIVE_THREADS
    resources:
        **P.resources("profile_window"),
    shell:
        "{SP} profile-window --config {CFG:q} --model {wildcards.model:q} {params.model_dir} "
        "--store {input.store:q} --workload-dir {input.workload:q} {params.predictors} --out {output:q} "
        "2>&1 | tee {log:q}"


rule bench_runtime:
    """Paired, interleaved, repeated decoding runs of every policy / budget / storage / compute_opt."""
    input:
        store="results/device/store/{model}",
        window="results/device/window/{model}",
        model=lambda w: P.model_inputs(w.model),
        workload=P.workload_dir(DEV_WORKLOAD),
        predictors=lambda w: dev_predictor_dirs(w.model),
    output:
        runs="results/device/measured/{model}.csv",
        routing="results/device/measured/{model}.routing.safetensors",
    params:
        cfg=lambda w: P.hash_of("device", model=w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
        predictors=lambda w: dev_predictor_args(w.model),
    log:
        "logs/bench_runtime/{model}.log",
    benchmark:
        "benchmarks/bench_runtime/{model}.tsv"
    threads: EXCLUSIVE_THREADS
    resources:
        **P.resources("bench_runtime"),
    shell:
        "{SP} bench-runtime --config {CFG:q} --model {wildcards.model:q} {params.model_dir} "
        "--store {input.store:q} --window {input.window:q} --workload-dir {input.workload:q} {params.predictors} "
        "--out {output.runs:q} --routing-out {output.routing:q} 2>&1 | tee {log:q}"


rule simulate_device:
    """Trace-driven simulator: the platform estimates (e.g. Snapdragon 8 Elite) from routing traces and predictors."""
    input:
        traces=lambda w: [P.trace_dir(w.model, wl) for wl in DEV_SIM_WORKLOADS],
        predictors=lambda w: dev_predictor_dirs(w.model),
    output:
        "results/device/simulated/{model}.csv",
    params:
        cfg=lambda w: P.hash_of("device", model=w.model),
        predictors=lambda w: dev_predictor_args(w.model),
    log:
        "logs/simulate_device/{model}.log",
    benchmark:
        "benchmarks/simulate_device/{model}.tsv"
    threads: 1
    resources:
        **P.resources("simulate_device"),
    shell:
        "{SP} simulate --config {CFG:q} --model {wildcards.model:q} --traces {input.traces:q} {params.predictors} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule validate_simulator:
    """Replay of every measured run in the simulator on this machine's profile: error per metric."""
    input:
        window="results/device/window/{model}",
        routing="results/device/measured/{model}.routing.safetensors",
    output:
        "results/device/sim_validation/{model}.csv",
    params:
        cfg=lambda w: P.hash_of("device", model=w.model),
    log:
        "logs/validate_simulator/{model}.log",
    benchmark:
        "benchmarks/validate_simulator/{model}.tsv"
    threads: 1
    resources:
        **P.resources("validate_simulator"),
    shell:
        "{SP} validate-simulator --config {CFG:q} --model {wildcards.model:q} --window {input.window:q} "
        "--routing {input.routing:q} --out {output:q} 2>&1 | tee {log:q}"


rule evaluate_offloaded:
    """lm-eval on the local tasks through the offloaded runtime, every policy, vs the plain model."""
    input:
        store="results/device/store/{model}",
        model=lambda w: P.model_inputs(w.model),
        workloads=[P.workload_dir(w) for w in P.workloads],
        predictors=lambda w: dev_predictor_dirs(w.model),
    output:
        "results/device/accuracy/{model}.csv",
    params:
        cfg=lambda w: P.hash_of("device", "workloads", model=w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
        predictors=lambda w: dev_predictor_args(w.model),
    log:
        "logs/evaluate_offloaded/{model}.log",
    benchmark:
        "benchmarks/evaluate_offloaded/{model}.tsv"
    threads: 1
    resources:
        **P.resources("evaluate_offloaded"),
    shell:
        "{SP} evaluate-offloaded --config {CFG:q} --model {wildcards.model:q} {params.model_dir} "
        "--store {input.store:q} {params.predictors} --tasks-dir results/workloads --out {output:q} "
        "2>&1 | tee {log:q}"


rule collect_device_benchmarks:
    """Validate external device logs and merge them with measured and simulated runs; gather the window files."""
    input:
        measured=expand("results/device/measured/{model}.csv", model=DEV_MODELS),
        simulated=expand("results/device/simulated/{model}.csv", model=DEV_MODELS),
        validation=expand("results/device/sim_validation/{model}.csv", model=DEV_MODELS),
        windows=expand("results/device/window/{model}", model=DEV_MODELS),
        external=DEV["external_logs"],
    output:
        runs="results/device/runs.csv",
        window="results/device/window.csv",
        window_events="results/device/window_events.csv",
        latency="results/device/latency.csv",
        validation="results/device/sim_validation.csv",
    log:
        "logs/collect_device_benchmarks/collect.log",
    benchmark:
        "benchmarks/collect_device_benchmarks/collect.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "{SP} collect-device-benchmarks --runs {input.measured:q} {input.simulated:q} "
        "--external {input.external:q} --windows {input.windows:q} --validation {input.validation:q} "
        "--out-dir results/device 2>&1 | tee {log:q}"
