"""The calibration's errors."""

from __future__ import annotations

from ..errors import ConfigError, DicacheError


class CalibrationError(ConfigError):
    """A bad calibration input (candidate file, prompts, size, target); the message names it."""


class TargetNotMet(DicacheError):
    """No candidate reached the fidelity target; nothing was written."""
