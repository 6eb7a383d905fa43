"""The block stack of a transformer, described (pure data: no module is changed, nothing here caches or offloads).

- `forms`: how a block is called and what it returns (`BlockForm`, the declared `FORMS`, `misfit`);
- `stack`: a transformer's block lists as one stack (`StackSpec`, `BlockList`);
- `generic`: the fallback for models no family describes (one block list; `form=` values);
- `families`: the registry of diffusers DiT families (`FAMILIES`; `stack_spec` / `stack_specs` for any model);
- `family_docs`: the families table of the documentation, rendered from the registry.

The engine (`dicache.engine`), the offloader (`dicache.offload`) and the models (`dicache.models`) all read a stack
through this package, which imports none of them (docs/architecture.md §1). `dicache.adapters` re-exports it.
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
    "DualStream",
    "Family",
    "SingleStream",
    "StackSpec",
    "find_block_list",
    "find_family",
    "form_named",
    "generic_spec",
    "stack_spec",
    "stack_specs",
]
