"""Multi-process workers for tests/test_parallel*.py: gloo on CPU, one intra-op thread per process.

Processes are forked from the test process (torch and dicache already imported: a fresh interpreter per rank costs
many seconds on a busy 2-core machine), each with one intra-op thread, which also makes forking safe. Every worker
writes what it saw to `out_dir/<scenario>_rank<r>.pt`; the test process compares the files.

Model: the embedded checkpoint (`dicache/assets/krea2-tiny`) when it exists, else a random native Krea-2 transformer
of the same shape (8 query / 4 key-value heads, text 4 heads: every split up to TP 2 × Ulysses 2 fits).
"""

from __future__ import annotations

import datetime
import os
import pathlib
import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import dicache
from dicache.engine.reduction import PARALLEL_LAYOUT_ATTR, relative_change
from dicache.models.krea2.pipeline import EMBEDDED_CHECKPOINT, Krea2Pipeline
from dicache.models.krea2.scheduler import FlowMatchEulerScheduler
from dicache.models.krea2.tiny import parallel_transformer_config, random_tiny_transformer
from dicache.models.krea2.transformer import Krea2Transformer
from dicache.parallel import build_context, init_parallel, lockstep, parallelize

HEIGHT = WIDTH = 128  # no VAE: latent ×8, patch 2 -> 8 × 8 = 64 image tokens
TEXT_LEN = 24
ALWAYS_CACHE_AFTER_WARMUP = dict(max_warmup_steps=2, residual_diff_threshold=1e9, max_continuous_cached_steps=-1)


# ---------------------------------------------------------------------------------------------------------------------
# model and inputs (built once in the test process, inherited by the forked workers)


@dataclass(frozen=True)
class TinyModel:
    config: dict
    state: dict
    scheduler: FlowMatchEulerScheduler
    source: str


def load_model() -> TinyModel:
    """The embedded checkpoint's transformer and scheduler, else random weights of the same shape."""
    if (EMBEDDED_CHECKPOINT / "transformer" / "config.json").is_file():
        model = Krea2Transformer.from_pretrained(EMBEDDED_CHECKPOINT, dtype=torch.float32, device="cpu")
        scheduler = FlowMatchEulerScheduler.from_pretrained(EMBEDDED_CHECKPOINT, subfolder="scheduler")
        return TinyModel(dict(model.config), model.state_dict(), scheduler, "embedded")
    model = random_tiny_transformer(parallel_transformer_config(), seed=0, std=0.3)
    return TinyModel(dict(model.config), model.state_dict(), FlowMatchEulerScheduler(), "random")


