"""Next-layer expert predictors behind one interface (see ``base``): SpecPrefetch's low-rank adapters and
the baselines (FATE, Single MLP, ProMoE, Draft Model) and reference points (Naive Prefetch, frequency,
oracle)."""

from specprefetch._lazy import lazy_exports

_EXPORTS = {
    "METHODS": "specprefetch.predictors.base",
    "Predictor": "specprefetch.predictors.base",
    "PredictorDims": "specprefetch.predictors.base",
    "PredictorError": "specprefetch.predictors.base",
    "build_predictor": "specprefetch.predictors.base",
    "load_predictor": "specprefetch.predictors.base",
    "read_meta": "specprefetch.predictors.base",
}


__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
