"""8-bit weights for a loaded transformer: a property of the model, applied once after loading (docs/architecture.md
§9).

`quantize_transformer(model, "fp8")` turns the selected `nn.Linear`s into FP8 e4m3 linears through torchao
(`Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`): weights stored in FP8 with one scale per output
channel, activations quantised per row at run time, GEMMs on FP8 tensor cores. `"int8"` does the same with symmetric
INT8 (`Int8DynamicActivationInt8WeightConfig`, per-row activation and per-channel weight scales, integer GEMMs with
int32 accumulation): on Krea-2 it is far more accurate than e4m3 (eight significant bits instead of four, and the
activations have no large outliers), so every block linear can take it. Everything else (the engine, the offloader,
`torch.compile`) sees ordinary modules.

Which linears are quantised is data: `QuantizationSpec.include` (glob patterns over qualified module names) minus
`exclude`. The defaults quantise the transformer blocks' linears and keep everything else in bf16 (embeddings,
time modulation, text path, final layer), plus the groups measured to cost the most fidelity for the least speed
(`DEFAULT_FP8_EXCLUDE`; benchmarks/RESULTS.md "FP8 fidelity by layer group").

Where FP8 cannot run (no CUDA device, compute capability below 8.9, torchao missing) `check_fp8_support` raises a
`QuantizationError` naming what is missing: there is no silent bf16 fallback.

The text encoder (`quantize_text_encoder`) stores its decoder-layer weights in FP8 and computes in bf16 by default
(`fp8_storage.store_linears_in_fp8`), or takes the transformer's FP8 GEMMs (`fp8-dynamic`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..errors import DicacheError
from .fp8_emulation import emulate_fp8
from .fp8_storage import store_linears_in_fp8
from .joint_linears import join_linears, joinable_groups, joint_name

QUANTIZATION_METHODS = ("fp8", "int8", "fp8-emulated")
"""Accepted values of `--quantization` besides none (SGLang's flag name; fp8 is SGLang's value too). `fp8-emulated`
selects the linears `fp8` selects and computes what torchao's per-row FP8 GEMM computes, in float32 on any device
(`fp8_emulation`, exact accumulation): slow, for calibrating and judging the FP8 model where FP8 cannot run."""

EMULATED_METHODS: dict[str, str] = {"fp8-emulated": "fp8"}
"""Emulated methods and the method whose selection and arithmetic each reproduces."""

FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) or newer."""

DEFAULT_FP8_INCLUDE: tuple[str, ...] = ("transformer_blocks.*",)
"""Linears quantised by default: every linear inside the block stack."""

DEFAULT_FP8_EXCLUDE: tuple[str, ...] = ("attn_kv", "attn_out")
"""Block linears kept in bf16 by default: the attention key/value and output projections, the groups whose FP8 error
costs the most fidelity for their FLOPs. The query projection runs in FP8 with the feed-forward and gate groups: on the
embedded checkpoint 35.37 dB mean (worst 27.41) on Raw 28 and 39.81 dB (worst 35.73) on 8 steps against bf16, and a
block 4.1 % faster than with q in bf16 too (benchmarks/RESULTS.md "FP8 fidelity and speed by layer group",
2026-12-03). The 2026-12-01 default (all attention projections in bf16) is
`--quantization-exclude attn_qkv attn_out`."""

DEFAULT_EXCLUDE: dict[str, tuple[str, ...]] = {"fp8": DEFAULT_FP8_EXCLUDE, "int8": ()}
"""Block linears each method keeps in bf16 unless `--quantization-exclude` says otherwise. INT8 keeps none: with
every block linear in INT8 the embedded checkpoint stays at about 42 dB (Raw 28) / 45 dB (8 steps) against bf16 in
emulation, against 36 / 39 dB for the FP8 default (benchmarks/RESULTS.md, issue 27). An emulated
method keeps what the method it emulates keeps."""
DEFAULT_EXCLUDE.update({emulated: DEFAULT_EXCLUDE[method] for emulated, method in EMULATED_METHODS.items()})

