"""The cache's view of a split Krea-2 transformer: which elements of this process's residual streams to count.

DBCache's diff `mean|r − r_prev| / mean|r_prev|` must be one number on every process of the model-parallel group
(docs/architecture.md §5), equal to the single-process one. The hook layer sums what `counted` returns and all-reduces
the numerator and denominator over `group`, so each element of the whole joint sequence must be counted exactly once:

- tensor parallelism: the hidden states are replicated on the TP ranks; only TP rank 0 counts them (the others
  count nothing). Reducing over the whole model-parallel group (not only over Ulysses) makes the decision agree on
  every process by construction, even if replicas ever differed in the last bit.
- Ulysses: the text prefix `[0, T)` is replicated on the SP ranks; only SP rank 0 counts it, every SP rank counts
  its own image share.
"""

from __future__ import annotations

from typing import Any

import torch

from .sequence import SequenceShard


class TokenShareLayout:
    """`ReductionLayout` (`dicache.engine.reduction`) of a Krea-2 transformer split by `dicache.parallel.parallelize`.

    group: the model-parallel group; shard: the Ulysses split (None without sequence parallelism).
    """

    def __init__(self, group: Any, tp_rank: int, sp_rank: int, shard: SequenceShard | None) -> None:
        self.group, self.tp_rank, self.sp_rank, self.shard = group, tp_rank, sp_rank, shard

    def counted(self, stream: torch.Tensor) -> torch.Tensor:
        """`stream` `(B, T + n, …)`: all of it, its image share only, or nothing (an empty slice)."""
        if self.tp_rank != 0:
            return stream[:, :0]
        if self.shard is not None and self.sp_rank != 0:
            return stream[:, self.shard.num_text_tokens :]
        return stream
