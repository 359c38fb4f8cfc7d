"""Next-layer expert predictors behind one interface (see ``base``): SpecPrefetch's low-rank adapters and
the baselines (FATE, Single MLP, ProMoE, Draft Model) and reference points (Naive Prefetch, frequency,
oracle)."""

# Exports are resolved on first use (PEP 562) so `specprefetch --help` and light subcommands don't import torch.
_EXPORTS = {
    "METHODS": "specprefetch.predictors.base",
    "Predictor": "specprefetch.predictors.base",
    "PredictorDims": "specprefetch.predictors.base",
    "PredictorError": "specprefetch.predictors.base",
    "build_predictor": "specprefetch.predictors.base",
    "load_predictor": "specprefetch.predictors.base",
    "read_meta": "specprefetch.predictors.base",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
