"""Next-layer expert predictors behind one interface (see ``base``): SpecPrefetch's low-rank adapters and
the baselines (FATE, Single MLP, ProMoE, Draft Model) and reference points (Naive Prefetch, frequency,
oracle)."""

from specprefetch.predictors.base import (
    METHODS,
    Predictor,
    PredictorDims,
    PredictorError,
    build_predictor,
    load_predictor,
    read_meta,
)

__all__ = ["METHODS", "Predictor", "PredictorDims", "PredictorError", "build_predictor", "load_predictor",
           "read_meta"]
