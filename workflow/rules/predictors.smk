# Next-layer expert predictors (SpecPrefetch adapters and baselines), trained on the corpus traces (training
# source "traces") or with the frozen model in the loop (source "online": no corpus traces are extracted at all),
# and ExpertRecall@M on every evaluation workload shard (Tables 1-3).


rule train_predictor:
    input:
        unpack(lambda w: P.train_inputs(w.model)),
    output:
        directory("results/predictors/{model}/{method}"),
    params:
        cfg=lambda w: P.hash_of("predictors", model=w.model),
        model_dir=lambda w: P.model_dir_arg(w.model),
        # shell words, quoted by P.traces_arg / P.model_dir_arg / P.train_command (inserted unquoted below)
        traces=lambda w, input: P.traces_arg(input.traces) if "traces" in input.keys() else "",
        # predictors.training.launcher (e.g. torchrun) is a command by design, inserted as shell words: trusted text
        run=P.train_command(sys.executable),
    log:
        "logs/train_predictor/{model}/{method}.log",
    benchmark:
        "benchmarks/train_predictor/{model}/{method}.tsv"
    threads: 1
    resources:
        **P.resources("train_predictor"),
    shell:
        "export OMP_NUM_THREADS={threads:q}; "
        "{params.run} train-predictor --config {CFG:q} --model {wildcards.model:q} --method {wildcards.method:q} "
        "{params.traces} --corpus {input.corpus:q} {params.model_dir} --out {output:q} 2>&1 | tee {log:q}"


rule evaluate_recall:
    input:
        traces="results/trace_shards/{model}/{workload}/{shard}",
        predictors=lambda w: [P.predictor_dir(w.model, m) for m in P.methods],
    output:
        "results/recall/{model}/{workload}/{shard}.csv",
    params:
        cfg=lambda w: P.hash_of("recall", model=w.model),
        predictors=lambda w: P.predictor_args(w.model, P.methods),  # quoted shell words
    log:
        "logs/evaluate_recall/{model}/{workload}/{shard}.log",
    benchmark:
        "benchmarks/evaluate_recall/{model}/{workload}/{shard}.tsv"
    threads: 1
    resources:
        **P.resources("evaluate_recall"),
    shell:
        "{SP} evaluate-recall --config {CFG:q} --model {wildcards.model:q} --workload {wildcards.workload:q} "
        "--traces {input.traces:q} {params.predictors} --out {output:q} 2>&1 | tee {log:q}"


rule gather_recall:
    input:
        P.recall_csvs(),
    output:
        recall="results/recall/recall.csv",
        per_layer="results/recall/recall_per_layer.csv",
    log:
        "logs/gather_recall/recall.log",
    benchmark:
        "benchmarks/gather_recall/recall.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "{SP} gather-recall --out {output.recall:q} {input:q} 2>&1 | tee {log:q}"


rule gather_params:
    input:
        P.predictor_dirs(),
    output:
        "results/predictors/params.csv",
    log:
        "logs/gather_params/params.log",
    benchmark:
        "benchmarks/gather_params/params.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "{SP} gather-params --out {output:q} {input:q} 2>&1 | tee {log:q}"
