"""Native Krea-2: transformer, checkpoint loading, text encoder glue, VAE decoder, scheduler and pipeline.

Names are imported lazily so that importing one component does not pull in the others.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Krea2Transformer": ".transformer",
    "Krea2TransformerBlock": ".transformer",
    "TextConditioning": ".transformer",
    "QwenImageVAEDecoder": ".vae",
    "FlowMatchEulerScheduler": ".scheduler",
    "Krea2TextEncoder": ".text",
    "Krea2Pipeline": ".pipeline",
    "Krea2PipelineOutput": ".pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
