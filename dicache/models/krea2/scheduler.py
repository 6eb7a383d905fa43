"""Flow-match Euler sampling schedule with Krea-2's resolution-aware time shift.

Convention (rectified flow): `x_sigma = (1 - sigma) * x_0 + sigma * noise`, the model predicts the velocity
`v = noise - x_0`, and one Euler step is `x_next = x + (sigma_next - sigma) * v`. Sampling runs sigma from 1 to 0.

Schedule for N steps: base sigmas `linspace(1, 1/N, N)`, shifted by `exp(mu) / (exp(mu) + 1/s - 1)`, then a terminal
0 appended (N + 1 values). `mu` grows linearly with the image token count, from `base_shift` at `base_image_seq_len`
tokens to `max_shift` at `max_image_seq_len` (Krea-2: 0.5 at 256 -> 1.15 at 6400, extrapolated beyond); the
distilled Turbo checkpoint pins `mu = 1.15`. The transformer receives `timestep = sigma` (diffusers passes
`t / num_train_timesteps` with `t = sigma * num_train_timesteps`; `model_timesteps` reproduces that rounding).

The scheduler holds only its config: every method is a pure function of its arguments, so one instance can serve
concurrent requests with different step counts and resolutions.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import torch

from dicache.models.loading import CheckpointError, read_json, resolve_component_dir

TURBO_MU = 1.15  # Krea-2 Turbo (the few-step distilled checkpoint) ignores the resolution and uses this shift

# diffusers `FlowMatchEulerDiscreteScheduler` options this scheduler does not implement, with their inactive value.
_UNSUPPORTED_OPTIONS = {
    "invert_sigmas": False,
    "shift_terminal": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "stochastic_sampling": False,
}


@dataclasses.dataclass(frozen=True)
class FlowMatchEulerScheduler:
    """Krea-2's sampling schedule and Euler step. Defaults are Krea-2's `scheduler_config.json` values."""

    num_train_timesteps: int = 1000
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 6400

    # ---- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict) -> FlowMatchEulerScheduler:
        """Build from a diffusers `FlowMatchEulerDiscreteScheduler` config dict.

        The config must describe the Krea-2 setup: `use_dynamic_shifting=True` with the exponential time shift and
        none of the alternative sigma schedules; anything else raises `ValueError` naming the key. `shift` is unused
        under dynamic shifting; metadata keys (`_class_name`, ...) and unknown keys are ignored, as diffusers does.
        Missing shift keys take Krea-2's values (note: diffusers' own default for `max_image_seq_len` is 4096).
        """
        if not config.get("use_dynamic_shifting", False):
            raise ValueError(
                "use_dynamic_shifting must be true (Krea-2's resolution-aware shift); got "
                f"{config.get('use_dynamic_shifting', False)!r}"
            )
        if config.get("time_shift_type", "exponential") != "exponential":
            raise ValueError(f"time_shift_type={config['time_shift_type']!r} is not supported; allowed: 'exponential'")
        for key, inactive in _UNSUPPORTED_OPTIONS.items():
            if config.get(key, inactive) not in (inactive, None, False):
                raise ValueError(
                    f"{key}={config[key]!r} is not supported by FlowMatchEulerScheduler; allowed: {inactive}"
                )
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in fields and v is not None})

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | os.PathLike, subfolder: str | None = "scheduler", **hub_kwargs
    ) -> FlowMatchEulerScheduler:
        """Read `scheduler_config.json` from a diffusers pipeline folder (local or Hub; `hub_kwargs`: `cache_dir`,
        `revision`, `local_files_only`)."""
        directory = resolve_component_dir(path_or_repo_id, subfolder, **hub_kwargs)
        try:
            return cls.from_config(read_json(directory, "scheduler_config.json"))
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"invalid scheduler_config.json in {directory}: {err}") from err

    # ---- schedule ----------------------------------------------------------------------------------------------

    def mu_for(self, image_seq_len: int) -> float:
        """Time-shift parameter for `image_seq_len` image tokens: linear through (base_len, base_shift) and
        (max_len, max_shift), same float arithmetic as diffusers' `calculate_shift`."""
        slope = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        intercept = self.base_shift - slope * self.base_image_seq_len
        return image_seq_len * slope + intercept

    def sigmas_for(self, num_steps: int, image_seq_len: int | None = None, mu: float | None = None) -> torch.Tensor:
        """Noise levels of an `num_steps`-step run: float32 CPU tensor of `num_steps + 1` values, 1-ish down to 0.

        `mu` overrides the resolution rule (pass `TURBO_MU` for Turbo); otherwise `image_seq_len` is required.
        Arithmetic follows diffusers (float64 grid rounded to float32, shift in float32), so values match bitwise.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1; got {num_steps}")
        if mu is None:
            if image_seq_len is None:
                raise ValueError("pass image_seq_len (image token count) or mu")
            mu = self.mu_for(image_seq_len)
        base = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32)
        exp_mu = np.float32(math.exp(mu))
        shifted = exp_mu / (exp_mu + (np.float32(1.0) / base - np.float32(1.0)))
        sigmas = torch.from_numpy(shifted.astype(np.float32))
        return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Scheduler timesteps `sigma * num_train_timesteps` (float32) of every step, i.e. without the terminal 0."""
        return sigmas[:-1].to(torch.float32) * self.num_train_timesteps

    def model_timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """What the transformer receives per step: `timesteps / num_train_timesteps` (float32; equals sigma up to
        the rounding diffusers' pipeline also has)."""
        return self.timesteps(sigmas) / self.num_train_timesteps

    # ---- integration -------------------------------------------------------------------------------------------

    @staticmethod
    def step(velocity: torch.Tensor, sample: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
        """One Euler step `sample + (sigma_next - sigma) * velocity`, returned in `sample`'s dtype.

        Arithmetic is diffusers' `step`: the sample is upcast to float32, `dt` is a float32 scalar tensor, so the
        product `dt * velocity` takes the velocity's dtype and the sum is float32. diffusers casts the result to the
        velocity's dtype instead of the sample's; the two agree whenever both dtypes are equal.
        """
        # a fill on the device: `torch.tensor(x, device=cuda)` would be a blocking copy that waits for the stream,
        # leaving the GPU idle at every step's start while the host catches up
        dt = torch.full((), float(sigma_next) - float(sigma), dtype=torch.float32, device=sample.device)
        return (sample.to(torch.float32) + dt * velocity).to(sample.dtype)
