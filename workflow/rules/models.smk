# MoE stand-ins of the embedded default, trained from scratch by the pipeline (hub models need no rule).


rule pretrain_stand_in:
    input:
        corpus=P.corpus_dir,
        tokenizer=P.tokenizer_dir,
    output:
        directory(P.stand_in_dir()),
    log:
        P.log_path("pretrain_stand_in", "{model}"),
    benchmark:
        P.benchmark_path("pretrain_stand_in", "{model}")
    cache: P.cache_mode("pretrain_stand_in")
    conda:
        P.conda_env
    threads: 1  # one thread per job: on small CPUs, more threads cost far more than they give
    resources:
        **P.resources("pretrain_stand_in"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("image", "tokenizer", model=w.model),
    shell:
        "export OMP_NUM_THREADS={threads:q}; "
        "{params.cli} pretrain-stand-in --config {params.config:q} --model {wildcards.model:q} "
        "--corpus {input.corpus:q} --tokenizer {input.tokenizer:q} --out {output:q} 2>&1 | tee {log:q}"
