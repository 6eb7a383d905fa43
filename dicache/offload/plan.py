"""Memory planning for small GPUs, decided once at load time from byte counts (pure: no tensors, no modules).

What lives on the device, by phase of a request:

- always: the transformer's weights outside its blocks, the resident blocks, the slots streamed blocks pass through,
  and every component that is not offloaded (text encoder, VAE);
- encode: the text encoder if it is offloaded (brought in whole) plus its working memory;
- denoise: one transformer call's working memory at the largest planned input, plus the residuals the cache stores
  (plus the whole transformer when it is offloaded whole, `--dit-cpu-offload`);
- decode: the VAE if it is offloaded, plus its working memory.

The peak is `always + max(phases) + reserve`. With layerwise offload the planner keeps as many blocks resident as fit
under the budget: first the blocks every call runs (the cache's Fn and Bn blocks), then middle blocks placed so that
every streamed block has resident blocks before it (the longest run right after Fn), and streams the rest through
`prefetch + 1` slots. A budget nothing fits is a `MemoryBudgetError` naming what was needed and what was available.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import MemoryBudgetError
from .settings import BUDGET_FLAG, PREFETCH_FLAG, OffloadSettings, prefetch_blocks

GiB = 1 << 30

__all__ = [
    "BUDGET_FLAG",
    "GiB",
    "MemoryNeeds",
    "MemoryPlan",
    "OffloadSettings",
    "PREFETCH_FLAG",
    "format_bytes",
    "plan_memory",
    "prefetch_blocks",
    "resident_layout",
]


def resident_layout(num_blocks: int, always_run: Sequence[int], num_resident: int) -> tuple[int, ...]:
    """The `num_resident` blocks kept on the device, sorted.

    Blocks every call runs (`always_run`, e.g. the cache's Fn and Bn blocks) come first, in the order given. The
    other resident blocks fill the middle so that every streamed block is preceded by a run of resident ones whose
    compute hides its copy: the `m` resident middle blocks are split into one run before each of the `s` streamed
    blocks, as evenly as possible, longer runs first (the first streamed block gets the most lead time).
    """
    if not 0 <= num_resident <= num_blocks:
        raise ValueError(f"num_resident={num_resident} must be in [0, {num_blocks}]")
    first = list(dict.fromkeys(i for i in always_run if 0 <= i < num_blocks))
    if num_resident <= len(first):
        return tuple(sorted(first[:num_resident]))
    middle = [i for i in range(num_blocks) if i not in set(first)]
    keep = num_resident - len(first)
    streamed = len(middle) - keep
    if streamed == 0:
        return tuple(range(num_blocks))
    chosen: list[int] = []
    position = 0
    for run in range(streamed):
        length = keep // streamed + (1 if run < keep % streamed else 0)
        chosen.extend(middle[position : position + length])
        position += length + 1  # the streamed block after the run
    return tuple(sorted(first + chosen))


@dataclass(frozen=True)
class MemoryNeeds:
    """Bytes a pipeline needs on the device, measured from its loaded weights (after any quantization) and
    estimated for its largest planned input.

    block_bytes: each transformer block's weights, as packed for streaming (one entry per block, in order).
    other_dit_bytes: the transformer's weights outside its blocks.
    dit_activation_bytes: peak working memory of one transformer call.
    cache_bytes: residuals the cache keeps per request (0 without caching).
    text_encoder_bytes / vae_bytes: weights (0 when the pipeline has none).
    text_encoder_activation_bytes / vae_activation_bytes: their working memory at the largest planned input.
    reserve_bytes: allocator slack and library workspaces kept free.
    shape: how the activations were sized, for messages (e.g. "1024x1024, 2 rows per call").
    """

    block_bytes: tuple[int, ...]
    other_dit_bytes: int
    dit_activation_bytes: int
    cache_bytes: int = 0
    text_encoder_bytes: int = 0
    text_encoder_activation_bytes: int = 0
    vae_bytes: int = 0
    vae_activation_bytes: int = 0
    reserve_bytes: int = 0
    shape: str = ""


def format_bytes(count: int) -> str:
    """`count` bytes in GiB, or MiB / KiB / B when small (messages about tiny models stay readable)."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size // 10:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


@dataclass(frozen=True)
class MemoryPlan:
    """The decision: which blocks stay on the device, which stream, through how many slots, and the peaks it implies.

    dit_mode: 'resident', 'layerwise' or 'cpu'. resident/streamed: block indices (sorted). num_slots × slot_bytes:
    device buffers streamed blocks pass through. phases: bytes each phase adds on top of `always_bytes`.
    peak_bytes: `always_bytes + max(phases) + reserve`. budget_bytes: None when unbounded.
    """

    dit_mode: str
    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    num_slots: int
    slot_bytes: int
    always_bytes: int
    phases: dict[str, int]
    reserve_bytes: int
    budget_bytes: int | None
    budget_source: str = ""
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return self.always_bytes + max(self.phases.values(), default=0) + self.reserve_bytes

    @property
    def streamed_bytes_per_full_call(self) -> int:
        """Bytes copied by a call that runs every block (each streamed block once)."""
        return self.parts.get("streamed_blocks", 0)

    def describe(self) -> str:
        """One paragraph for logs: where the blocks are and the planned peak against the budget."""
        budget = "unbounded" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        source = f" ({self.budget_source})" if self.budget_source else ""
        lines = [
            f"memory plan: transformer {self.dit_mode}; {len(self.resident)} blocks resident, "
            f"{len(self.streamed)} streamed through {self.num_slots} slot(s) of {format_bytes(self.slot_bytes)}; "
            f"planned peak {format_bytes(self.peak_bytes)} of {budget}{source}"
        ]
        if self.streamed:
            lines.append(f"  streamed blocks: {list(self.streamed)}")
        detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in {**self.parts, **self.phases}.items() if v)
        lines.append(f"  {detail}, reserve {format_bytes(self.reserve_bytes)}")
        return "\n".join(lines)


