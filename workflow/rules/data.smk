# Workloads (one directory per benchmark), the predictors' training corpus, and the stand-ins' tokenizer.


rule prepare_workload:
    output:
        directory("results/workloads/{workload}"),
    params:
        cfg=lambda w: P.hash_of("image", workload=w.workload),
    log:
        "logs/prepare_workload/{workload}.log",
    benchmark:
        "benchmarks/prepare_workload/{workload}.tsv"
    threads: 1
    resources:
        **P.resources("prepare_workload"),
    shell:
        "{SP} prepare-workload --config {CFG:q} --workload {wildcards.workload:q} --out {output:q} "
        "2>&1 | tee {log:q}"


rule prepare_corpus:
    output:
        directory("results/corpus"),
    params:
        cfg=lambda w: P.hash_of("train_corpus", "image"),
    log:
        "logs/prepare_corpus/corpus.log",
    benchmark:
        "benchmarks/prepare_corpus/corpus.tsv"
    threads: 1
    resources:
        **P.resources("prepare_corpus"),
    shell:
        "{SP} prepare-corpus --config {CFG:q} --out {output:q} 2>&1 | tee {log:q}"


rule check_disjoint:
    """Proves the training corpus shares no sample (text or image) with any evaluation workload."""
    input:
        corpus="results/corpus",
        workloads=expand("results/workloads/{workload}", workload=P.workloads),
    output:
        "results/workloads/disjointness.json",
    log:
        "logs/check_disjoint/check.log",
    benchmark:
        "benchmarks/check_disjoint/check.tsv"
    threads: 1
    resources:
        **P.resources("check_disjoint"),
    shell:
        "{SP} check-disjoint --corpus {input.corpus:q} --workloads {input.workloads:q} --out {output:q} "
        "2>&1 | tee {log:q}"


rule train_tokenizer:
    input:
        "results/corpus",
    output:
        directory("results/tokenizer"),
    params:
        cfg=lambda w: P.hash_of("tokenizer"),
    log:
        "logs/train_tokenizer/tokenizer.log",
    benchmark:
        "benchmarks/train_tokenizer/tokenizer.tsv"
    threads: 1
    resources:
        **P.resources("train_tokenizer"),
    shell:
        "{SP} train-tokenizer --config {CFG:q} --corpus {input:q} --out {output:q} 2>&1 | tee {log:q}"
