"""`ServerSettings`: the HTTP server's own limits (queue, workers, timeouts, input bounds).

Cache settings are not here: they come from `SGLANG_CACHE_DIT_*` over an optional settings profile
(`dicache.profiles.cache_config`: `--profile` or `SGLANG_CACHE_DIT_PROFILE`) at start-up and from each request's
`cache_dit_params`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    """Bounds every request is checked against; a value outside them is a 400 naming the field.

    Attributes:
        model_id: the name `GET /v1/models` lists; a request's `model`, when given, must equal it.
        max_queue: requests allowed to wait for a worker; one more is answered 429 (running ones do not count).
        workers: generations run at once. 1 (default) runs one at a time; each request's output does not depend
            on this number, because requests never share cache state or random generators.
        request_timeout_s: seconds from arrival to answer (waiting + generating); past it the answer is 504.
        max_n: most images per request.
        min_side, max_side, size_multiple: bounds of `size` "WxH" (each side a multiple of `size_multiple`).
        max_pixels: most pixels per image (width * height).
        max_steps: most denoising steps per request.
        max_prompt_chars: longest `prompt` / `negative_prompt`, in characters.
        max_body_bytes: largest request body; a larger one is answered 413 before it is parsed.
    """

    model_id: str = "krea-2"
    max_queue: int = 16
    workers: int = 1
    request_timeout_s: float = 600.0
    max_n: int = 4
    min_side: int = 16
    max_side: int = 2048
    size_multiple: int = 16
    max_pixels: int = 2048 * 2048
    max_steps: int = 200
    max_prompt_chars: int = 4000
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_queue", "workers", "max_n", "min_side", "size_multiple", "max_steps", "max_prompt_chars"):
            value = getattr(self, name)
            if value < (0 if name == "max_queue" else 1):
                raise ValueError(f"ServerSettings.{name}={value!r} is invalid: must be >= {int(name != 'max_queue')}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"ServerSettings.request_timeout_s={self.request_timeout_s!r} is invalid: must be > 0")
        if self.max_side < self.min_side:
            raise ValueError(f"ServerSettings.max_side={self.max_side} must be >= min_side={self.min_side}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"ServerSettings.max_body_bytes={self.max_body_bytes} is invalid: must be >= 1024")
