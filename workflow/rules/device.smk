# Offloaded-MoE runtime (issue 5): expert store, window profiling, paired runtime benchmarks, the trace-driven
# simulator, external device logs, and accuracy through lm-eval (Tables 4-5, Figures 1, 4, 5, 6).
# Timing rules take every core (threads: P.exclusive_threads) so nothing else runs while they measure.
# profile_window, bench_runtime and validate_simulator also measure each device.variants entry ({variant_tag}: ""
# or "@<variant>").


wildcard_constraints:
    variant_tag=P.VARIANT_TAG,


rule build_expert_store:
    """Routed experts of a model, one aligned record each (+ manifest with sizes and sha256)."""
    input:
        model=lambda w: P.model_inputs(w.model),
    output:
        directory(P.store_dir()),
    log:
        P.log_path("build_expert_store", "{model}"),
    benchmark:
        P.benchmark_path("build_expert_store", "{model}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("build_expert_store"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.store_hash(w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
    shell:
        "{params.cli} build-expert-store --config {params.config:q} --model {wildcards.model:q} {params.model_dir} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule profile_window:
    """W_l, per-expert transfer time per storage, M_max, event-level demand vs window, per-layer latency."""
    input:
        store=P.store_dir(),
        model=lambda w: P.model_inputs(w.model),
        workload=P.workload_dir(P.device_workload),
        predictors=lambda w: P.device_predictor_dirs(w.model),
    output:
        directory(P.window_dir(tag="{variant_tag}")),
    log:
        P.log_path("profile_window", "{model}{variant_tag}"),
    benchmark:
        P.benchmark_path("profile_window", "{model}{variant_tag}")
    conda:
        P.conda_env
    threads: P.exclusive_threads
    resources:
        **P.resources("profile_window"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("device", model=w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
        predictors=lambda w: P.device_predictor_args(w.model),
        variant=lambda w: P.variant_arg(w.variant_tag),
    shell:
        "{params.cli} profile-window --config {params.config:q} --model {wildcards.model:q} {params.model_dir} "
        "--store {input.store:q} --workload-dir {input.workload:q} {params.predictors} {params.variant} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule bench_runtime:
    """Paired, interleaved, repeated decoding runs of every policy / budget / storage / compute_opt."""
    input:
        store=P.store_dir(),
        window=P.window_dir(tag="{variant_tag}"),
        model=lambda w: P.model_inputs(w.model),
        workload=P.workload_dir(P.device_workload),
        predictors=lambda w: P.device_predictor_dirs(w.model),
    output:
        runs=P.measured_csv(tag="{variant_tag}"),
        routing=P.routing_file(tag="{variant_tag}"),
    log:
        P.log_path("bench_runtime", "{model}{variant_tag}"),
    benchmark:
        P.benchmark_path("bench_runtime", "{model}{variant_tag}")
    conda:
        P.conda_env
    threads: P.exclusive_threads
    resources:
        **P.resources("bench_runtime"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("device", model=w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
        predictors=lambda w: P.device_predictor_args(w.model),
        variant=lambda w: P.variant_arg(w.variant_tag),
    shell:
        "{params.cli} bench-runtime --config {params.config:q} --model {wildcards.model:q} {params.model_dir} "
        "--store {input.store:q} --window {input.window:q} --workload-dir {input.workload:q} {params.predictors} "
        "{params.variant} --out {output.runs:q} --routing-out {output.routing:q} 2>&1 | tee {log:q}"


rule simulate_device:
    """Trace-driven simulator: the platform estimates (e.g. Snapdragon 8 Elite) from routing traces and predictors."""
    input:
        traces=lambda w: [P.trace_dir(w.model, wl) for wl in P.device_sim_workloads],
        predictors=lambda w: P.device_predictor_dirs(w.model),
    output:
        P.simulated_csv(),
    log:
        P.log_path("simulate_device", "{model}"),
    benchmark:
        P.benchmark_path("simulate_device", "{model}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("simulate_device"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("device", model=w.model),
        predictors=lambda w: P.device_predictor_args(w.model),
    shell:
        "{params.cli} simulate --config {params.config:q} --model {wildcards.model:q} --traces {input.traces:q} "
        "{params.predictors} --out {output:q} 2>&1 | tee {log:q}"


rule validate_simulator:
    """Replay of every measured run in the simulator on this machine's profile: error per metric (each variant's
    benchmark on its own profile, under its emulation and I/O order)."""
    input:
        window=P.window_dir(tag="{variant_tag}"),
        routing=P.routing_file(tag="{variant_tag}"),
    output:
        P.sim_validation_csv(tag="{variant_tag}"),
    log:
        P.log_path("validate_simulator", "{model}{variant_tag}"),
    benchmark:
        P.benchmark_path("validate_simulator", "{model}{variant_tag}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("validate_simulator"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("device", model=w.model),
        variant=lambda w: P.variant_arg(w.variant_tag),
    shell:
        "{params.cli} validate-simulator --config {params.config:q} --model {wildcards.model:q} "
        "--window {input.window:q} --routing {input.routing:q} {params.variant} --out {output:q} 2>&1 | tee {log:q}"


rule evaluate_offloaded:
    """lm-eval on the local tasks through the offloaded runtime, every policy, vs the plain model."""
    input:
        store=P.store_dir(),
        window=P.window_dir(),
        model=lambda w: P.model_inputs(w.model),
        workloads=P.workload_dirs(),
        predictors=lambda w: P.device_predictor_dirs(w.model),
    output:
        P.accuracy_csv(),
    log:
        P.log_path("evaluate_offloaded", "{model}"),
    benchmark:
        P.benchmark_path("evaluate_offloaded", "{model}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("evaluate_offloaded"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("device", "workloads", model=w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
        predictors=lambda w: P.device_predictor_args(w.model),
        # the directory of the workloads' lm-eval tasks (<dir>/<workload>/lm_eval), from the inputs
        tasks_dir=lambda w, input: P.parent_dir(input.workloads),
    shell:
        "{params.cli} evaluate-offloaded --config {params.config:q} --model {wildcards.model:q} {params.model_dir} "
        "--store {input.store:q} --window {input.window:q} {params.predictors} --tasks-dir {params.tasks_dir:q} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule collect_device_benchmarks:
    """Validate external device logs and merge them with measured and simulated runs; gather the window files."""
    input:
        measured=[P.measured_csv(m, tag) for m, tag in P.device_benchmarks()],
        simulated=[P.simulated_csv(m) for m in P.device_models],
        validation=[P.sim_validation_csv(m, tag) for m, tag in P.device_benchmarks()],
        windows=[P.window_dir(m) for m in P.device_models],
        variant_windows=[P.window_dir(m, tag) for m, tag in P.device_benchmarks() if tag],
        external=P.device["external_logs"],
    output:
        runs=P.result_path("runs"),
        window=P.result_path("window"),
        window_events=P.result_path("window_events"),
        latency=P.result_path("latency"),
        host=P.result_path("host"),
        budget_curve=P.result_path("budget_curve"),
        validation=P.sim_validation_table,
    log:
        P.log_path("collect_device_benchmarks", "collect"),
    benchmark:
        P.benchmark_path("collect_device_benchmarks", "collect")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("collect_device_benchmarks"),
    params:
        cli=P.cli,
        out_dir=lambda w, output: P.parent_dir(output.runs),  # the CLI writes every output there
    shell:
        "{params.cli} collect-device-benchmarks --runs {input.measured:q} {input.simulated:q} "
        "--external {input.external:q} --windows {input.windows:q} --variant-windows {input.variant_windows:q} "
        "--validation {input.validation:q} "
        "--out-dir {params.out_dir:q} 2>&1 | tee {log:q}"
