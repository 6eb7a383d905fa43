"""What one replica reserves on a Ray cluster, and whether the initial replicas fit: pure functions of a `ReplicaSpec`
and its `RayServeOptions` (no Ray needed). Every error is a `ConfigError` naming the option to change."""

from __future__ import annotations

from ...errors import ConfigError
from .options import RayServeOptions
from .spec import ReplicaSpec


def gpus_per_rank(spec: ReplicaSpec, options: RayServeOptions) -> float:
    """GPUs each model rank reserves; checks that the GPU count fits the replica's tp × ulysses group."""
    world = spec.world_size
    gpus = options.gpus_per_replica
    if world > 1 and gpus not in (0, world):
        raise ConfigError(
            f"--gpus-per-replica={gpus:g} is invalid with --tp-size {spec.tp_size} × --ulysses-degree "
            f"{spec.ulysses_degree}: each of the {world} ranks takes one whole GPU, so it must be {world} "
            "(or 0 to run the group on CPUs)"
        )
    if gpus and spec.device is not None and not spec.device.startswith("cuda"):
        raise ConfigError(f"--gpus-per-replica={gpus:g} needs a CUDA device, but --device={spec.device!r}")
    return gpus / world if world > 1 else gpus


def replica_resources(spec: ReplicaSpec, options: RayServeOptions) -> dict[str, float]:
    """CPUs and GPUs one replica reserves, all its ranks included (rank 0 `cpus_per_replica`, the others 1 CPU)."""
    return {
        "CPU": options.cpus_per_replica + (spec.world_size - 1),
        "GPU": gpus_per_rank(spec, options) * spec.world_size,
    }


def check_fits(spec: ReplicaSpec, options: RayServeOptions, cluster: dict[str, float], where: str) -> None:
    """Raise ConfigError naming the option when the initial replicas do not fit in `cluster` (its total resources).

    For a cluster that cannot grow (the local one `dicache serve --ray` starts): Serve would otherwise wait forever
    for resources that never come.
    """
    need = replica_resources(spec, options)
    flags = {"CPU": "--cpus-per-replica", "GPU": "--gpus-per-replica"}
    for kind in ("GPU", "CPU"):
        have = float(cluster.get(kind, 0.0))
        total = need[kind] * options.replicas
        if total <= have + 1e-6:  # fractions: 10 × 0.1 GPU fit on one GPU
            continue
        per = f"{need[kind]:g} {kind}(s) per replica ({flags[kind]}"
        per += f", --tp-size × --ulysses-degree = {spec.world_size})" if spec.world_size > 1 else ")"
        raise ConfigError(
            f"--replicas={options.replicas} × {per} = {total:g} {kind}(s), but {where} has {have:g}: "
            f"lower --replicas or {flags[kind]}" + (", or serve on CPUs with --device cpu" if kind == "GPU" else "")
        )
