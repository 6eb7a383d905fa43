"""What a cached step computes below whole-step granularity (`cached_step_method`, docs/architecture.md §2): the pure
parts. `fitted`: the output predictor's features, fit and weights file; `tokens`: which tokens a cached step
computes and what that costs. The hook layer (`engine/hooks.py`) runs them."""

from __future__ import annotations

from .fitted import (
    DEFAULT_RIDGE,
    DEFAULT_WEIGHT_FLOOR,
    FEATURES,
    FITTER,
    ComputedCalls,
    PredictorFitter,
    feature_width,
    predict,
    sample_weights,
    solve_ridge,
    steering_target,
)
from .tokens import select_rows, subset_fraction, token_count
from .weights import PREDICTOR_FORMAT, FittedWeights, load_weights

__all__ = [
    "DEFAULT_RIDGE",
    "DEFAULT_WEIGHT_FLOOR",
    "FEATURES",
    "FITTER",
    "PREDICTOR_FORMAT",
    "ComputedCalls",
    "FittedWeights",
    "PredictorFitter",
    "feature_width",
    "load_weights",
    "predict",
    "sample_weights",
    "select_rows",
    "solve_ridge",
    "steering_target",
    "subset_fraction",
    "token_count",
]
