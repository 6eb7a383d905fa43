"""`ParallelContext`: which process this is in a model-parallel group of `tp_size × ulysses_degree` processes.

Rank grid: `rank = sp_rank · tp_size + tp_rank`. Tensor-parallel groups are runs of consecutive ranks (they talk
most: two all-reduces per block), sequence-parallel (Ulysses) groups are strided: `{tp_rank, tp_rank + tp_size, …}`.
The model-parallel group is the whole world: `num_gpus = tp_size × ulysses_degree`, checked with a clear error.
One process per GPU (`torchrun --nproc_per_node N`); CUDA uses NCCL, CPU uses gloo.
"""

from __future__ import annotations

import datetime
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError


class ParallelConfigError(ConfigError):
    """Degrees that do not fit the launch or the model (names the option, the value and what is allowed)."""


def check_degrees(world_size: int, tp_size: int, ulysses_degree: int) -> None:
    """Raise `ParallelConfigError` unless both degrees are integers >= 1 and `tp_size × ulysses_degree` is the world."""
    for option, value in (("--tp-size", tp_size), ("--ulysses-degree", ulysses_degree)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ParallelConfigError(f"{option}={value!r} is invalid: must be an integer >= 1")
    wanted = tp_size * ulysses_degree
    if wanted != world_size:
        raise ParallelConfigError(
            f"--tp-size {tp_size} × --ulysses-degree {ulysses_degree} = {wanted} GPU(s), but {world_size} process(es) "
            f"were launched: the number of GPUs must equal tp × ulysses; launch with "
            f"`torchrun --nproc_per_node {wanted} …` (or change the degrees)"
        )


def rank_grid(tp_size: int, ulysses_degree: int) -> tuple[list[list[int]], list[list[int]]]:
    """`(tp_groups, sp_groups)`: the ranks of every tensor-parallel and every sequence-parallel group."""
    tp_groups = [[s * tp_size + t for t in range(tp_size)] for s in range(ulysses_degree)]
    sp_groups = [[s * tp_size + t for s in range(ulysses_degree)] for t in range(tp_size)]
    return tp_groups, sp_groups


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the model-parallel group. `ParallelContext()` is a single process (no parallelism).

    group: every process of the model-parallel group (they hold one model together and must take the same cache
        decisions); None for a single process. tp_group / sp_group: this process's tensor- and sequence-parallel
        groups, None when that degree is 1. device: where this process's share of the model lives.
    """

    tp_size: int = 1
    sp_size: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None
    tp_group: Any = None
    sp_group: Any = None
    owns_process_group: bool = False

    @property
    def world_size(self) -> int:
        return self.tp_size * self.sp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def sp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def enabled(self) -> bool:
        """More than one process holds the model."""
        return self.world_size > 1

    @property
    def is_output_rank(self) -> bool:
        """The one process that writes files, prints results and serves HTTP (rank 0)."""
        return self.rank == 0

    def describe(self) -> str:
        if not self.enabled:
            return f"single process on {self.device}"
        return (
            f"rank {self.rank}/{self.world_size} on {self.device}: tp {self.tp_rank}/{self.tp_size}, "
            f"ulysses {self.sp_rank}/{self.sp_size}"
        )

    # ------------------------------------------------------------------ agreement between processes
    def broadcast_object(self, obj: Any = None, group: Any = None) -> Any:
        """Rank 0's `obj` on every process (picklable objects; every process must call it)."""
        if not self.enabled:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group if group is not None else self.group)
        return box[0]

    def agree_seed(self, seed: int | None) -> int:
        """The same seed on every process: `seed`, or one drawn on rank 0 when None (so random latents agree)."""
        if seed is None:
            seed = secrets.randbits(63) if self.rank == 0 else None
            return int(self.broadcast_object(seed))
        return int(seed)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)

    def shutdown(self) -> None:
        """Destroy the process group if `init_parallel` created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def build_context(
    tp_size: int, ulysses_degree: int, device: torch.device | str | None = None, *, owns_process_group: bool = False
) -> ParallelContext:
    """A context over the already initialised default process group (every process must call it, in the same order:
    it creates the sub-groups). Raises `ParallelConfigError` if the degrees do not multiply to the world size."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_degrees(world, tp_size, ulysses_degree)
    tp_groups, sp_groups = rank_grid(tp_size, ulysses_degree)
    tp_group = sp_group = None
    # new_group is collective: every process creates every group, and keeps its own.
    if tp_size > 1:
        for ranks in tp_groups:
            made = dist.new_group(ranks) if len(tp_groups) > 1 else dist.group.WORLD
            if rank in ranks:
                tp_group = made
    if ulysses_degree > 1:
        for ranks in sp_groups:
            made = dist.new_group(ranks) if len(sp_groups) > 1 else dist.group.WORLD
            if rank in ranks:
                sp_group = made
    device = torch.device(device) if device is not None else torch.device("cpu")
    return ParallelContext(
        tp_size=tp_size,
        sp_size=ulysses_degree,
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        device=device,
        group=dist.group.WORLD if world > 1 else None,
        tp_group=tp_group,
        sp_group=sp_group,
        owns_process_group=owns_process_group,
    )


def _process_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """This process's device: `device`'s type (default cuda when available) with index LOCAL_RANK on CUDA."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind != "cuda":
        return torch.device(kind)
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ParallelConfigError(
            f"process with LOCAL_RANK={local_rank} needs GPU {local_rank}, but only {count} GPU(s) are visible: "
            f"launch at most {count} process(es) per node"
        )
    return torch.device("cuda", local_rank)


def init_parallel(
    tp_size: int = 1,
    ulysses_degree: int = 1,
    *,
    device: str | torch.device | None = None,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: datetime.timedelta | None = None,
) -> ParallelContext:
    """Join (or start) the process group and build this process's `ParallelContext`.

    Under `torchrun`, rank and world size come from the environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`); tests pass
    `rank`, `world_size` and an `init_method` (e.g. `file://…`). A single process with both degrees 1 gets a plain
    `ParallelContext` on `device` (default cuda if available, else cpu) without touching `torch.distributed`. With
    several processes, CUDA means GPU `LOCAL_RANK` (made current) and NCCL; CPU means gloo.
    """
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    world = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else env_world)
    check_degrees(world, tp_size, ulysses_degree)
    if world == 1:  # keep the device as given (e.g. cuda:1)
        default = "cuda" if torch.cuda.is_available() else "cpu"
        return ParallelContext(device=torch.device(device if device is not None else default))
    local_rank = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
    resolved = _process_device(device, local_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    owns = False
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend or ("nccl" if resolved.type == "cuda" else "gloo")}
        if init_method is not None:
            kwargs["init_method"] = init_method
        if rank is not None:
            kwargs.update(rank=rank, world_size=world)
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(**kwargs)
        owns = True
    return build_context(tp_size, ulysses_degree, resolved, owns_process_group=owns)
