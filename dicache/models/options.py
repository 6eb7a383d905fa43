"""The options that say which model to load, how, and how to sample it, declared once for every command and for the
Ray Serve builder (`dicache.server.ray.options.ReplicaOptions` is made of them): `ModelChoice`, `DeviceOptions`,
`SpeedOptions`, `SamplingOptions`. Each field carries its command-line flag, help and bounds
(`dicache.settings.options.option`); the commands derive their options from them (`dicache.commands.fields`).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ..quantization import LAYER_GROUPS, NO_EXCLUSIONS, QUANTIZATION_METHODS, TEXT_ENCODER_QUANTIZATION_METHODS
from ..settings.options import FlagOptions, option
from .loading import LOAD_FORMATS
from .store_layout import ARTIFACT_ENV


class ModelChoice(FlagOptions):
    """Which checkpoint, and which of its presets requests get by default."""

    model: str | None = option(
        None,
        flag="--model",
        default_text="the embedded checkpoint; its Turbo student with --variant turbo",
        help="checkpoint folder or hub repo id (diffusers layout): Krea-2, or a diffusers pipeline of a registered "
        "family (model_index.json names the pipeline class)",
    )
    variant: Literal["turbo", "raw"] | None = option(
        None,
        flag="--variant",
        default_text="the checkpoint's own: turbo if distilled",
        help="the preset for unset steps / guidance: turbo = 8 steps, guidance 1 (no CFG); raw = 50 steps, "
        "guidance 4.5",
    )


class DeviceOptions(FlagOptions):
    """Where the model runs and in which precision."""

    device: str | None = option(None, flag="--device", default_text="cuda if available", help="cpu, cuda, cuda:1 ...")
    dtype: Literal["float32", "bfloat16", "float16"] | None = option(
        None, flag="--dtype", default_text="bfloat16 on CUDA, float32 on CPU", help="weights dtype"
    )


class QuantizationOptions(FlagOptions):
    """The transformer blocks' linears in 8 bits (`dicache generate`/`serve` through `SpeedOptions`; `dicache
    calibrate` calibrates the model as it will be served)."""

    group: ClassVar[tuple[str, str | None]] = ("loading and speed", None)

    quantization: str = option(
        "none",
        flag="--quantization",
        choices=("none", *QUANTIZATION_METHODS),
        help="the transformer blocks' linears in 8 bits, weights stored so (per-row activation and per-channel weight "
        "scales; torchao: `pip install 'dicache[fp8]'`). fp8: FP8 e4m3 GEMMs, needs an Ada/Hopper GPU; attention k, v "
        "and output projections stay bf16 by default. int8: INT8 GEMMs with int32 accumulation, every block linear, "
        "far closer to bf16 than fp8 (CUDA >= 8.0, or the CPU). fp8-emulated: fp8's linears and arithmetic emulated in "
        "float32 on any device, no torchao (slow: to calibrate or judge the FP8 model without an FP8 GPU)",
    )
    quantization_exclude: list[str] | None = option(
        None,
        flag="--quantization-exclude",
        metavar="GROUP_OR_GLOB",
        help="block linears kept in bf16 under --quantization, replacing the method's defaults: group names "
        f"({', '.join(LAYER_GROUPS)}) or glob patterns over module names, e.g. 'transformer_blocks.*.attn.to_gate'; "
        f"'{NO_EXCLUSIONS}': every block linear quantised",
    )


class SpeedOptions(QuantizationOptions):
    """Loading and speed: weights read or drawn, FP8, `torch.compile` (applied in that order after loading)."""

    group: ClassVar[tuple[str, str | None]] = ("loading and speed", None)

    load_format: str = option(
        "auto",
        flag="--load-format",
        choices=LOAD_FORMATS,
        help="auto: read the checkpoint's weights; dummy: random weights from its config files alone, for speed and "
        "memory measurements (SGLang's flag)",
    )
    prefetch_weights: bool = option(
        True,
        flag="--prefetch-weights",
        switch=True,
        help="serve, warmup and generate with a local --model folder: read its weight files (or its quantised "
        "weights in the artifact folder) into the page cache from the process's first instant, while it imports, so "
        "that loading finds them there; with --compile and an artifact folder, first the shared libraries and "
        "modules an earlier start listed there (docs/startup.md)",
    )
    compile: bool = option(
        False,
        flag="--compile",
        help="torch.compile the transformer blocks and the VAE decoder, and on a GPU replay the text encoder from CUDA "
        "graphs (the first generation at a new shape compiles; `dicache serve` does that at start-up for its default "
        "size)",
    )
    compile_artifact: str | None = option(
        None,
        flag="--compile-artifact",
        metavar="PATH",
        default_text=f"{ARTIFACT_ENV}, else none",
        help="with --compile: a folder of compile artifacts (docs/startup.md). The one made for this model, GPU, "
        "software, quantization and shapes is loaded before compiling, so nothing in it is compiled again; if there "
        "is none, the compiled code is saved there afterwards (when the folder is writable). Write one with "
        "`dicache warmup`",
    )
    artifact_weights: bool = option(
        True,
        flag="--artifact-weights",
        switch=True,
        help="with --compile-artifact and --quantization / --text-encoder-quantization fp8: keep the quantised "
        "transformer and text encoder in the artifact folder as well (about half their checkpoint's bytes for FP8, "
        "one copy per checkpoint and quantization) and read them from there on later starts, without quantising "
        "(docs/startup.md)",
    )


class TextEncoderOptions(FlagOptions):
    """The text encoder's precision (`dicache generate` and `dicache serve` without the memory options)."""

    group: ClassVar[tuple[str, str | None]] = ("loading and speed", None)

    text_encoder_quantization: str = option(
        "none",
        flag="--text-encoder-quantization",
        choices=("none", *TEXT_ENCODER_QUANTIZATION_METHODS),
        help="the text encoder's decoder-layer linears in FP8 (about 3.5 GB less for Krea-2's; not with the memory "
        "options): " + "; ".join(f"{name}: {what}" for name, what in TEXT_ENCODER_QUANTIZATION_METHODS.items()),
    )


class SamplingOptions(FlagOptions):
    """The sampling schedule of a generation (unset: the variant's preset)."""

    steps: int | None = option(None, flag="--steps", ge=1, default_text="by variant", help="denoising steps")
    guidance: float | None = option(
        None,
        flag="--guidance",
        ge=1,
        default_text="by variant",
        help="CFG scale s in uncond + s*(cond - uncond); 1 = no CFG (Krea's reference g = s - 1); a family's "
        "pipeline gets it as true_cfg_scale where it has one (Flux.1, Qwen-Image), else as guidance_scale",
    )
    embedded_guidance: float | None = option(
        None,
        flag="--embedded-guidance",
        ge=0,
        default_text="the pipeline's",
        help="the guidance embedding's value (Flux.1-dev's guidance_scale), for a transformer that has one",
    )
