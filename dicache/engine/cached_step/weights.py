"""The fitted predictor's file (`fitted_predictor`): one safetensors file per fit, written by `dicache calibrate`.

Tensors: `W` `(F, C')` float32 per cached (step, branch), named `"<step>/<branch>"`. Metadata (strings):
`format` (`PREDICTOR_FORMAT`), `num_steps`, `mask` (the step mask it was fitted for, 0/1 flags as JSON), `features`
(`fitted.FEATURES` as JSON), `ridge`, and `fitted_on` (JSON: the prompts and seeds of the fit). A file is read once
per (path, size, modification time).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError
from .fitted import FEATURES

PREDICTOR_FORMAT = "dicache-fitted-predictor-1"
SETTING = "fitted_predictor (SGLANG_CACHE_DIT_FITTED_PREDICTOR)"


@dataclass
class FittedWeights:
    """A fit: the weights of each cached (step, branch) of `mask` (`num_steps` flags, 1 = computed)."""

    num_steps: int
    mask: tuple[int, ...]
    weights: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    features: tuple[str, ...] = FEATURES
    ridge: float = 0.0
    fitted_on: list[Any] = field(default_factory=list)
    source: str = "<memory>"
    device_copies: dict[tuple[int, str, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)
    """`W` float32 on each device it was asked for: copied once, so a cached call on a GPU never waits for a copy."""

    def weight(self, step: int, branch: str, device: torch.device | str | None = None) -> torch.Tensor:
        """`W` of a cached call (float32, on `device` when given: copied there once per fit and device); a
        `ConfigError` naming the file when the fit has none for it."""
        found = self._stored(step, branch)
        if device is None or found.device == torch.device(device):
            return found
        key = (step, branch, torch.device(device))
        copy = self.device_copies.get(key)
        if copy is None:
            copy = self.device_copies[key] = found.to(device=device, dtype=torch.float32)
        return copy

    def _stored(self, step: int, branch: str) -> torch.Tensor:
        found = self.weights.get((step, branch))
        if found is None:
            have = ", ".join(f"{s}/{b}" for s, b in sorted(self.weights)) or "none"
            raise ConfigError(
                f"{SETTING}={self.source!r} has no weights for step {step}, branch {branch!r} (it holds {have}; "
                f"fitted for the mask {''.join(map(str, self.mask))} of {self.num_steps} steps): refit it with "
                "dicache calibrate for this schedule and mask"
            )
        return found

    def check_schedule(self, num_steps: int | None, mask: list[int] | None) -> None:
        """`ConfigError` unless the request's step count and mask are the ones this fit is for."""
        if num_steps != self.num_steps or mask is None or tuple(mask[: self.num_steps]) != self.mask:
            shown = "none" if mask is None else "".join(map(str, mask[: num_steps or len(mask)]))
            raise ConfigError(
                f"{SETTING}={self.source!r} was fitted for {self.num_steps} steps with the step mask "
                f"{''.join(map(str, self.mask))}; this request has {num_steps} steps and the mask {shown}: use "
                "the mask and step count it was fitted for, or refit with dicache calibrate"
            )

    def save(self, path: str | os.PathLike) -> Path:
        """Write the fit (tensors contiguous float32 on the CPU); returns the path."""
        from safetensors.torch import save_file  # a loading-time dependency: only files need it

        tensors = {
            f"{step}/{branch}": w.detach().float().cpu().contiguous() for (step, branch), w in self.weights.items()
        }
        metadata = {
            "format": PREDICTOR_FORMAT,
            "num_steps": str(self.num_steps),
            "mask": json.dumps(list(self.mask)),
            "features": json.dumps(list(self.features)),
            "ridge": repr(float(self.ridge)),
            "fitted_on": json.dumps(self.fitted_on),
        }
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(target), metadata=metadata)
        return target


def load_weights(path: str | os.PathLike) -> FittedWeights:
    """The fit stored at `path` (read once per path, size and modification time); `ConfigError` naming the setting
    and the path when it is missing or not a predictor file."""
    p = Path(path)
    try:
        stat = p.stat()
    except OSError:
        raise ConfigError(
            f"{SETTING}={str(path)!r}: no such file (expected the predictor file dicache calibrate writes)"
        ) from None
    return _load(str(p.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _load(path: str, size: int, mtime: int) -> FittedWeights:
    from safetensors import SafetensorError  # a loading-time dependency: only files need it
    from safetensors.torch import load_file

    try:
        from safetensors import safe_open  # the metadata is read apart from the tensors

        with safe_open(path, "pt") as handle:
            meta = handle.metadata() or {}
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{SETTING}={path!r}: not a readable safetensors file ({exc})") from None
    if meta.get("format") != PREDICTOR_FORMAT:
        raise ConfigError(
            f"{SETTING}={path!r}: not a dicache predictor file (format {meta.get('format')!r}, expected "
            f"{PREDICTOR_FORMAT!r})"
        )
    try:
        features = tuple(json.loads(meta["features"]))
        fit = FittedWeights(
            num_steps=int(meta["num_steps"]),
            mask=tuple(int(f) for f in json.loads(meta["mask"])),
            features=features,
            ridge=float(meta["ridge"]),
            fitted_on=json.loads(meta.get("fitted_on", "[]")),
            source=path,
        )
        for name, tensor in tensors.items():
            step, branch = name.split("/", 1)
            fit.weights[(int(step), branch)] = tensor
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"{SETTING}={path!r}: malformed predictor metadata ({exc})") from None
    if features != FEATURES:
        raise ConfigError(
            f"{SETTING}={path!r}: fitted on the features {list(features)}, this dicache predicts from "
            f"{list(FEATURES)}: refit it with dicache calibrate"
        )
    return fit
