# MoE stand-ins of the embedded default, trained from scratch by the pipeline (hub models need no rule).


rule pretrain_stand_in:
    input:
        corpus="results/corpus",
        tokenizer="results/tokenizer",
    output:
        directory("results/models/{model}"),
    params:
        cfg=lambda w: P.hash_of("image", "tokenizer", model=w.model),
    log:
        "logs/pretrain_stand_in/{model}.log",
    benchmark:
        "benchmarks/pretrain_stand_in/{model}.tsv"
    threads: 1  # one thread per job: on small CPUs, more threads cost far more than they give
    resources:
        **P.resources("pretrain_stand_in"),
    shell:
        "export OMP_NUM_THREADS={threads:q}; "
        "{SP} pretrain-stand-in --config {CFG:q} --model {wildcards.model:q} --corpus {input.corpus:q} "
        "--tokenizer {input.tokenizer:q} --out {output:q} 2>&1 | tee {log:q}"