def plan_memory(
    needs: MemoryNeeds,
    settings: OffloadSettings,
    budget_bytes: int | None,
    always_run: Sequence[int] = (0,),
    budget_source: str = "",
) -> MemoryPlan:
    """Decide where the transformer's blocks live under `budget_bytes` (None: unbounded). Raises `MemoryBudgetError`
    when nothing fits, naming the parts of what was needed and what was available."""
    num_blocks = len(needs.block_bytes)
    mode = settings.dit_mode
    if mode != "layerwise":
        plan = _evaluate(needs, settings, budget_bytes, budget_source, mode, tuple(range(num_blocks)), 0)
        if budget_bytes is not None and plan.peak_bytes > budget_bytes:
            layerwise = OffloadSettings.flag("dit_layerwise_offload")
            hint = "" if mode == "cpu" else f"; {layerwise} streams the blocks that do not fit"
            raise MemoryBudgetError(_too_small(plan, budget_bytes, budget_source, hint, needs.shape))
        return plan
    prefetch = prefetch_blocks(settings.dit_offload_prefetch_size, num_blocks)
    last = None
    for count in range(num_blocks, -1, -1):
        resident = resident_layout(num_blocks, always_run, count)
        slots = min(prefetch + 1, num_blocks - count)
        last = _evaluate(needs, settings, budget_bytes, budget_source, mode, resident, slots)
        if budget_bytes is None or last.peak_bytes <= budget_bytes:
            return last
    hint = (
        f" with every block streamed through {last.num_slots} slot(s) ({PREFETCH_FLAG} "
        f"{settings.dit_offload_prefetch_size:g}); lower the image size or batch, lower {PREFETCH_FLAG}, offload the "
        f"text encoder / VAE ({OffloadSettings.flag('text_encoder_cpu_offload')}, "
        f"{OffloadSettings.flag('vae_cpu_offload')}) or quantize the transformer"
    )
    raise MemoryBudgetError(_too_small(last, budget_bytes, budget_source, hint, needs.shape))


def _evaluate(
    needs: MemoryNeeds,
    settings: OffloadSettings,
    budget_bytes: int | None,
    budget_source: str,
    mode: str,
    resident: tuple[int, ...],
    num_slots: int,
) -> MemoryPlan:
    streamed = tuple(i for i in range(len(needs.block_bytes)) if i not in set(resident))
    slot_bytes = max((needs.block_bytes[i] for i in streamed), default=0) if num_slots else 0
    whole_dit = needs.other_dit_bytes + sum(needs.block_bytes)
    parts = {
        "transformer_outside_blocks": needs.other_dit_bytes if mode != "cpu" else 0,
        "resident_blocks": sum(needs.block_bytes[i] for i in resident) if mode != "cpu" else 0,
        "streamed_blocks": sum(needs.block_bytes[i] for i in streamed),
        "slots": num_slots * slot_bytes,
        "text_encoder": 0 if settings.text_encoder_cpu_offload else needs.text_encoder_bytes,
        "vae": 0 if settings.vae_cpu_offload else needs.vae_bytes,
    }
    always = sum(v for k, v in parts.items() if k != "streamed_blocks")
    phases = {
        "encode": needs.text_encoder_activation_bytes
        + (needs.text_encoder_bytes if settings.text_encoder_cpu_offload else 0),
        "denoise": needs.dit_activation_bytes + needs.cache_bytes + (whole_dit if mode == "cpu" else 0),
        "decode": needs.vae_activation_bytes + (needs.vae_bytes if settings.vae_cpu_offload else 0),
    }
    return MemoryPlan(
        dit_mode=mode,
        resident=resident if mode != "cpu" else (),
        streamed=streamed,
        num_slots=num_slots,
        slot_bytes=slot_bytes,
        always_bytes=always,
        phases=phases,
        reserve_bytes=needs.reserve_bytes,
        budget_bytes=budget_bytes,
        budget_source=budget_source,
        parts=parts,
    )


def _too_small(plan: MemoryPlan, budget_bytes: int, source: str, hint: str, shape: str) -> str:
    parts = {k: v for k, v in plan.parts.items() if v and k != "streamed_blocks"}
    phase, phase_bytes = max(plan.phases.items(), key=lambda kv: kv[1])
    detail = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in parts.items())
    at = f" at {shape}" if shape else ""
    origin = f" ({source})" if source else ""
    return (
        f"the GPU memory budget is too small: {format_bytes(plan.peak_bytes)} needed ({detail}, {phase} phase "
        f"{format_bytes(phase_bytes)}{at}, reserve {format_bytes(plan.reserve_bytes)}), "
        f"{format_bytes(budget_bytes)} available{origin}{hint}"
    )