LAYER_GROUPS: dict[str, tuple[str, ...]] = {
    "attn_qkv": ("*.attn.to_q", "*.attn.to_k", "*.attn.to_v"),
    "attn_q": ("*.attn.to_q",),
    "attn_kv": ("*.attn.to_k", "*.attn.to_v"),
    "attn_gate": ("*.attn.to_gate",),
    "attn_out": ("*.attn.to_out.0",),
    "ff_in": ("*.ff.gate", "*.ff.up"),
    "ff_out": ("*.ff.down",),
    "first_block": ("transformer_blocks.0.*",),
    "last_block": ("transformer_blocks.-1.*",),
}
"""Named groups of block linears, for `exclude` lists and the per-group fidelity measurement (`attn_q` / `attn_kv`
split `attn_qkv`: q is the attention projection FP8 costs least, per FLOP). `-1` in a pattern stands for the last
block's index."""


JOIN_PROJECTIONS_DEFAULT: dict[str, bool] = {"fp8": True, "int8": False, "fp8-emulated": False}
"""Whether each method joins the projections that read one input (`QuantizationSpec.join_projections`). FP8: a
full-size Krea-2 block 1.9 % faster with q|gate, k|v and gate|up joined (benchmarks/RESULTS.md,
`probe_fp8_block_compile.py`, 2026-12-03); INT8: not measured, so not joined. Emulated FP8: joining changes no
value (per-row activation and per-output-channel weight scales are the same joined or apart), so not joined."""


class QuantizationError(DicacheError, RuntimeError):
    """Quantization was asked for but cannot run here, or its settings are invalid. The message says what is missing."""


def _import_torchao(what: str) -> None:
    try:
        import torchao  # noqa: F401
    except ImportError as exc:
        raise QuantizationError(f"{what} needs torchao: pip install 'dicache[fp8]' ({exc})") from None


@dataclass(frozen=True)
class QuantizationSpec:
    """A validated quantization request.

    method: "fp8" or "int8" (`QUANTIZATION_METHODS`).
    include / exclude: glob patterns (or `LAYER_GROUPS` names) over the transformer's qualified module names; a
        linear is quantised iff it matches some include pattern and no exclude pattern. `exclude=None` takes the
        method's default (`DEFAULT_EXCLUDE`).
    join_projections: join the projections a module declares `joinable` (Krea-2: attention q|gate and k|v, the
        SwiGLU's gate|up) into one GEMM each where the parts are all quantised or all kept in bf16 (`join_selected`);
        None takes the method's default (`JOIN_PROJECTIONS_DEFAULT`). Names in include/exclude stay the parts'.
    """

    method: str = "fp8"
    include: tuple[str, ...] = DEFAULT_FP8_INCLUDE
    exclude: tuple[str, ...] | None = None
    join_projections: bool | None = None

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise QuantizationError(
                f"quantization={self.method!r} is invalid: must be one of none, {', '.join(QUANTIZATION_METHODS)}"
            )
        if self.exclude is None:
            object.__setattr__(self, "exclude", DEFAULT_EXCLUDE[self.method])
        if self.join_projections is None:
            object.__setattr__(self, "join_projections", JOIN_PROJECTIONS_DEFAULT[self.method])
        for what, patterns in (("include", self.include), ("exclude", self.exclude)):
            if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
                raise QuantizationError(
                    f"quantization {what}={patterns!r} is invalid: must be a list of glob patterns or group names "
                    f"({', '.join(LAYER_GROUPS)})"
                )


NO_EXCLUSIONS = "none"
"""The `--quantization-exclude` value that keeps no block linear in bf16."""


