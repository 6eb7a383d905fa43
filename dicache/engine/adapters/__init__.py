"""Adapters: where a model's block stack is, how its blocks are called, how a pipeline's calls map to steps."""

from .base import BlockForm, DualStream, ModelSpec, SingleStream
from .generic import find_block_list, generic_spec
from .pipelines import DiffusersPipelineAdapter, NativePipelineAdapter, find_pipeline_adapter

__all__ = [
    "BlockForm",
    "DiffusersPipelineAdapter",
    "DualStream",
    "ModelSpec",
    "NativePipelineAdapter",
    "SingleStream",
    "find_block_list",
    "find_pipeline_adapter",
    "generic_spec",
]
