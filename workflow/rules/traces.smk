# Routing traces: router inputs x^l, router logits and executed top-K of every MoE layer, per model and workload.


rule extract_traces:
    input:
        workload=lambda w: P.workload_dir(w.workload),
        model=lambda w: P.model_inputs(w.model),
    output:
        directory("results/traces/{model}/{workload}"),
    params:
        cfg=lambda w: P.hash_of("traces", "image", model=w.model, workload=w.workload),
        model_dir=lambda w: P.model_dir_arg(w.model),
    log:
        "logs/extract_traces/{model}/{workload}.log",
    benchmark:
        "benchmarks/extract_traces/{model}/{workload}.tsv"
    threads: 1
    resources:
        **P.resources("extract_traces"),
    shell:
        "export OMP_NUM_THREADS={threads}; "
        "{SP} extract-traces --config {CFG} --model {wildcards.model} {params.model_dir} "
        "--workload-dir {input.workload} --threads {threads} --out {output} 2>&1 | tee {log}"
