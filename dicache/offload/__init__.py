"""Memory for small GPUs: a byte-budget plan made once at load time, layerwise streaming of the transformer's blocks
driven by the cache's block plan (docs/architecture.md §9), and whole-component offload.

Modules: `plan` (pure: settings, the memory plan, the resident layout), `estimate` (pure: working-memory bounds),
`schedule` (pure: which copies to issue when), `timeline` (pure: a timing model of a copy/compute trace), `packing`
(a module's weights in one flat buffer), `layerwise` (the streaming offloader, a block observer of the hook layer),
`components` (whole components around their phase), `pipeline` (measure, plan and install on Krea-2's pipeline),
`cli` (the command-line options).

    pipe = Krea2Pipeline.from_pretrained(DIR, device="cuda", dit_layerwise_offload=True, text_encoder_cpu_offload=True)
    print(pipe.offload.plan.describe())
"""

from .plan import MemoryNeeds, MemoryPlan, OffloadSettings, plan_memory, prefetch_blocks, resident_layout

__all__ = ["MemoryNeeds", "MemoryPlan", "OffloadSettings", "plan_memory", "prefetch_blocks", "resident_layout"]