def parse_quantization(method: str | None, exclude: Sequence[str] | None = None) -> QuantizationSpec | None:
    """`--quantization` / `quantization=` to a spec: None, "none" or "" mean no quantization.

    `exclude` replaces the default exclusions when given (group names from `LAYER_GROUPS` or glob patterns;
    `["none"]`: every selected linear in FP8).
    """
    if method is None or str(method).strip().lower() in ("", "none"):
        if exclude:
            raise QuantizationError(
                f"quantization exclusions were given without --quantization ({', '.join(QUANTIZATION_METHODS)})"
            )
        return None
    method = str(method).strip().lower()
    if exclude is None:
        return QuantizationSpec(method=method)
    exclude = tuple(exclude)
    if NO_EXCLUSIONS in exclude:
        if len(exclude) > 1:
            raise QuantizationError(
                f"quantization exclude={list(exclude)} is invalid: {NO_EXCLUSIONS!r} (nothing kept in bf16) must "
                "stand alone"
            )
        exclude = ()
    return QuantizationSpec(method=method, exclude=exclude)


def _expand(patterns: Sequence[str], num_blocks: int) -> list[str]:
    out = []
    for pattern in patterns:
        for p in LAYER_GROUPS.get(pattern, (pattern,)):
            out.append(p.replace("transformer_blocks.-1.", f"transformer_blocks.{num_blocks - 1}."))
    return out


