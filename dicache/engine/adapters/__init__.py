"""Adapters, in two halves.

Description (pure data, no module is changed): `forms` (how a block is called and what it returns), `stack` (a
transformer's block lists as one stack), `families` (the registry of diffusers DiT families), `generic` (the fallback
for unknown models). Attachment: `pipelines` (connects a pipeline's calls to the cache sessions of its transformers).
"""

from .families import FAMILIES, LIST_LAYOUTS, Family, find_family, stack_spec, stack_specs
from .forms import (
    FORMS,
    H_TO_EH,
    H_TO_H,
    H_TO_HE,
    HE_TO_EH,
    HE_TO_H,
    HE_TO_HE,
    BlockForm,
    DualStream,
    SingleStream,
    form_named,
)
from .generic import find_block_list, generic_spec
from .pipelines import DiffusersPipelineAdapter, NativePipelineAdapter, find_pipeline_adapter
from .stack import BlockList, StackSpec

__all__ = [
    "FAMILIES",
    "FORMS",
    "LIST_LAYOUTS",
    "HE_TO_EH",
    "HE_TO_H",
    "HE_TO_HE",
    "H_TO_EH",
    "H_TO_H",
    "H_TO_HE",
    "BlockForm",
    "BlockList",
    "DiffusersPipelineAdapter",
    "DualStream",
    "Family",
    "NativePipelineAdapter",
    "SingleStream",
    "StackSpec",
    "find_block_list",
    "find_family",
    "find_pipeline_adapter",
    "form_named",
    "generic_spec",
    "stack_spec",
    "stack_specs",
]
