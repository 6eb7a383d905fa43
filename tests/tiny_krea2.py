"""A tiny random Krea-2 pipeline in the diffusers layout, built with diffusers' classes (the reference), for tests.

`save_tiny_pipeline(dir)` writes transformer/, vae/ (×4), scheduler/, text_encoder/ (tiny Qwen3-VL), tokenizer/
(word-level, Qwen's template token counts 34/5) and model_index.json, exactly as `diffusers.Krea2Pipeline` saves.
"""

from __future__ import annotations

import pathlib
import re

import torch

PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
WORDS = "a red green blue apple fox cat dog face smiling grinning rocket snow sun heart house car tree with in the of"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SELECT_LAYERS = (1, 2, 3)
TEXT_DIM = 32

NATIVE_CONFIG = dict(
    in_channels=16,
    num_layers=4,
    attention_head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    timestep_embed_dim=32,
    text_hidden_dim=32,
    num_text_layers=2,
    text_num_attention_heads=2,
    text_num_key_value_heads=2,
    text_intermediate_size=64,
    num_layerwise_text_blocks=1,
    num_refiner_text_blocks=1,
    axes_dims_rope=(4, 6, 6),
)
"""A tiny native `Krea2Transformer` config (4 blocks, GQA 2) for tests that build the model directly."""


def random_native_model(config: dict = NATIVE_CONFIG, seed: int = 0, std: float = 0.2):
    """A native `Krea2Transformer(**config)` in eval mode, seeded, with its zero-initialised modulation tables and norm
    weights drawn from N(0, std) so that no block is an identity."""
    from dicache.models.krea2 import Krea2Transformer

    torch.manual_seed(seed)
    model = Krea2Transformer(**config).eval()
    randomise_tables_and_norms(model, std)
    return model


def randomise_tables_and_norms(model: torch.nn.Module, std: float) -> None:
    """Draw the `scale_shift_table` and norm parameters of `model` from N(0, std) in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "scale_shift_table" in name or "norm" in name:
                p.normal_(0, std)


def tiny_tokenizer(directory: pathlib.Path):
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    text = PREFIX + SUFFIX + WORDS
    words = sorted(set(re.findall(r"[^\W_]+|[^\w\s<|>]", text)) | set(text.replace("\n", " ").split()))
    vocab = {t: i for i, t in enumerate(dict.fromkeys([*SPECIAL, "[UNK]", "\n", *words]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[ \t]+"), "removed"),
            pre_tokenizers.Split("\n", "isolated"),
            pre_tokenizers.Punctuation("isolated"),
        ]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIAL[0], unk_token="[UNK]", additional_special_tokens=SPECIAL[1:]
    )
    fast.save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


def tiny_text_encoder(vocab_size: int):
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TEXT_DIM,
            patch_size=4,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
    )
    return transformers.Qwen3VLModel(config).eval()


def tiny_transformer(num_layers: int = 6):
    from diffusers import Krea2Transformer2DModel

    model = Krea2Transformer2DModel(
        in_channels=64,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        timestep_embed_dim=32,
        text_hidden_dim=TEXT_DIM,
        num_text_layers=len(SELECT_LAYERS),
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=64,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6),
    )
    randomise_tables_and_norms(model, 0.3)  # zero-initialised, they would make every block an identity
    return model.eval()


def tiny_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
        latents_mean=[0.1 * i for i in range(16)],
        latents_std=[1.0 + 0.05 * i for i in range(16)],
    ).eval()


def build_tiny_pipeline(directory: pathlib.Path, distilled: bool = False, seed: int = 0, num_layers: int = 6):
    """Build and save a tiny random diffusers `Krea2Pipeline`; returns the diffusers pipeline object."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    torch.manual_seed(seed)
    directory = pathlib.Path(directory)
    tokenizer = tiny_tokenizer(directory / "_tok")
    pipe = Krea2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400
        ),
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        transformer=tiny_transformer(num_layers),
        text_encoder_select_layers=SELECT_LAYERS,
        is_distilled=distilled,
    )
    pipe.save_pretrained(directory, max_shard_size="200KB")
    pipe.set_progress_bar_config(disable=True)
    return pipe
