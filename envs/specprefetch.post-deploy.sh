#!/usr/bin/env bash
# Run by `snakemake --sdm conda` inside the new environment, once, after creating it from specprefetch.yaml: installs
# the checkout that runs the workflow (editable, so the environment follows it; its dependencies are pinned in
# specprefetch.yaml). The Snakefile sets SPECPREFETCH_SOURCE to the workflow's directory (Snakemake copies this
# script under .snakemake/conda/, so it cannot find the checkout from its own path).
set -euo pipefail
python -m pip install --no-deps -e "${SPECPREFETCH_SOURCE:?not set: run this through the Snakefile (snakemake --sdm conda)}"
