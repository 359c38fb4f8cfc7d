# Routing traces: router inputs x^l, router logits and executed top-K of every MoE layer, per model and workload.
# Scatter/gather: each trace set is extracted by config traces.scatter jobs (shard i of N: a contiguous range of
# samples, each its own cluster job, rerun alone if it fails), then gathered into one trace directory (hard links).


wildcard_constraints:
    shard=r"\d+",


rule extract_traces:
    input:
        workload=lambda w: P.workload_dir(w.workload),
        model=lambda w: P.model_inputs(w.model),
    output:
        directory(P.trace_shard_dir()),
    log:
        P.log_path("extract_traces", "{model}/{workload}/{shard}"),
    benchmark:
        P.benchmark_path("extract_traces", "{model}/{workload}/{shard}")
    cache: P.cache_mode("extract_traces")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("extract_traces"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("traces", "image", model=w.model, workload=w.workload),
        model_dir=lambda w: P.model_dir_arg(w.model),
        n=P.scatter,
    shell:
        "export OMP_NUM_THREADS={threads:q}; "
        "{params.cli} extract-traces --config {params.config:q} --model {wildcards.model:q} {params.model_dir} "
        "--workload-dir {input.workload:q} --shard {wildcards.shard:q}/{params.n:q} --threads {threads:q} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule gather_traces:
    input:
        lambda w: P.trace_shard_dirs(w.model, w.workload),
    output:
        directory(P.trace_dir()),
    log:
        P.log_path("gather_traces", "{model}/{workload}"),
    benchmark:
        P.benchmark_path("gather_traces", "{model}/{workload}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("gather_traces"),
    params:
        cli=P.cli,
    shell:
        "{params.cli} gather-traces {input:q} --out {output:q} 2>&1 | tee {log:q}"
