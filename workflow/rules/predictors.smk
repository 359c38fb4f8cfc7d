# Next-layer expert predictors (SpecPrefetch adapters and baselines), trained on the corpus traces (training
# source "traces") or with the frozen model in the loop (source "online": no corpus traces are extracted at all),
# and ExpertRecall@M on every evaluation workload shard (Tables 1-3). A learned method is trained once per seed
# (predictors.seeds; one job per model, method and seed): seed 0 in <method>, seed k in <method>.seed<k>.
# Beyond the paper, predictors.lookahead's methods are also trained to predict d >= 2 layers ahead
# (<method>.d<d>[.seed<k>]) and scored at every distance (evaluate_lookahead -> results/recall/lookahead.csv).


wildcard_constraints:
    seed_tag=P.SEED_TAG,
    ahead_tag=P.AHEAD_TAG,


rule train_predictor:
    input:
        unpack(lambda w: P.train_inputs(w.model)),
    output:
        directory(P.predictor_dir(seed="{seed_tag}", ahead="{ahead_tag}")),
    log:
        P.log_path("train_predictor", "{model}/{method}{ahead_tag}{seed_tag}"),
    benchmark:
        P.benchmark_path("train_predictor", "{model}/{method}{ahead_tag}{seed_tag}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("train_predictor"),
    params:
        config=P.config_param,
        cfg=lambda w: P.train_hash(w.model),
        seed_index=lambda w: P.seed_index(w.seed_tag),
        lookahead=lambda w: P.lookahead_of(w.ahead_tag),
        model_dir=lambda w: P.model_dir_arg(w.model),
        # shell words, quoted by P.traces_arg / P.model_dir_arg / P.train_command (inserted unquoted below)
        traces=lambda w, input: P.traces_arg(input.traces) if "traces" in input.keys() else "",
        # the CLI, or predictors.training.launcher (e.g. torchrun, a command by design: trusted text) running it;
        # the launcher is in the `cfg` hash, the interpreter is software: out of the params trigger, like `cli`
        run=P.untracked(P.train_command(P.python)),
    shell:
        "export OMP_NUM_THREADS={threads:q}; "
        "{params.run} train-predictor --config {params.config:q} --model {wildcards.model:q} "
        "--method {wildcards.method:q} --seed-index {params.seed_index:q} --lookahead {params.lookahead:q} {params.traces} --corpus {input.corpus:q} {params.model_dir} --out {output:q} "
        "2>&1 | tee {log:q}"


rule evaluate_recall:
    input:
        traces=P.trace_shard_dir(),
        predictors=lambda w: [d for _, d in P.seeded_predictor_dirs(w.model, P.methods)],
    output:
        P.recall_csv(),
    log:
        P.log_path("evaluate_recall", "{model}/{workload}/{shard}"),
    benchmark:
        P.benchmark_path("evaluate_recall", "{model}/{workload}/{shard}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("evaluate_recall"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("recall", model=w.model),
        predictors=lambda w: P.predictor_args(w.model, P.methods, every_seed=True),  # quoted shell words
    shell:
        "{params.cli} evaluate-recall --config {params.config:q} --model {wildcards.model:q} "
        "--workload {wildcards.workload:q} --traces {input.traces:q} {params.predictors} --out {output:q} "
        "2>&1 | tee {log:q}"


rule gather_recall:
    input:
        P.recall_csvs(),
    output:
        recall=P.result_path("recall"),
        per_layer=P.result_path("per_layer"),
    log:
        P.log_path("gather_recall", "recall"),
    benchmark:
        P.benchmark_path("gather_recall", "recall")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("gather_recall"),
    params:
        cli=P.cli,
    shell:
        "{params.cli} gather-recall --out {output.recall:q} {input:q} 2>&1 | tee {log:q}"


rule evaluate_lookahead:
    """ExpertRecall@M at every look-ahead distance (beyond the paper: fig_lookahead); d = 1 is Tables 1-2's."""
    input:
        traces=P.trace_shard_dir(),
        predictors=lambda w: [d for _, d in P.lookahead_predictor_dirs(w.model)],
    output:
        P.lookahead_csv(),
    log:
        P.log_path("evaluate_lookahead", "{model}/{workload}/{shard}"),
    benchmark:
        P.benchmark_path("evaluate_lookahead", "{model}/{workload}/{shard}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("evaluate_lookahead"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("recall", model=w.model),
        predictors=lambda w: P.predictor_args(w.model, (), lookahead=True),  # quoted shell words
    shell:
        "{params.cli} evaluate-recall --by-lookahead --config {params.config:q} --model {wildcards.model:q} "
        "--workload {wildcards.workload:q} --traces {input.traces:q} {params.predictors} --out {output:q} "
        "2>&1 | tee {log:q}"


rule gather_lookahead:
    input:
        P.lookahead_csvs(),
    output:
        P.result_path("lookahead"),
    log:
        P.log_path("gather_lookahead", "lookahead"),
    benchmark:
        P.benchmark_path("gather_lookahead", "lookahead")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("gather_lookahead"),
    params:
        cli=P.cli,
    shell:
        "{params.cli} gather-recall --by-lookahead --out {output:q} {input:q} 2>&1 | tee {log:q}"


rule gather_params:
    input:
        P.predictor_dirs(),
    output:
        P.result_path("params"),
    log:
        P.log_path("gather_params", "params"),
    benchmark:
        P.benchmark_path("gather_params", "params")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("gather_params"),
    params:
        cli=P.cli,
    shell:
        "{params.cli} gather-params --out {output:q} {input:q} 2>&1 | tee {log:q}"


rule measure_predictor_cost:
    """Each live predictor's time per layer pair as a share of one MoE layer's compute, timed interleaved on one
    thread (the Pareto figure's cost axis; beyond the paper), on the trained predictors (seed 0 of each method)."""
    input:
        P.predictor_dirs(),
    output:
        P.result_path("predictor_cost"),
    log:
        P.log_path("measure_predictor_cost", "predictor_cost"),
    benchmark:
        P.benchmark_path("measure_predictor_cost", "predictor_cost")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("measure_predictor_cost"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("models", "seed"),
    shell:
        "export OMP_NUM_THREADS={threads:q}; "
        "{params.cli} measure-predictor-cost --config {params.config:q} --out {output:q} {input:q} 2>&1 | tee {log:q}"
