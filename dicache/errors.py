"""User-facing error types. Every message names the field, the value given and what is allowed."""

from __future__ import annotations


class DicacheError(Exception):
    """Base class of the errors dicache raises on bad input (the command line exits with `exit_status`)."""

    exit_status = 2


class ConfigError(DicacheError, ValueError):
    """An invalid cache setting: an environment variable, a per-request override key or a value."""


class BlockSplitError(ConfigError):
    """`Fn + Bn` leaves no middle block for the model the config is applied to."""


class NotEnabledError(DicacheError, RuntimeError):
    """A per-model call (`dicache.stats`, `request`, `step`, `session_of`) on an object `dicache.enable` was not
    called on (or that was disabled since)."""


class UnsupportedModelError(DicacheError, TypeError):
    """`dicache.enable` was given an object it cannot find a block stack in."""


class MemoryBudgetError(ConfigError):
    """A memory plan that cannot fit the device budget: says what was needed and what was available."""


class BlockFormError(DicacheError, ValueError):
    """A block form that does not fit the model: a bad `form=` value, or a form the first transformer call shows to
    be wrong (names the block, the form expected, what the block returned and the `form=` to pass)."""


class StartupError(DicacheError, RuntimeError):
    """A server that could not start although its options were valid (e.g. a timeout on a busy machine): the
    message says what failed and which option to change; the command line exits 1."""

    exit_status = 1


class NonFiniteOutputError(RuntimeError):
    """Images whose latents or decoded pixels hold NaN or inf (a numerical failure of the model, not bad input): they
    are never encoded or written. `images` maps each such image's index (in the call's batch) to where its values
    went non-finite ("latents" after denoising, or the "decoded image"); `total` is the batch size."""

    def __init__(self, images: dict[int, str], total: int) -> None:
        self.images, self.total = dict(images), total
        where = "; ".join(f"image {i + 1} of {total}: {place}" for i, place in sorted(self.images.items()))
        super().__init__(f"non-finite values (NaN or inf) in the output, so it is not returned ({where})")
