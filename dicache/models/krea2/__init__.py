"""Native Krea-2: transformer, checkpoint loading, text encoder glue, VAE decoder, scheduler and pipeline.

Names are imported lazily so that importing one component does not pull in the others.
"""

from __future__ import annotations

from dicache._lazy import lazy_getattr

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

__getattr__ = lazy_getattr(__name__, _EXPORTS)
