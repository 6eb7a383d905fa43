"""Adapters: how a pipeline's calls reach the cache sessions of its transformers (`pipelines`), with the block-stack
description they rest on (`dicache.blocks`: forms, stacks, the families registry, the generic fallback), re-exported
here so that `dicache.engine.adapters` and `dicache.adapters` offer one set of names.
"""

from ... import blocks as _blocks
from ...blocks import *  # noqa: F403 - the description's own __all__, whatever it holds
from .pipelines import DiffusersPipelineAdapter, NativePipelineAdapter, find_pipeline_adapter

__all__ = [*_blocks.__all__, "DiffusersPipelineAdapter", "NativePipelineAdapter", "find_pipeline_adapter"]
