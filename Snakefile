# SpecPrefetch reproduction pipeline.
#   snakemake --cores all paper_tables                                 # embedded default (CPU, offline)
#   snakemake --cores all paper_tables --configfile config/paper.yaml  # the paper's setup (GPUs, hub)
# Every rule is one call into the `specprefetch` CLI; all logic lives in the library.

import shlex
import sys

from snakemake.utils import min_version

min_version("9.0")


# The embedded default, unless a profile is given with --configfile (which then replaces it, not extends it).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


from snakemake.exceptions import WorkflowError
from specprefetch.io import SpecPrefetchError
from specprefetch.workflow import Pipeline

# Validates the config (schema via snakemake.utils.validate, then cross-field checks) before any job runs,
# and writes the resolved config that every job reads (content-addressed under .snakemake/). The config files
# are read once more by the project's strict reader: Snakemake's YAML loader keeps the last of two equal keys.
try:
    P = Pipeline(config, workdir=workflow.basedir, config_files=workflow.configfiles)
except SpecPrefetchError as exc:
    raise WorkflowError(str(exc)) from None
CFG = P.config_path  # a path: the rules write it as {CFG:q}
# The CLI, run by the Python that runs Snakemake (works without an activated venv, and on cluster nodes
# that share the file system). Already shell words (each quoted), so the rules write it as {SP}, unquoted.
# Shell safety: every other placeholder in a `shell:` string is :q-quoted, or a param built with shlex
# (tests/test_shell_quoting.py checks both).
SP = shlex.join([sys.executable, "-m", "specprefetch"])


wildcard_constraints:
    model=P.regex(P.models),
    workload=P.regex(P.workloads + ["corpus"]),
    method=P.regex(P.methods),


include: "workflow/rules/data.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/traces.smk"
include: "workflow/rules/predictors.smk"
include: "workflow/rules/device.smk"
include: "workflow/rules/render.smk"


# Cheap rules run on the submitting host, never as a cluster job (SLURM profile: profiles/slurm).
localrules:
    paper_tables,
    prepare_workload,
    check_disjoint,
    gather_recall,
    gather_params,
    render_table,
    render_figure,
    compare_with_paper,
    write_preview,
    compile_preview,
    collect_device_benchmarks,
    archive_results,


if (msg := RT.skipped_pdf_message(P.cfg)) is not None:
    print(msg, file=sys.stderr)


rule paper_tables:
    """Tables 1-5, Figures 1, 4, 5, 6, the comparison with the paper, the preview, and the checks behind them."""
    input:
        P.paper_table_inputs(),
        RT.all_outputs(P.cfg),
        expand("results/device/accuracy/{model}.csv", model=DEV_MODELS),
    default_target: True


# Between-workflow caching of the expensive deterministic rules: with `snakemake --cache` and
# SNAKEMAKE_OUTPUT_CACHE=/shared/dir, a stand-in, tokenizer or trace shard made once (in any working directory with
# the same config sections and inputs) is reused instead of recomputed. The cache key covers the rule's command,
# its params (the hash of the config sections it reads) and its inputs, not the specprefetch code: clear the cache
# after changing stand-in pretraining or extraction code. Snakemake refuses a cached rule with a benchmark file
# (a cache hit has no timings), so under --cache these rules write none.
CACHEABLE_RULES = ("prepare_corpus", "train_tokenizer", "pretrain_stand_in", "extract_traces")
if workflow.workflow_settings is not None and workflow.workflow_settings.cache is not None:
    from snakemake.caching.rule import RuleCache

    for _name in CACHEABLE_RULES:
        if workflow.is_rule(_name) and (not workflow.workflow_settings.cache
                                        or _name in workflow.workflow_settings.cache):
            _rule = workflow.get_rule(_name)
            _rule.cache = RuleCache.from_rule(_rule, "omit-software")
            _rule._benchmark = None
