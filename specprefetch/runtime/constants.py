"""Names shared by the runtime, its config section and the external-log schema (no heavy imports: the
Snakefile reads them while building the DAG). The vocabularies live in :mod:`specprefetch.contracts`, the
defaults in :mod:`specprefetch.config`; they are re-exported here for the runtime."""

from __future__ import annotations

from specprefetch.config import DEFAULT_PROFILES, PAPER_EXPERT_MB
from specprefetch.contracts import EMULATED, EXPERIMENTS, POLICIES, PREDICTING, STORAGES

__all__ = ["DEFAULT_PROFILES", "EMULATED", "EXPERIMENTS", "PAPER_EXPERT_MB", "POLICIES", "PREDICTING", "STORAGES"]
