# Routing traces: router inputs x^l, router logits and executed top-K of every MoE layer, per model and workload.
# Scatter/gather: each trace set is extracted by config traces.scatter jobs (shard i of N: a contiguous range of
# samples, each its own cluster job, rerun alone if it fails), then gathered into one trace directory (hard links).


wildcard_constraints:
    shard=r"\d+",


localrules:
    gather_traces,


rule extract_traces:
    input:
        workload=lambda w: P.workload_dir(w.workload),
        model=lambda w: P.model_inputs(w.model),
    output:
        directory("results/trace_shards/{model}/{workload}/{shard}"),
    params:
        cfg=lambda w: P.hash_of("traces", "image", model=w.model, workload=w.workload),
        model_dir=lambda w: P.model_dir_arg(w.model),
        n=P.scatter,
    log:
        "logs/extract_traces/{model}/{workload}/{shard}.log",
    benchmark:
        "benchmarks/extract_traces/{model}/{workload}/{shard}.tsv"
    threads: 1
    resources:
        **P.resources("extract_traces"),
    shell:
        "export OMP_NUM_THREADS={threads:q}; "
        "{SP} extract-traces --config {CFG:q} --model {wildcards.model:q} {params.model_dir} "
        "--workload-dir {input.workload:q} --shard {wildcards.shard:q}/{params.n:q} --threads {threads:q} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule gather_traces:
    input:
        lambda w: P.trace_shard_dirs(w.model, w.workload),
    output:
        directory("results/traces/{model}/{workload}"),
    log:
        "logs/gather_traces/{model}/{workload}.log",
    benchmark:
        "benchmarks/gather_traces/{model}/{workload}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    shell:
        "{SP} gather-traces {input:q} --out {output:q} 2>&1 | tee {log:q}"
