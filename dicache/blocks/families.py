"""The family registry (pure data): for each diffusers DiT family, its block lists, their forms, the pipeline
attributes holding its transformers and its CFG layout, so `dicache.enable(pipe)` needs no arguments.

A transformer is matched by its class name or a base class's (`find_family`); an unknown one falls back to the
generic single-list path (`generic_spec`). `stack_spec` builds the `StackSpec` either way, with `form=` overriding
the registered forms. The step source is not per family: the pipeline adapter reads the scheduler's sigmas when it
has them, else its timesteps, else each forward's timestep argument (`dicache.engine.adapters.pipelines`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from torch import nn

from ..errors import ConfigError, UnsupportedModelError
from .forms import H_TO_H, HE_TO_EH, HE_TO_H, HE_TO_HE, BlockForm, E
from .generic import FormArg, apply_forms, generic_spec, timestep_getter
from .stack import StackSpec

SEPARATE, BATCHED = "separate", "batched"
"""CFG layouts: one transformer call per branch at each step, or both branches in one batched call."""


@dataclass(frozen=True)
class Family:
    """One registered family.

    name: what README and messages call it. transformer_classes: diffusers class names it covers (subclasses too).
    lists: `(attribute, form)` of each block list, in the order a forward runs them (an absent or empty list is
    left out). pipelines: the diffusers pipeline classes it serves (documentation). cfg: `SEPARATE` or `BATCHED`.
    transformers: the pipeline attributes that may hold one of its transformers, each cached on its own.
    cache_dit: how cache-dit 1.5.3 differs on this family, if it does (documentation).
    """

    name: str
    transformer_classes: tuple[str, ...]
    lists: tuple[tuple[str, BlockForm], ...]
    pipelines: tuple[str, ...]
    cfg: str
    transformers: tuple[str, ...] = ("transformer",)
    cache_dit: str = ""


SEPARATE_LISTS = (
    "cache-dit caches each block list on its own (its own Fn blocks and decision); "
    'dicache joins them by default, `lists="separate"` gives cache-dit\'s layout'
)

FAMILIES: tuple[Family, ...] = (
    Family(
        "Flux.1",
        ("FluxTransformer2DModel",),
        (("transformer_blocks", HE_TO_EH), ("single_transformer_blocks", HE_TO_EH)),
        (
            "FluxPipeline",
            "FluxImg2ImgPipeline",
            "FluxInpaintPipeline",
            "FluxKontextPipeline",
            "FluxFillPipeline",
            "FluxControlPipeline",
            "FluxControlNetPipeline",
            "VisualClozePipeline",
            "VisualClozeGenerationPipeline",
        ),
        SEPARATE,
        cache_dit="same stack; cache-dit's patched forward adds only the first ControlNet residual",
    ),
    Family(
        "Flux.2",
        ("Flux2Transformer2DModel",),
        (("transformer_blocks", HE_TO_EH), ("single_transformer_blocks", H_TO_H)),
        ("Flux2Pipeline", "Flux2KleinPipeline"),
        SEPARATE,
        cache_dit=SEPARATE_LISTS,
    ),
    Family(
        "Qwen-Image",
        ("QwenImageTransformer2DModel",),
        (("transformer_blocks", HE_TO_EH),),
        ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageImg2ImgPipeline"),
        SEPARATE,
    ),
    Family(
        "SD3 / SD3.5",
        ("SD3Transformer2DModel",),
        (("transformer_blocks", HE_TO_EH),),
        ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
        BATCHED,
        cache_dit="cache-dit runs the stack as one block, so skip-layer guidance skips no block",
    ),
    Family(
        "Wan 2.1 / 2.2",
        ("WanTransformer3DModel",),
        (("blocks", HE_TO_H),),
        ("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"),
        SEPARATE,
        transformers=("transformer", "transformer_2"),
    ),
    Family(
        "HunyuanVideo",
        ("HunyuanVideoTransformer3DModel",),
        (("transformer_blocks", HE_TO_HE), ("single_transformer_blocks", HE_TO_HE)),
        ("HunyuanVideoPipeline",),
        SEPARATE,
        cache_dit=SEPARATE_LISTS,
    ),
    Family(
        "CogVideoX",
        ("CogVideoXTransformer3DModel",),
        (("transformer_blocks", HE_TO_HE),),
        ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline"),
        BATCHED,
    ),
    Family(
        "CogView4",
        ("CogView4Transformer2DModel",),
        (("transformer_blocks", HE_TO_HE),),
        ("CogView4Pipeline",),
        SEPARATE,
    ),
    Family(
        "Lumina 2",
        ("Lumina2Transformer2DModel",),
        (("layers", H_TO_H),),
        ("Lumina2Pipeline",),
        SEPARATE,
    ),
    Family(
        "Chroma",
        ("ChromaTransformer2DModel",),
        (("transformer_blocks", HE_TO_EH), ("single_transformer_blocks", H_TO_H)),
        ("ChromaPipeline", "ChromaImg2ImgPipeline"),
        SEPARATE,
        cache_dit=SEPARATE_LISTS,
    ),
    Family(
        "HiDream-I1",
        ("HiDreamImageTransformer2DModel",),
        (("double_stream_blocks", HE_TO_HE), ("single_stream_blocks", H_TO_H)),
        ("HiDreamImagePipeline",),
        BATCHED,
        cache_dit=SEPARATE_LISTS + "; cache-dit also moves the per-block Llama text into the blocks",
    ),
    Family(
        "PixArt-α / Σ",
        ("PixArtTransformer2DModel",),
        (("transformer_blocks", H_TO_H),),
        ("PixArtAlphaPipeline", "PixArtSigmaPipeline"),
        BATCHED,
    ),
    Family(
        "Sana",
        ("SanaTransformer2DModel",),
        (("transformer_blocks", H_TO_H),),
        ("SanaPipeline", "SanaSprintPipeline"),
        BATCHED,
    ),
    Family(
        "Mochi 1",
        ("MochiTransformer3DModel",),
        (("transformer_blocks", HE_TO_HE),),
        ("MochiPipeline",),
        BATCHED,
    ),
    Family(
        "LTX-Video",
        ("LTXVideoTransformer3DModel",),
        (("transformer_blocks", HE_TO_H),),
        ("LTXPipeline", "LTXImageToVideoPipeline"),
        BATCHED,
    ),
    Family(
        "CogView3-Plus",
        ("CogView3PlusTransformer2DModel",),
        (("transformer_blocks", HE_TO_HE),),
        ("CogView3PlusPipeline",),
        BATCHED,
    ),
    Family(
        "Krea-2",
        ("Krea2Transformer2DModel",),
        (("transformer_blocks", H_TO_H),),
        ("Krea2Pipeline",),
        SEPARATE,
    ),
    Family(
        "AuraFlow",
        ("AuraFlowTransformer2DModel",),
        (("joint_transformer_blocks", HE_TO_EH), ("single_transformer_blocks", H_TO_H)),
        ("AuraFlowPipeline",),
        BATCHED,
        cache_dit="cache-dit caches the single-stream list only (the MMDiT blocks run on every step)",
    ),
    Family(
        "Z-Image",
        ("ZImageTransformer2DModel",),
        (("layers", H_TO_H),),
        (
            "ZImagePipeline",
            "ZImageImg2ImgPipeline",
            "ZImageInpaintPipeline",
            "ZImageOmniPipeline",
            "ZImageControlNetPipeline",
            "ZImageControlNetInpaintPipeline",
        ),
        BATCHED,
    ),
    Family(
        "HunyuanImage 2.1",
        ("HunyuanImageTransformer2DModel",),
        (("transformer_blocks", HE_TO_HE), ("single_transformer_blocks", HE_TO_HE)),
        ("HunyuanImagePipeline", "HunyuanImageRefinerPipeline"),
        SEPARATE,
        cache_dit=SEPARATE_LISTS,
    ),
    Family(
        "Ovis-Image",
        ("OvisImageTransformer2DModel",),
        (("transformer_blocks", HE_TO_EH), ("single_transformer_blocks", HE_TO_EH)),
        ("OvisImagePipeline",),
        SEPARATE,
        cache_dit=SEPARATE_LISTS,
    ),
    Family(
        "Bria 3.2",
        ("BriaTransformer2DModel",),
        (("transformer_blocks", HE_TO_EH), ("single_transformer_blocks", HE_TO_EH)),
        ("BriaPipeline",),
        BATCHED,
        cache_dit="cache-dit 1.5.3 registers both lists as `(h, e) -> (h, e)` and fails on the first call",
    ),
    Family("PRX", ("PRXTransformer2DModel",), (("blocks", HE_TO_H),), ("PRXPipeline", "PRXPixelPipeline"), BATCHED),
    Family(
        "ERNIE-Image",
        ("ErnieImageTransformer2DModel",),
        (("layers", H_TO_H),),
        ("ErnieImagePipeline",),
        BATCHED,
        cache_dit="cache-dit patches the forward (same blocks and decisions)",
    ),
    Family(
        "HunyuanDiT",
        ("HunyuanDiT2DModel",),
        (("blocks", HE_TO_H),),
        ("HunyuanDiTPipeline", "HunyuanDiTPAGPipeline", "HunyuanDiTControlNetPipeline"),
        BATCHED,
    ),
    Family("DiT", ("DiTTransformer2DModel",), (("transformer_blocks", H_TO_H),), ("DiTPipeline",), BATCHED),
    Family("Lumina-Next", ("LuminaNextDiT2DModel",), (("layers", H_TO_H),), ("LuminaPipeline",), BATCHED),
    Family(
        "Wan VACE",
        ("WanVACETransformer3DModel",),
        (("blocks", HE_TO_H),),
        ("WanVACEPipeline",),
        SEPARATE,
        transformers=("transformer", "transformer_2"),
        cache_dit="cache-dit patches the forward to add the VACE hints (same blocks and decisions)",
    ),
    Family(
        "SkyReels-V2",
        ("SkyReelsV2Transformer3DModel",),
        (("blocks", HE_TO_H),),
        (
            "SkyReelsV2Pipeline",
            "SkyReelsV2ImageToVideoPipeline",
            "SkyReelsV2DiffusionForcingPipeline",
            "SkyReelsV2DiffusionForcingImageToVideoPipeline",
            "SkyReelsV2DiffusionForcingVideoToVideoPipeline",
        ),
        SEPARATE,
    ),
    Family("ChronoEdit", ("ChronoEditTransformer3DModel",), (("blocks", HE_TO_H),), ("ChronoEditPipeline",), SEPARATE),
    Family(
        "Cosmos",
        ("CosmosTransformer3DModel",),
        (("transformer_blocks", HE_TO_H),),
        (
            "Cosmos2TextToImagePipeline",
            "Cosmos2VideoToWorldPipeline",
            "CosmosTextToWorldPipeline",
            "CosmosVideoToWorldPipeline",
            "Cosmos2_5_PredictBasePipeline",
            "Cosmos2_5_TransferPipeline",
        ),
        SEPARATE,
    ),
    Family(
        "Kandinsky 5",
        ("Kandinsky5Transformer3DModel",),
        (("visual_transformer_blocks", HE_TO_H),),
        ("Kandinsky5T2IPipeline", "Kandinsky5I2IPipeline", "Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline"),
        SEPARATE,
    ),
    Family(
        "HunyuanVideo 1.5",
        ("HunyuanVideo15Transformer3DModel",),
        (("transformer_blocks", HE_TO_HE),),
        ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
        SEPARATE,
    ),
    Family(
        "Allegro", ("AllegroTransformer3DModel",), (("transformer_blocks", HE_TO_H),), ("AllegroPipeline",), BATCHED
    ),
    Family(
        "EasyAnimate",
        ("EasyAnimateTransformer3DModel",),
        (("transformer_blocks", HE_TO_HE),),
        ("EasyAnimatePipeline", "EasyAnimateControlPipeline", "EasyAnimateInpaintPipeline"),
        BATCHED,
    ),
    Family(
        "AnyFlow",
        ("AnyFlowTransformer3DModel", "AnyFlowFARTransformer3DModel"),
        (("blocks", HE_TO_H),),
        ("AnyFlowPipeline", "AnyFlowFARPipeline"),
        BATCHED,
    ),
    Family(
        "Helios",
        ("HeliosTransformer3DModel",),
        (("blocks", HE_TO_H),),
        ("HeliosPipeline", "HeliosPyramidPipeline"),
        SEPARATE,
    ),
    Family(
        "JoyImage-Edit",
        ("JoyImageEditTransformer3DModel",),
        (("double_blocks", HE_TO_HE),),
        ("JoyImageEditPipeline", "JoyImageEditPlusPipeline"),
        SEPARATE,
    ),
    Family(
        "LTX-2",
        ("LTX2VideoTransformer3DModel",),
        (("transformer_blocks", HE_TO_HE.renamed({E: "audio_hidden_states"})),),
        ("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
        BATCHED,
        cache_dit="`e` is the audio stream (`audio_hidden_states`); cache-dit patches the forward (same blocks)",
    ),
    Family(
        "LongCat-Image",
        ("LongCatImageTransformer2DModel",),
        (("transformer_blocks", HE_TO_EH), ("single_transformer_blocks", HE_TO_EH)),
        ("LongCatImagePipeline", "LongCatImageEditPipeline"),
        SEPARATE,
        cache_dit=SEPARATE_LISTS,
    ),
    Family(
        "Bria-FIBO",
        ("BriaFiboTransformer2DModel",),
        (("transformer_blocks", HE_TO_EH), ("single_transformer_blocks", H_TO_H)),
        ("BriaFiboPipeline", "BriaFiboEditPipeline"),
        BATCHED,
        cache_dit=SEPARATE_LISTS,
    ),
    Family(
        "GLM-Image",
        ("GlmImageTransformer2DModel",),
        (("transformer_blocks", HE_TO_HE),),
        ("GlmImagePipeline",),
        SEPARATE,
        cache_dit="cache-dit patches the forward (same blocks and decisions)",
    ),
    Family(
        "aMUSEd",
        ("UVit2DModel",),
        (("transformer_layers", HE_TO_H),),
        ("AmusedPipeline", "AmusedImg2ImgPipeline", "AmusedInpaintPipeline"),
        BATCHED,
    ),
    Family(
        "Stable Audio", ("StableAudioDiTModel",), (("transformer_blocks", H_TO_H),), ("StableAudioPipeline",), BATCHED
    ),
)


def find_family(model: nn.Module) -> Family | None:
    """The family whose transformer class (or a base class of `model`) it is; None for an unknown model."""
    names = {cls.__name__ for cls in type(model).__mro__}
    for family in FAMILIES:
        if names.intersection(family.transformer_classes):
            return family
    return None


def registered_forms(model: nn.Module) -> dict[str, str] | None:
    """The form label of each block list `model`'s family entry declares, by attribute; None for an unknown model."""
    family = find_family(model)
    return None if family is None else {path: form.label for path, form in family.lists}


