# SpecPrefetch reproduction pipeline.
#   snakemake --cores all paper_tables                                 # embedded default (CPU, offline)
#   snakemake --cores all paper_tables --configfile config/paper.yaml  # the paper's setup (GPUs, hub)
# Every rule is one call into the `specprefetch` CLI; all logic lives in the library.
# Conventions (checked by tests/test_lint.py: `snakemake --lint`, snakefmt, tests/test_shell_quoting.py): the rules
# share one global, P (specprefetch.workflow.Pipeline), for every name, path, param and resource; a shell command
# reads nothing but its rule's directives (`{params.cli}` is the CLI, `{params.config:q}` the resolved config).

import os
import sys

from snakemake.utils import min_version

min_version("9.0")

from snakemake.exceptions import WorkflowError
from snakemake.settings.types import DeploymentMethod

from specprefetch.io import SpecPrefetchError
from specprefetch.render import targets as RT
from specprefetch.workflow import Pipeline

# The embedded default, unless a profile is given with --configfile (which then replaces it, not extends it).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# The CLI runs in every job under the Python that runs Snakemake (works without an activated venv, and on cluster
# nodes that share the file system), or, with `--sdm conda`, under the python of the rules' environment
# (envs/specprefetch.yaml; its post-deploy script installs this checkout, found through SPECPREFETCH_SOURCE).
CONDA = workflow.deployment_settings is not None and (
    DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
)
if CONDA:
    os.environ.setdefault("SPECPREFETCH_SOURCE", str(workflow.basedir))

# Validates the config (schema with enums from specprefetch.registry, then cross-field checks) before any job runs,
# and writes the resolved config that every job reads (content-addressed under .snakemake/). The config files
# are read once more by the project's strict reader: Snakemake's YAML loader keeps the last of two equal keys.
# Between-workflow caching of the expensive deterministic rules (specprefetch.workflow.CACHEABLE_RULES): with
# `snakemake --cache` and SNAKEMAKE_OUTPUT_CACHE=/shared/dir, a stand-in, tokenizer or trace shard made once (in any
# working directory with the same config and inputs) is reused instead of recomputed. The cache key covers the rule's
# command, its params (the hash of the config sections it reads, the resolved config's path, which names the hash of
# the whole config, and the interpreter) and its inputs, not the specprefetch code: clear the cache after changing
# stand-in pretraining or extraction code. Which rules a run caches: P.cache_mode (their `cache:` directive).
# (workdir and config_files by position: the Snakefile parser takes a line starting with `workdir` for the directive)
CACHE = workflow.workflow_settings.cache if workflow.workflow_settings is not None else None
PYTHON = "python" if CONDA else sys.executable
try:
    P = Pipeline(
        config,
        workflow.basedir,
        workflow.configfiles,
        python=PYTHON,
        cores=workflow.resource_settings.cores,
        cache=CACHE,
    )
except SpecPrefetchError as exc:
    raise WorkflowError(str(exc)) from None


wildcard_constraints:
    model=P.regex(P.models),
    workload=P.regex(P.workloads + ["corpus"]),
    method=P.regex(P.methods),


include: "workflow/rules/data.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/traces.smk"
include: "workflow/rules/predictors.smk"
include: "workflow/rules/realism.smk"
include: "workflow/rules/device.smk"
include: "workflow/rules/render.smk"


# Snakemake refuses a cached rule with a benchmark file (a cache hit has no timings), so under --cache these rules
# write none. Snakemake 9 has no public way to drop a rule's benchmark (its `benchmark` setter takes a path: "" warns
# and breaks rules with wildcards, [] and None raise), so this sets the private attribute, here only (tests/test_lint.py
# allows exactly this line).
for cached in sorted(P.cached_rules):
    workflow.get_rule(cached)._benchmark = None


# Cheap rules run on the submitting host, never as a cluster job (SLURM profile: profiles/slurm).
localrules:
    paper_tables,
    prepare_workload,
    check_disjoint,
    gather_traces,
    gather_recall,
    gather_params,
    render_table,
    render_figure,
    compare_with_paper,
    write_preview,
    compile_preview,
    collect_device_benchmarks,
    archive_results,
    write_numbers,


if (msg := RT.skipped_pdf_message(P.cfg)) is not None:
    print(msg, file=sys.stderr)


rule paper_tables:
    """Tables 1-5, Figures 1, 4, 5, 6, the comparison with the paper, the preview, and the checks behind them."""
    default_target: True
    input:
        P.paper_table_inputs(),
        RT.all_outputs(P.cfg),
        P.accuracy_csvs(),