def make_pipeline(tiny: TinyModel) -> Krea2Pipeline:
    """A Turbo-style pipeline (no VAE, no text encoder) around a fresh copy of the weights, in float32."""
    model = Krea2Transformer(**tiny.config)
    model.load_state_dict(tiny.state)
    pipe = Krea2Pipeline(model.eval(), tiny.scheduler, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def text_inputs(config: dict, valid: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tapped text states `(1, TEXT_LEN, layers, dim)` with `valid` real tokens (padding mid-template)."""
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, TEXT_LEN, config["num_text_layers"], config["text_hidden_dim"], generator=gen)
    mask = torch.zeros(1, TEXT_LEN, dtype=torch.bool)
    mask[0, : valid - 3] = True
    mask[0, -3:] = True
    return embeds, mask


def generate(pipe: Krea2Pipeline, config: dict, cache: dict, cfg: str | None = None) -> torch.Tensor:
    """Latents of one cache-enabled generation: Turbo (8 steps, no CFG), or 6 steps with CFG 4.5 (`cfg` = 'split':
    cond and uncond calls with text of different lengths; 'batched': one batch-2 call with a key mask)."""
    embeds, mask = text_inputs(config, 12, seed=1)
    kwargs: dict[str, Any] = dict(variant="turbo")
    if cfg is not None:
        neg, neg_mask = text_inputs(config, 7, seed=2)
        kwargs = dict(
            variant="raw",
            num_inference_steps=6,
            guidance_scale=4.5,
            negative_prompt_embeds=neg,
            negative_prompt_embeds_mask=neg_mask,
            cfg_batched=cfg == "batched",
        )
    with dicache.request(pipe, config=cache):
        out = pipe(
            prompt_embeds=embeds,
            prompt_embeds_mask=mask,
            height=HEIGHT,
            width=WIDTH,
            seed=7,
            output_type="latent",
            **kwargs,
        )
    return out.latents


def decisions(pipe: Krea2Pipeline) -> dict[str, list[tuple[int, bool, str, float | None]]]:
    """Per branch, every call's (step, cached, reason, diff) of the last request."""
    stats = dicache.stats(pipe)
    table = {}
    for name, branch in stats.branches.items():
        steps = sorted(branch.computed_steps + branch.cached_steps)
        table[name] = [(s, s in branch.cached_steps, branch.reasons[s], branch.diffs.get(s)) for s in steps]
    return table


def dynamic_cache_settings(pipe: Krea2Pipeline, config: dict, cfg: str | None) -> dict:
    """DBCache settings whose threshold splits this model's diffs, so the reduced diff really decides steps.

    A probe run caches every step after warm-up (measuring the drift since step 1); the threshold is put in the
    widest gap among the middle diffs, far from any of them, so rounding of the summation order cannot flip it.
    """
    generate(pipe, config, ALWAYS_CACHE_AFTER_WARMUP, cfg)
    diffs = sorted(d for calls in decisions(pipe).values() for _, _, _, d in calls if d is not None)
    gaps = list(zip(diffs, diffs[1:]))[len(diffs) // 4 : max(len(diffs) // 4 + 1, 3 * len(diffs) // 4)]
    lo, hi = max(gaps, key=lambda pair: pair[1] - pair[0])
    return dict(max_warmup_steps=2, residual_diff_threshold=statistics.fmean([lo, hi]), max_continuous_cached_steps=-1)


# ---------------------------------------------------------------------------------------------------------------------
# process plumbing


def start(fn: Callable, nprocs: int, out_dir: pathlib.Path, *args: Any) -> None:
    """Run `fn(rank, nprocs, out_dir, *args)` in `nprocs` forked processes joined by a fresh gloo file store."""
    import torch.multiprocessing as mp

    store = out_dir / f"store-{uuid.uuid4().hex}"  # a store file must not be reused by a later group
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_entry, args=(fn, nprocs, out_dir, store, args), nprocs=nprocs, start_method=method, join=True)


def _entry(rank: int, fn: Callable, nprocs: int, out_dir: pathlib.Path, store: pathlib.Path, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.pop("WORLD_SIZE", None)
    os.environ.pop("LOCAL_RANK", None)
    init_parallel(
        1,
        nprocs,
        device="cpu",
        init_method=f"file://{store}",
        rank=rank,
        world_size=nprocs,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn(rank, nprocs, out_dir, *args)
    finally:
        dist.destroy_process_group()


def save(out_dir: pathlib.Path, scenario: str, rank: int, **record: Any) -> None:
    torch.save(record, out_dir / f"{scenario}_rank{rank}.pt")


def load(out_dir: pathlib.Path, scenario: str, nprocs: int) -> list[dict]:
    return [torch.load(out_dir / f"{scenario}_rank{r}.pt", weights_only=False) for r in range(nprocs)]


# ---------------------------------------------------------------------------------------------------------------------
# workers


@dataclass(frozen=True)
class Run:
    """One split run: `tp × sp` processes, Turbo or CFG (`cfg`), and, for the negative control, the diff left
    unreduced (`reduce=False`) under cache settings that cannot let the ranks' decisions diverge (`cache`)."""

    name: str
    tp: int
    sp: int
    cfg: str | None = None
    reduce: bool = True
    cache: dict | None = None


def run_split(tiny: TinyModel, cache: dict, run: Run) -> tuple[torch.Tensor, dict]:
    pipe = make_pipeline(tiny)
    parallelize(pipe.transformer, build_context(run.tp, run.sp, "cpu"))
    if not run.reduce:
        delattr(pipe.transformer, PARALLEL_LAYOUT_ATTR)
    dicache.enable(pipe, {"enable_cache": True})
    latents = generate(pipe, tiny.config, cache, run.cfg)
    return latents, decisions(pipe)


def single_and_split_worker(rank: int, world: int, out_dir: pathlib.Path, tiny: TinyModel, runs: list[Run]) -> None:
    """For each run: the single-process reference (computed in this very process) and the split run."""
    references: dict[Any, tuple[dict, torch.Tensor, dict]] = {}
    for run in runs:
        if run.cfg not in references:
            pipe = make_pipeline(tiny)
            dicache.enable(pipe, {"enable_cache": True})
            cache = dynamic_cache_settings(pipe, tiny.config, run.cfg)
            references[run.cfg] = (cache, generate(pipe, tiny.config, cache, run.cfg), decisions(pipe))
        cache, ref_latents, ref_decisions = references[run.cfg]
        latents, split_decisions = run_split(tiny, run.cache or cache, run)
        save(
            out_dir,
            run.name,
            rank,
            latents=latents,
            decisions=split_decisions,
            ref_latents=ref_latents,
            ref_decisions=ref_decisions,
            threshold=cache["residual_diff_threshold"],
        )


def reduction_worker(rank: int, world: int, out_dir: pathlib.Path) -> None:
    """`relative_change` over unequal token shares with a replicated prefix equals the single-process value."""
    gen = torch.Generator().manual_seed(3)
    prefix, image = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 22, 8, generator=gen)
    prefix_ref, image_ref = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 22, 8, generator=gen)
    whole = relative_change((torch.cat([prefix, image], 1),), (torch.cat([prefix_ref, image_ref], 1),))
    lo, hi = [(0, 3), (3, 22)][rank]  # unequal image shares; the 5-token prefix is on both processes

    class Layout:
        group = dist.group.WORLD

        @staticmethod
        def counted(stream: torch.Tensor) -> torch.Tensor:
            return stream if rank == 0 else stream[:, 5:]

    local = (torch.cat([prefix, image[:, lo:hi]], 1),)
    local_ref = (torch.cat([prefix_ref, image_ref[:, lo:hi]], 1),)
    save(out_dir, "reduction", rank, whole=whole, reduced=relative_change(local, local_ref, Layout()))


class _FakeBackend:
    """Stands in for `PipelineBackend`: each generation is 3 'transformer calls', each one collective."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.closed = False

    def generate(self, spec: str, should_stop: Callable[[], bool] | None = None) -> str:
        calls = 0
        for _ in range(3):
            if should_stop is not None and should_stop():
                self.log.append((spec, calls))
                raise RuntimeError("stopped")
            total = torch.ones(1)
            dist.all_reduce(total)
            calls += 1
        self.log.append((spec, calls))
        return f"{spec}: {int(total.item())} ranks"

    def close(self) -> None:
        self.closed = True


def lockstep_worker(rank: int, world: int, out_dir: pathlib.Path) -> None:
    """Rank 0 serves two requests (the second abandoned after its first call) and closes; followers mirror it."""
    fake = _FakeBackend()
    served = lockstep(fake, build_context(1, world, "cpu"))
    results = []
    if rank == 0:
        results.append(served.generate("first"))
        asked = iter([False, True, True])
        try:
            served.generate("second", should_stop=lambda: next(asked))
        except RuntimeError as exc:
            results.append(str(exc))
        served.close()
    save(out_dir, "lockstep", rank, log=fake.log, closed=fake.closed, results=results, returned=served is not None)


def two_process_worker(rank: int, world: int, out_dir: pathlib.Path, tiny: TinyModel) -> None:
    reduction_worker(rank, world, out_dir)
    lockstep_worker(rank, world, out_dir)
    single_and_split_worker(
        rank,
        world,
        out_dir,
        tiny,
        [
            Run("sp", 1, 2),
            Run("tp", 2, 1),
            Run("sp_cfg_split", 1, 2, cfg="split"),
            Run("sp_cfg_batched", 1, 2, cfg="batched"),
            Run("tp_cfg_split", 2, 1, cfg="split"),
            Run("sp_unreduced", 1, 2, reduce=False, cache=ALWAYS_CACHE_AFTER_WARMUP),
        ],
    )


def four_process_worker(rank: int, world: int, out_dir: pathlib.Path, tiny: TinyModel) -> None:
    single_and_split_worker(rank, world, out_dir, tiny, [Run("tp2_sp2", 2, 2)])
