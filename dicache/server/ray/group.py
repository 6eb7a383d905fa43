"""One Ray Serve replica holding a model split over `tp × ulysses` processes (`dicache.parallel`), in one placement
group.

Serve reserves a placement group per replica with one bundle per model rank (`placement_bundles`); the replica
actor itself runs in bundle 0 as rank 0 and answers HTTP. `load_group_backend` (called in the replica) starts one
`RankWorker` actor in each other bundle, and every process then joins one `torch.distributed` group over TCP on the
replica's node (NCCL on GPUs, gloo on CPU), loads the pipeline, splits it (`parallelize_pipeline`) and enters
`lockstep`: rank 0 gets the backend to serve with, the other ranks replay its generations until it is closed.

The rank workers are owned by the replica actor: when the replica dies (killed, node lost) they die with it, and
Serve starts a whole new group for the replacement. `GroupBackend.check()` raises when a rank worker ended, so the
replica's health check fails and Serve replaces it.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

from ...parallel import init_parallel, lockstep, parallelize_pipeline

INIT_TIMEOUT = datetime.timedelta(minutes=10)


def placement_bundles(world_size: int, cpus_per_replica: float, gpus_per_rank: float) -> list[dict[str, float]]:
    """Bundles of one replica's placement group: bundle 0 for the replica (rank 0), one per other rank."""
    bundles = []
    for rank in range(world_size):
        bundle = {"CPU": float(cpus_per_replica if rank == 0 else 1)}
        if gpus_per_rank:
            bundle["GPU"] = float(gpus_per_rank)
        bundles.append(bundle)
    return bundles


@dataclass(frozen=True)
class GroupPlan:
    """Where the processes of one replica's group meet."""

    tp_size: int
    ulysses_degree: int
    init_method: str
    gpus_per_rank: float

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ulysses_degree


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _join_and_load(spec: Any, plan: GroupPlan, rank: int) -> tuple[Any, Any]:
    """Every rank, in the same order: join the group, load and split the pipeline, enter lockstep.
    Returns (context, backend); the backend is None on ranks other than 0 once rank 0 closed."""
    os.environ["LOCAL_RANK"] = "0"  # Ray shows each process only its own GPU(s): index 0
    ctx = init_parallel(
        plan.tp_size,
        plan.ulysses_degree,
        device=spec.device,
        init_method=plan.init_method,
        rank=rank,
        world_size=plan.world_size,
        timeout=INIT_TIMEOUT,
    )
    backend = spec.load_backend(device=str(ctx.device))
    parallelize_pipeline(backend.pipe, ctx)
    spec.apply_speed(backend)  # every rank quantizes its own shards and warms up in step
    return ctx, lockstep(backend, ctx)


class RankWorker:
    """A model rank other than 0 (run as a Ray actor in its bundle): `run()` returns when rank 0 closes."""

    def __init__(self, spec: Any, plan: GroupPlan, rank: int) -> None:
        self.spec, self.plan, self.rank = spec, plan, rank

    def run(self) -> int:
        ctx, _ = _join_and_load(self.spec, self.plan, self.rank)
        ctx.shutdown()
        return self.rank


class GroupBackend:
    """Rank 0's backend (a `LockstepBackend`) plus the Ray handles of the other ranks. Attributes pass through."""

    def __init__(self, backend: Any, ctx: Any, workers: list, runs: list) -> None:
        self._backend, self._ctx, self._workers, self._runs = backend, ctx, workers, runs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def generate(self, spec: Any, should_stop: Any = None) -> Any:
        return self._backend.generate(spec, should_stop=should_stop)

    def check(self) -> None:
        """Raise if a rank worker has ended (the group can no longer generate)."""
        import ray  # the ray extra: `placement_bundles` is plain Python

        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        if done:
            raise RuntimeError(f"{len(done)} of this replica's {len(self._runs)} model rank worker(s) ended")

    def close(self) -> None:
        import ray  # the ray extra: `placement_bundles` is plain Python

        try:
            self._backend.close()  # releases the other ranks
            ray.get(self._runs, timeout=30)
        except Exception:  # a rank already gone: nothing left to release
            pass
        finally:
            self._ctx.shutdown()


def load_group_backend(spec: Any, tp_size: int, ulysses_degree: int, gpus_per_rank: float) -> GroupBackend:
    """In the replica (rank 0, inside its placement group): start the other ranks and load the split pipeline."""
    import ray  # the ray extra: `placement_bundles` is plain Python
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host = ray.util.get_node_ip_address()
    plan = GroupPlan(tp_size, ulysses_degree, f"tcp://{host}:{_free_port(host)}", gpus_per_rank)
    group = ray.util.get_current_placement_group()
    if group is None:
        raise RuntimeError("a tp × ulysses replica must run in a placement group (placement_group_bundles)")
    actor = ray.remote(RankWorker)
    workers = [
        actor.options(
            num_cpus=1,
            num_gpus=gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote(spec, plan, rank)
        for rank in range(1, plan.world_size)
    ]
    runs = [worker.run.remote() for worker in workers]
    ctx, backend = _join_and_load(spec, plan, 0)
    return GroupBackend(backend, ctx, workers, runs)
