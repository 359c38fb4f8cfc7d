# Stand-in realism (issue 27): how predictable each model's routing is from one MoE layer to the next, measured on
# the evaluation workloads' trace shards: FATE ExpertRecall@K (training-free, so a model property), the cosine of
# adjacent router inputs and the expert-load entropy, by token type. Rendered as table0_realism beside Table 1.


rule measure_realism:
    input:
        P.realism_inputs(),
    output:
        P.result_path("realism"),
    log:
        P.log_path("measure_realism", "realism"),
    benchmark:
        P.benchmark_path("measure_realism", "realism")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("measure_realism"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=P.hash_of("models", "workloads"),
    shell:
        "export OMP_NUM_THREADS={threads:q}; "
        "{params.cli} measure-realism --config {params.config:q} --out {output:q} {input:q} 2>&1 | tee {log:q}"
