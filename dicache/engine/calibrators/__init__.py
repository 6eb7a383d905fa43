"""Calibrators: what a cached step adds in place of the skipped middle blocks."""

from __future__ import annotations

from .base import Calibrator
from .corrected import CorrectedTaylorCalibrator
from .dmd import DMDCalibrator
from .foca import FoCaCalibrator
from .input_corrected import InputCorrectedCalibrator
from .reuse import ReuseCalibrator
from .taylorseer import TaylorSeerCalibrator

__all__ = [
    "Calibrator",
    "CorrectedTaylorCalibrator",
    "DMDCalibrator",
    "FoCaCalibrator",
    "InputCorrectedCalibrator",
    "ReuseCalibrator",
    "TaylorSeerCalibrator",
    "make_calibrator",
]


def make_calibrator(config) -> Calibrator:
    """A fresh calibrator for one residual stream of one branch, as `config` asks."""
    if config.enable_dmd:
        return DMDCalibrator(history=config.dmd_history, rank=config.dmd_rank, ridge=config.dmd_ridge)
    if config.enable_taylorseer and config.forecaster == "input_corrected":
        return InputCorrectedCalibrator(order=config.taylorseer_order, damping=config.taylorseer_damping)
    if config.enable_taylorseer and config.forecaster == "corrected":
        return CorrectedTaylorCalibrator(order=config.taylorseer_order, damping=config.taylorseer_damping)
    if config.enable_taylorseer and config.forecaster == "foca":
        return FoCaCalibrator(damping=config.taylorseer_damping)
    if config.enable_taylorseer:
        return TaylorSeerCalibrator(order=config.taylorseer_order, damping=config.taylorseer_damping)
    return ReuseCalibrator()
