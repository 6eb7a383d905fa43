"""The torch device a command or server runs on: `--device` checked once, before anything is loaded."""

from __future__ import annotations

import torch

from ..errors import ConfigError


def default_device() -> torch.device:
    """CUDA when this torch build sees a GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(value: str | torch.device | None, name: str = "--device") -> torch.device:
    """`value` as a torch device (None: `default_device()`). A `ConfigError` naming `name`, the value and what this
    machine allows when it is not a device name, asks for CUDA where torch has none, or for a GPU index that is not
    there."""
    if value is None:
        return default_device()
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"{name}={str(value)!r} is invalid: not a torch device; allowed: {allowed_devices()}"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{name}={str(value)!r} is invalid: this torch ({torch.__version__}) sees no CUDA GPU; allowed here: "
                f"{allowed_devices()}"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{name}={str(value)!r} is invalid: there is no GPU {device.index}; allowed here: {allowed_devices()}"
            )
    return device


def allowed_devices() -> str:
    """The devices this machine has, as a user would write them."""
    if not torch.cuda.is_available():
        return "cpu"
    count = torch.cuda.device_count()
    return "cpu, cuda" + (f", cuda:0 … cuda:{count - 1}" if count > 1 else ", cuda:0")
