# Workloads (one directory per benchmark), the predictors' training corpus, and the stand-ins' tokenizer.


rule prepare_workload:
    output:
        directory(P.workload_dir()),
    log:
        P.log_path("prepare_workload", "{workload}"),
    benchmark:
        P.benchmark_path("prepare_workload", "{workload}")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("prepare_workload"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("image", workload=w.workload),
    shell:
        "{params.cli} prepare-workload --config {params.config:q} --workload {wildcards.workload:q} "
        "--out {output:q} 2>&1 | tee {log:q}"


rule prepare_corpus:
    output:
        directory(P.corpus_dir),
    log:
        P.log_path("prepare_corpus", "corpus"),
    benchmark:
        P.benchmark_path("prepare_corpus", "corpus")
    cache: P.cache_mode("prepare_corpus")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("prepare_corpus"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("train_corpus", "image"),
    shell:
        "{params.cli} prepare-corpus --config {params.config:q} --out {output:q} 2>&1 | tee {log:q}"


rule check_disjoint:
    """Proves the training corpus shares no sample (text or image) with any evaluation workload."""
    input:
        corpus=P.corpus_dir,
        workloads=P.workload_dirs(),
    output:
        P.disjointness_json,
    log:
        P.log_path("check_disjoint", "check"),
    benchmark:
        P.benchmark_path("check_disjoint", "check")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("check_disjoint"),
    params:
        cli=P.cli,
    shell:
        "{params.cli} check-disjoint --corpus {input.corpus:q} --workloads {input.workloads:q} --out {output:q} "
        "2>&1 | tee {log:q}"


rule train_tokenizer:
    input:
        P.corpus_dir,
    output:
        directory(P.tokenizer_dir),
    log:
        P.log_path("train_tokenizer", "tokenizer"),
    benchmark:
        P.benchmark_path("train_tokenizer", "tokenizer")
    cache: P.cache_mode("train_tokenizer")
    conda:
        P.conda_env
    threads: 1
    resources:
        **P.resources("train_tokenizer"),
    params:
        cli=P.cli,
        config=P.config_param,
        cfg=lambda w: P.hash_of("tokenizer"),
    shell:
        "{params.cli} train-tokenizer --config {params.config:q} --corpus {input:q} --out {output:q} "
        "2>&1 | tee {log:q}"