def selected_linears(model: nn.Module, spec: QuantizationSpec) -> list[str]:
    """Qualified names of the `nn.Linear`s of `model` that `spec` quantises, in module order."""
    blocks = getattr(model, "transformer_blocks", None)
    num_blocks = len(blocks) if blocks is not None else 0
    include, exclude = _expand(spec.include, num_blocks), _expand(spec.exclude, num_blocks)
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    unknown = [p for p in spec.exclude if p not in LAYER_GROUPS and not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unknown:
        raise QuantizationError(
            f"quantization exclude pattern(s) {unknown} match no linear of {type(model).__name__}; allowed: group "
            f"names {', '.join(LAYER_GROUPS)} or glob patterns such as 'transformer_blocks.*.attn.to_gate'"
        )
    return [
        name
        for name in names
        if any(fnmatch.fnmatchcase(name, p) for p in include) and not any(fnmatch.fnmatchcase(name, p) for p in exclude)
    ]


def check_fp8_support(device: torch.device | str) -> None:
    """Raise `QuantizationError` unless FP8 linears can run on `device` (CUDA, capability >= 8.9, torchao)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise QuantizationError(
            f"quantization='fp8' needs an NVIDIA GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or "
            f"newer); the model is on {device.type!r}. Drop --quantization or run on such a GPU."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise QuantizationError(
            f"quantization='fp8' needs compute capability >= 8.9; {name} has {capability[0]}.{capability[1]}. "
            "Drop --quantization on this GPU."
        )
    _import_torchao("quantization='fp8'")


def quantize_transformer(
    model: nn.Module, spec: QuantizationSpec | str, *, only: Callable[[str], bool] | None = None
) -> list[str]:
    """Quantise `model`'s selected linears in place; returns their qualified names.

    The model must already sit on its CUDA device in bf16 (after any tensor-parallel split, so that each shard gets
    its own scales). Call before `torch.compile`. `only(name)`: quantise (and join) just the selected linears it
    accepts, e.g. one block read while the next ones are still on the meta device (`Krea2Pipeline.from_pretrained`
    quantises each block as it is read); the selection and the joins are the whole model's, so quantising part by
    part gives the same model as at once. With `only`, selecting nothing is not an error.
    """
    if isinstance(spec, str):
        spec = QuantizationSpec(method=spec)
    names, chosen = quantized_structure(model, spec, only=only)
    if not names:
        return []
    if spec.method == "int8":
        int8_linears(model, chosen)
    elif spec.method in EMULATED_METHODS:  # float32 on any device: activations per row, weights per channel
        emulate_fp8(model, sorted(chosen))
    else:
        fp8_linears(model, chosen)
    model.quantization = spec
    return sorted(names)


def quantized_structure(
    model: nn.Module, spec: QuantizationSpec, *, only: Callable[[str], bool] | None = None
) -> tuple[list[str], set[str]]:
    """Give `model` the module structure `quantize_transformer(model, spec, only=only)` leaves, without quantising:
    the projections it joins, joined (on any device, the meta device included: a quantised snapshot is loaded into
    this structure). Returns the selected linears' names and the names of the linears to quantise (joined ones by
    their joint name). Selecting nothing is a `QuantizationError` unless `only` is given."""
    keep = only if only is not None else (lambda name: True)
    names = sorted(name for name in selected_linears(model, spec) if keep(name))
    if not names and only is None:
        raise QuantizationError(f"quantization={spec.method!r}: the include/exclude patterns select no linear")
    chosen = set(names)
    if names and spec.join_projections:  # the scope: what the include patterns select, exclusions aside
        scope = {name for name in selected_linears(model, replace(spec, exclude=())) if keep(name)}
        chosen = join_selected(model, chosen, scope)
    return names, chosen


def join_selected(model: nn.Module, selected: set[str], scope: set[str]) -> set[str]:
    """Join each `joinable` group of `model` (`joint_linears.joinable_groups`) whose parts are all in `selected`, or all
    in `scope` and none in `selected` (kept in bf16 together); groups that would mix precisions stay apart. Returns
    `selected` with each joined group's part names replaced by its joint linear's name."""
    selected = set(selected)
    for prefix, module, parts in joinable_groups(model):
        qualified = [f"{prefix}.{p}" if prefix else p for p in parts]
        quantised = [q in selected for q in qualified]
        if all(quantised) or (not any(quantised) and all(q in scope for q in qualified)):
            join_linears(module, parts)
            if all(quantised):
                selected -= set(qualified)
                selected.add(f"{prefix}.{joint_name(parts)}" if prefix else joint_name(parts))
    return selected


TEXT_ENCODER_FP8_INCLUDE: tuple[str, ...] = ("language_model.layers.*",)
"""Text-encoder linears `--text-encoder-quantization` quantises: those of the decoder layers (attention q/k/v/o and
the MLP); the embedding table stays bf16."""

TEXT_ENCODER_QUANTIZATION_METHODS: dict[str, str] = {
    "fp8": "weights stored in FP8 e4m3 (one power-of-two scale per output channel), converted to bf16 in each call, "
    "GEMMs in bf16: the weights' bytes halved at about bf16's fidelity",
    "fp8-dynamic": "FP8 GEMMs as --quantization fp8 (activations quantised per row at run time): the same bytes, "
    "slower in the text encoder's eager once-per-request pass (torchao's per-call quantisation)",
}
"""Accepted values of `--text-encoder-quantization` besides none, with what each does. The text encoder runs once per
request, eagerly, on a few hundred tokens: its time is the CPU's kernel launches, not FLOPs, so FP8 arithmetic gains
nothing there and its per-call quantisation costs time (benchmarks/RESULTS.md, issue 27); FP8 storage is what saves
the memory."""


def quantize_text_encoder(model: nn.Module, method: str = "fp8") -> list[str]:
    """The decoder-layer linears of a Qwen3-VL text encoder (`TEXT_ENCODER_FP8_INCLUDE`) in FP8, in place, as
    `method` (`TEXT_ENCODER_QUANTIZATION_METHODS`) says; returns their names. Halves those weights' bytes (3.6 of
    Qwen3-VL-4B's 3.9 B kept parameters). "fp8" runs on any device (FP8 is only the storage); "fp8-dynamic" needs
    FP8 tensor cores (`check_fp8_support`)."""
    if method not in TEXT_ENCODER_QUANTIZATION_METHODS:
        raise QuantizationError(
            f"text encoder quantization={method!r} is invalid: must be one of none, "
            f"{', '.join(TEXT_ENCODER_QUANTIZATION_METHODS)}"
        )
    names = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in TEXT_ENCODER_FP8_INCLUDE)
    }
    if not names:
        raise QuantizationError(
            f"text encoder quantization: no linear of {type(model).__name__} matches {TEXT_ENCODER_FP8_INCLUDE}"
        )
    if method == "fp8-dynamic":
        fp8_linears(model, names)
    else:
        store_linears_in_fp8(model, names)
    return sorted(names)


FP8_ACTIVATION_FLOOR = 1e-12
"""Smallest row maximum an FP8 activation scale is computed from. torchao's dynamic scale is `amax / 448`, so an
all-zero input row (a zeroed or padded token, a norm with zero gain) had scale 0 and quantised to 0/0 = NaN, which
attention then spread to every token; with the floor such a row quantises to zeros. Rows with any value above the
floor are scaled exactly as before."""


def fp8_linears(model: nn.Module, names: set[str]) -> None:
    """torchao's dynamic FP8 (module docstring) on the linears of `model` named in `names`, in place.

    torch.compile's settings are left alone: torchao's default (`set_inductor_config=True`) turns inductor's
    coordinate-descent tuning on, in every direction, for the whole process, so that every Triton kernel compiled
    afterwards (the blocks', the VAE decoder's at full resolution, the text encoder's) is benchmarked over many
    block sizes at its first run: minutes of a cold start and its autotuning memory, for an FP8 block no faster
    (-0.2 %, benchmarks/results/archive/2026-12-03-2113-probe_fp8_block_compile.md)."""
    check_fp8_support(_device_of(model, names))
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    config = Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), activation_value_lb=FP8_ACTIVATION_FLOOR, set_inductor_config=False
    )
    _quantize_linears(model, names, config)


INT8_MIN_CAPABILITY = (8, 0)
"""INT8 GEMMs through `torch._int_mm` on CUDA: Ampere (8.0) or newer."""


def check_int8_support(device: torch.device | str) -> None:
    """Raise `QuantizationError` unless INT8 linears can run on `device`: the CPU, or CUDA of capability >= 8.0;
    torchao installed."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < INT8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise QuantizationError(
            f"quantization='int8' needs compute capability >= 8.0 on CUDA; {torch.cuda.get_device_name(device)} has "
            f"{major}.{minor}. Drop --quantization on this GPU."
        )
    if device.type not in ("cuda", "cpu"):
        raise QuantizationError(f"quantization='int8' runs on CUDA or the CPU; the model is on {device.type!r}")
    _import_torchao("quantization='int8'")


