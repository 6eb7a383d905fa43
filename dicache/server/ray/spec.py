"""`ReplicaSpec`: what every Ray Serve replica loads and serves, built once where the application is built (from the
command line, `dicache.commands.serve_ray`, or from the builder's declared options, `builder.replica_from_options`)
and sent to the replicas by pickling."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ...models import artifact_bytecode
from ...models.store_layout import artifact_store, weight_snapshot_store
from ...settings.cache_config import CacheConfig
from ..settings import ServerSettings

log = logging.getLogger("dicache.server.ray")


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads and serves.

    `cache_config` None: each replica reads `SGLANG_CACHE_DIT_*` over `profile` from its own environment.
    `device` None: cuda when the replica has GPUs, else cpu.
    """

    settings: ServerSettings = field(default_factory=ServerSettings)
    model: str | None = None
    variant: str | None = None
    dtype: str | None = None
    device: str | None = None
    default_size: tuple[int, int] | None = None
    cache_config: CacheConfig | None = None
    profile: str | None = None
    torch_threads: int | None = None
    tp_size: int = 1
    ulysses_degree: int = 1
    metrics_period_s: float = 2.0
    load_format: str = "auto"
    quantization: Any = None  # a validated `QuantizationSpec` (`--quantization fp8`) or None
    compile: bool = False
    compile_artifact: str | None = None  # `--compile-artifact`; None: DICACHE_COMPILE_ARTIFACT of the replica's process
    text_encoder_quantization: str | None = None  # `--text-encoder-quantization` (`quantize_text_encoder`'s methods)
    artifact_weights: bool = True  # `--artifact-weights`: the quantised weights kept in the artifact store
    prepare_text_lengths: str = "background"  # `--prepare-text-lengths` (`settings.TEXT_LENGTH_MODES`; CUDA only)
    drain_board: str | None = None  # the driver's `drain.DrainBoard` actor; None: no driver to follow

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ulysses_degree

    def load_backend(self, device: str | None = None) -> Any:
        """The replica's backend, loaded on `device`; a replica in one process quantises each block as it is read
        (a split one after the split: `apply_speed`)."""
        # as `dicache serve`'s entry: with --compile, the artifact store's bytecode and known distributions for the
        # imports to come (the model's and the text encoder's)
        artifact_bytecode.prepare_imports(artifact_store(self.compile_artifact) if self.compile else None)
        from ..backend import load_backend  # the serve extra (fastapi), which parsing the command line does not need

        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)
        return load_backend(
            self.model,
            self.variant,
            dtype=self.dtype,
            device=device or self.device,
            cache_config=self.cache_config,
            profile=None if self.cache_config is not None else self.profile,
            default_size=self.default_size,
            load_format=self.load_format,
            quantization=self.quantization if self.world_size == 1 else None,
            text_encoder_quantization=self.text_encoder_quantization if self.world_size == 1 else None,
            weight_store=self.weight_store(),
        )

    def weight_store(self) -> Any:
        """Where a replica in one process keeps and finds its quantised transformer and text encoder: the artifact
        store, with compile, a quantization and `artifact_weights` (`weight_snapshot`); else None."""
        return weight_snapshot_store(
            self.compile_artifact,
            compile=self.compile,
            artifact_weights=self.artifact_weights,
            quantized=self.quantization is not None or self.text_encoder_quantization is not None,
            at_load=self.world_size == 1,
        )

    def apply_speed(self, backend: Any) -> Any:
        """`--quantization` (unless loading did it) then `--compile` on a loaded (and, for a group, split) backend,
        then the start-up steps of `dicache serve` (`backend.ready_to_serve`: with `--compile` the warm-up from the
        compile artifact (`--compile-artifact`, else the replica's DICACHE_COMPILE_ARTIFACT), with
        `--prepare-text-lengths` (on CUDA) every prompt length met, memory released, start-up objects frozen), before
        the replica reports healthy. Returns the backend."""
        # the serve extra (fastapi), which parsing the command line does not need
        from ..backend import ready_to_serve
        from ..startup import StartupTimeline

        timeline = StartupTimeline()
        for name, seconds in getattr(backend.pipe, "load_timings", {}).items():
            timeline.add(name, seconds)
        if self.quantization is not None and _quantized(backend.pipe) is None:
            backend.pipe.quantize(self.quantization)
        method = self.text_encoder_quantization
        if method is not None and getattr(backend.pipe, "text_encoder_quantization", None) is None:
            backend.pipe.quantize_text_encoder(method)  # a split replica's: after the split, as `dicache serve`
        if self.compile:
            backend.pipe.compile()
        ready_to_serve(
            backend,
            warm_up=self.compile,
            prepare_text_lengths=self.prepare_text_lengths,
            report=lambda line: log.info("replica %s", line),
            compile_artifact=artifact_store(self.compile_artifact) if self.compile else None,
            timeline=timeline,
        )
        return backend


def _quantized(pipe: Any) -> Any:
    """The quantization loading applied to `pipe`'s transformer, or None."""
    return getattr(getattr(pipe, "transformer", None), "quantization", None)
