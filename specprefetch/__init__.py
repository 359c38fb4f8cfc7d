"""specprefetch: reproducibility pipeline for SpecPrefetch (parameter-efficient expert prefetching for MoE)."""

__version__ = "0.1.0"