def int8_linears(model: nn.Module, names: set[str]) -> None:
    """torchao's dynamic symmetric INT8 on the linears of `model` named in `names`, in place: weights stored in INT8
    with one scale per output channel, activations quantised per row at run time (an all-zero row gets torchao's
    smallest scale and stays zeros), products accumulated in int32 and rescaled to the input dtype. torch.compile's
    settings are left alone (torchao would otherwise turn on its slower-compiling tuning for the whole process)."""
    check_int8_support(_device_of(model, names))
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, PerRow

    _quantize_linears(
        model, names, Int8DynamicActivationInt8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    )


def _device_of(model: nn.Module, names: set[str]) -> torch.device:
    """Where the linears `names` of `model` keep their weights (the first of them, in module order)."""
    for name, module in model.named_modules():
        if name in names:
            return module.weight.device
    return next(model.parameters()).device


def _quantize_linears(model: nn.Module, names: set[str], config) -> None:
    """torchao's `quantize_` with `config` on the linears of `model` named in `names`, then the replaced weights'
    memory handed back."""
    from torchao.quantization import quantize_

    quantize_(model, config, filter_fn=lambda module, fqn: fqn in names)
    if _device_of(model, names).type == "cuda":
        torch.cuda.empty_cache()  # the bf16 weights just replaced stay reserved by the caching allocator otherwise
