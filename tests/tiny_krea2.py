"""A tiny random Krea-2 pipeline in the diffusers layout, built with diffusers' classes (the reference), for tests.

`build_tiny_pipeline(dir)` writes transformer/, vae/ (×4), scheduler/, text_encoder/ (tiny Qwen3-VL), tokenizer/
(word-level, Qwen's template token counts 34/5) and model_index.json, exactly as `diffusers.Krea2Pipeline` saves.
The sizes come from `dicache.models.krea2.tiny`.
"""

from __future__ import annotations

import pathlib
import re

import torch

from dicache.models.krea2.tiny import (
    pipeline_transformer_config,
    pipeline_vae_config,
    randomise_tables_and_norms,
    tiny_text_encoder_config,
)

PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
WORDS = "a red green blue apple fox cat dog face smiling grinning rocket snow sun heart house car tree with in the of"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SELECT_LAYERS = (1, 2, 3)


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

    return transformers.Qwen3VLModel(transformers.Qwen3VLConfig(**tiny_text_encoder_config(vocab_size))).eval()


def tiny_transformer(num_layers: int = 6):
    from diffusers import Krea2Transformer2DModel

    model = Krea2Transformer2DModel(**pipeline_transformer_config(num_layers))
    randomise_tables_and_norms(model, 0.3)  # zero-initialised, they would make every block an identity
    return model.eval()


def tiny_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(**pipeline_vae_config()).eval()


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
