"""Memory for small GPUs: a byte-budget plan made once at load time, layerwise streaming of the transformer's blocks
driven by the cache's block plan (docs/architecture.md §9), and whole-component offload.

Modules: `settings` (the offload options, declared once: `OffloadSettings`; the largest planned request:
`OffloadLimits`), `plan` (pure: the memory plan, the resident layout), `estimate` (pure: working-memory bounds),
`schedule` (pure: which copies to issue when), `timeline` (pure: a timing model of a copy/compute trace), `packing`
(a module's weights in one flat buffer), `layerwise` (the streaming offloader, a block observer of the hook layer),
`components` (whole components around their phase), `pipeline` (plan and install on a pipeline from what its model
says about it: `PipelineMemory`). Nothing here knows a model: each model's memory glue (its components, their
phases, the bytes a request needs, CFG batching) lives with the model (`dicache.models.krea2.memory`).

    pipe = Krea2Pipeline.from_pretrained(DIR, device="cuda", dit_layerwise_offload=True, text_encoder_cpu_offload=True)
    print(pipe.offload.plan.describe())
"""

from .plan import MemoryNeeds, MemoryPlan, plan_memory, resident_layout
from .settings import OffloadLimits, OffloadSettings, prefetch_blocks

__all__ = [
    "MemoryNeeds",
    "MemoryPlan",
    "OffloadLimits",
    "OffloadSettings",
    "plan_memory",
    "prefetch_blocks",
    "resident_layout",
]
