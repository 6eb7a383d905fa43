"""A word-level tokenizer for the embedded Krea-2-architecture checkpoint.

It stands in for Qwen3-VL's BPE tokenizer at toy scale: the vocabulary is the words of the emoji captions plus the
words of the Krea-2 prompt template, and it splits the template exactly as many tokens as the real one does
(34 for the prefix, 5 for the suffix), so the pipeline's ``prompt_template_encode_start_idx = 34`` and
``prompt_template_encode_num_suffix_tokens = 5`` hold unchanged.

Rules: NFKD + strip accents + lowercase; tokens are ``"\\n"``, runs of ``[a-z0-9]`` and single other non-space
characters; unknown words map to ``<|unk|>``. Special tokens: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>``,
``<|im_end|>``, ``<|unk|>`` and Qwen-VL's vision markers. Saved as a transformers ``PreTrainedTokenizerFast``
(``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``), loadable by ``AutoTokenizer``.

Usage: ``python scripts/build_tiny_tokenizer.py --data data/emoji64.npz --out /tmp/tok``
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path

TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
TEMPLATE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_TOKENS = 34
SUFFIX_TOKENS = 5
PAD, UNK = "<|endoftext|>", "<|unk|>"
SPECIAL_TOKENS = [
    PAD,
    "<|im_start|>",
    "<|im_end|>",
    UNK,
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TOKEN_PATTERN = r"\n|[a-z0-9]+|[^a-z0-9\s]"


def words(text: str) -> list[str]:
    """The pre-tokenizer's split of already-normalised (lowercase ASCII) text, for building the vocabulary."""
    return re.findall(TOKEN_PATTERN, text)


def build_tokenizer(captions: Iterable[str]):
    """A ``PreTrainedTokenizerFast`` whose vocabulary covers ``captions`` and the Krea-2 template."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template = re.sub("|".join(map(re.escape, SPECIAL_TOKENS)), " ", TEMPLATE_PREFIX + TEMPLATE_SUFFIX).lower()
    vocab_words = sorted({w for c in captions for w in words(c.lower())} | set(words(template)))
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for w in vocab_words:
        vocab.setdefault(w, len(vocab))

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(TOKEN_PATTERN), behavior="removed", invert=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL_TOKENS[1:3] + SPECIAL_TOKENS[4:],
        padding_side="right",
        model_max_length=131072,
    )
    check_template_counts(fast)
    return fast


def check_template_counts(tokenizer) -> None:
    """Raise unless the template prefix/suffix tokenize to 34/5 tokens without unknowns (as Qwen3-VL's do)."""
    for text, want in ((TEMPLATE_PREFIX, PREFIX_TOKENS), (TEMPLATE_SUFFIX, SUFFIX_TOKENS)):
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(ids) != want or tokenizer.unk_token_id in ids:
            raise AssertionError(f"template {text!r} tokenizes to {len(ids)} tokens (want {want}): {ids}")


def save_tokenizer(tokenizer, out_dir: str | Path) -> None:
    """Save, then rewrite the config in the portable ``PreTrainedTokenizerFast`` form that transformers 4.57+ and
    5.x both load (5.x would otherwise write its own ``TokenizersBackend`` class name)."""
    tokenizer.save_pretrained(out_dir)
    portable_tokenizer_config(out_dir)


def portable_tokenizer_config(out_dir: str | Path) -> None:
    """Rewrite ``tokenizer_config.json`` / ``special_tokens_map.json`` of a saved tokenizer portably."""
    out_dir = Path(out_dir)
    specials = SPECIAL_TOKENS[1:3] + SPECIAL_TOKENS[4:]
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD,
        "unk_token": UNK,
        "eos_token": "<|im_end|>",
        "additional_special_tokens": specials,
        "padding_side": "right",
        "model_max_length": 131072,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    smap = {k: cfg[k] for k in ("pad_token", "unk_token", "eos_token", "additional_special_tokens")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/emoji64.npz")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    captions = [str(c) for c in np.load(args.data)["captions"]]
    tok = build_tokenizer(captions)
    save_tokenizer(tok, args.out)
    print(f"saved a {len(tok)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