def family_spec(model: nn.Module, family: Family, form: FormArg = None) -> StackSpec:
    """The `StackSpec` of `model` as `family` describes it (forms overridden by `form`)."""
    lists = []
    for path, declared in family.lists:
        blocks = getattr(model, path, None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            lists.append((path, blocks, declared))
    if not lists:
        raise UnsupportedModelError(
            f"dicache.enable: {type(model).__name__} ({family.name}) has none of its block lists "
            f"({', '.join(path for path, _ in family.lists)}) or they are empty"
        )
    return StackSpec(
        owner=model,
        lists=apply_forms(lists, form),
        seam=None,
        timestep=timestep_getter(model),
        family=family.name,
    )


LIST_LAYOUTS = ("joined", "separate")
"""How a transformer's block lists are cached: `joined`, one stack (one decision per call; Fn / Bn over the whole
stack; a cached call skips the middle of every list), or `separate`, each list its own cache with its own Fn / Bn,
decision, state and stats (cache-dit's layout for the multi-list families but Flux.1 and AuraFlow)."""


def stack_specs(model: nn.Module, form: FormArg = None, lists: str = "joined") -> tuple[StackSpec, ...]:
    """`model`'s stack as the cache groups of layout `lists`: one spec for `joined`, one per block list for
    `separate`."""
    if lists not in LIST_LAYOUTS:
        raise ConfigError(f"lists={lists!r} is not a block-list layout; allowed: {', '.join(LIST_LAYOUTS)}")
    joined = stack_spec(model, form)
    if lists == "joined" or len(joined.lists) == 1:
        return (joined,)
    return tuple(replace(joined, lists=(block_list,)) for block_list in joined.lists)


def stack_spec(model: nn.Module, form: FormArg = None) -> StackSpec:
    """`model`'s block stack: the lists a `form=` mapping declares, else its family entry's, else the generic
    single list."""
    family = find_family(model)
    if family is None or isinstance(form, Mapping):
        return generic_spec(model, form)
    return family_spec(model, family, form)
