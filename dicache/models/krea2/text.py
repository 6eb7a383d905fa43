"""Krea-2 text conditioning: Qwen chat-template tokenization + 12 tapped Qwen3-VL hidden states per token.

Layout of one prompt (`max_sequence_length` = L, 512 by default), the same as diffusers' `Krea2Pipeline`:

    [ system prefix | user prompt | PAD ... | assistant suffix ]     (prefix dropped from the outputs)
                    |<------------------ L tokens ------------------>|

The prompt is truncated/padded so that prompt + padding + suffix is exactly L tokens. Padding sits *before* the suffix,
and position ids count real tokens only (padding does not advance the rotary position), as at training time. The
encoder's hidden states at `select_layers` (indices into `hidden_states`, 0 = embedding output) are stacked per token.

The prefix and suffix token counts are measured with the tokenizer (34 and 5 for Qwen's tokenizer), not hard-coded.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import threading
from collections.abc import Callable

import torch

from dicache.models.loading import (
    CheckpointError,
    check_load_format,
    default_dtype,
    hidden_packages,
    read_json,
    resolve_component_dir,
)
from dicache.models.static_graphs import StaticGraphs
from dicache.quantization.fp8_storage import compile_stored_linears

KREA2_PROMPT_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
KREA2_PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
# Hidden-state taps of Qwen3-VL-4B (36 layers) used by Krea-2; diffusers' default when model_index.json has none.
KREA2_SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
CUDA_GRAPH_ATTENTION = ("sdpa", "eager")
"""transformers attention implementations the encoder can be captured with: their masks are built in
`Krea2TextEncoder._attention_mask` (flash attention unpads with host synchronisations)."""


class Krea2TextEncoder:
    """Turns prompts into Krea-2's text conditioning.

    `tokenizer`: a Hugging Face tokenizer knowing `<|im_start|>`/`<|im_end|>` and with a pad token. `text_encoder`:
    a `transformers.Qwen3VLModel` (any module with its call signature and `output_hidden_states` support).
    """

    def __init__(
        self,
        tokenizer,
        text_encoder: torch.nn.Module,
        select_layers: tuple[int, ...] | list[int] = KREA2_SELECT_LAYERS,
        max_sequence_length: int = 512,
    ):
        self.tokenizer = tokenizer
        # A fast tokenizer keeps its padding/truncation mode in shared state that every call resets: concurrent
        # requests (server workers) would pad each other's prompts. One call at a time.
        self._tokenizer_lock = threading.Lock()
        self.text_encoder = text_encoder
        self._graphs: StaticGraphs | None = None
        self.select_layers = tuple(int(i) for i in select_layers)
        self.max_sequence_length = int(max_sequence_length)
        self.prefix_len, self.suffix_len = template_token_counts(tokenizer)
        if self.max_sequence_length <= self.suffix_len:
            raise ValueError(
                f"max_sequence_length={max_sequence_length} leaves no room for a prompt: the assistant suffix alone "
                f"takes {self.suffix_len} tokens"
            )
        num_hidden_layers = _text_config(text_encoder).num_hidden_layers
        bad = [i for i in self.select_layers if not 0 <= i <= num_hidden_layers]
        if not self.select_layers or bad:
            raise ValueError(
                f"select_layers={list(self.select_layers)}: need at least one index, each in [0, {num_hidden_layers}] "
                f"(0 = embeddings, i = output of decoder layer i, the last after the final norm); out of range: {bad}"
            )

    @property
    def num_layers(self) -> int:
        """Number of tapped hidden states per token (12 for Krea-2)."""
        return len(self.select_layers)

    @property
    def hidden_size(self) -> int:
        return _text_config(self.text_encoder).hidden_size

    @property
    def text_config(self):
        """The language model's config (a multimodal model's `text_config`): `num_hidden_layers`, `hidden_size`,
        `intermediate_size`, as memory planning reads them."""
        return _text_config(self.text_encoder)

    @property
    def device(self) -> torch.device:
        return next(self.text_encoder.parameters()).device

    def tokenize(self, prompts: str | list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and bool mask of the full template, prefix included: both `(B, prefix_len + L)`, on CPU."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        with self._tokenizer_lock:
            return self._tokenize_locked(prompts)

    def _tokenize_locked(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        body = self.tokenizer(
            [KREA2_PROMPT_PREFIX + p for p in prompts],
            truncation=True,
            padding="max_length",
            padding_side="right",
            max_length=self.prefix_len + self.max_sequence_length - self.suffix_len,
            return_tensors="pt",
        )
        suffix = self.tokenizer([KREA2_PROMPT_SUFFIX] * len(prompts), return_tensors="pt")
        input_ids = torch.cat([body.input_ids, suffix.input_ids], dim=1)
        mask = torch.cat([body.attention_mask, suffix.attention_mask], dim=1).bool()
        return input_ids, mask

    def num_valid_tokens(self, prompts: str | list[str]) -> list[int]:
        """Real (non-padding) text tokens per prompt in the encoder output, suffix included; no model call."""
        _, mask = self.tokenize(prompts)
        return mask[:, self.prefix_len :].sum(dim=1).tolist()

    @torch.no_grad()
    def encode(self, prompts: str | list[str], mask_on_host: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> `(hidden_states (B, L, num_layers, D), mask (B, L) bool)` on the encoder's device and dtype
        (`mask_on_host`: the mask on the CPU, as tokenizing made it, which reading costs no device synchronisation).

        Identical to diffusers' `Krea2Pipeline.get_text_hidden_states(prompts, L)`. Padded positions hold encoder
        outputs too; `mask` marks the real tokens (prompt, then the suffix after the padding). With CUDA graphs on
        (`use_cuda_graphs`) the forward is replayed from a graph: the same values, without the kernel launches.
        """
        input_ids, host_mask = self.tokenize(prompts)
        input_ids, mask = input_ids.to(self.device), host_mask.to(self.device)
        forward = self._graphs if self._graphs is not None else self.tapped_hidden_states
        return forward(input_ids, mask), (host_mask if mask_on_host else mask)[:, self.prefix_len :]

    def tapped_hidden_states(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Token ids `(B, T)` and bool mask `(B, T)` of the full template (`tokenize`, on the encoder's device) ->
        the tapped hidden states `(B, T - prefix_len, num_layers, D)`. No host synchronisation: capturable."""
        # Positions count real tokens only, shared by the three mRoPE axes (text has t = h = w).
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        outputs = self.text_encoder(
            input_ids=input_ids,
            attention_mask=self._attention_mask(mask),
            position_ids=positions.unsqueeze(0).expand(3, -1, -1),
            output_hidden_states=True,
            use_cache=False,  # one pass, nothing to decode after it: no key/value cache to fill
        )
        hidden_states = torch.stack([outputs.hidden_states[i] for i in self.select_layers], dim=2)
        return hidden_states[:, self.prefix_len :]

    @property
    def _attention_implementation(self) -> str | None:
        """transformers' attention implementation of the encoder (`sdpa`, `eager`, `flash_attention_2`, ...)."""
        return getattr(_text_config(self.text_encoder), "_attn_implementation", None)

    def _attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The `(B, 1, T, T)` causal-and-padding mask transformers would build from `mask` for the encoder's
        attention (bool for SDPA, additive float for eager), built here without its data-dependent checks (they
        synchronise with the host); other attention implementations get `mask` itself."""
        implementation = self._attention_implementation
        if implementation not in CUDA_GRAPH_ATTENTION:
            return mask
        length = mask.shape[-1]
        causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
        allowed = causal[None, None] & mask[:, None, None, :]
        if implementation == "sdpa":
            return allowed
        dtype = self.text_encoder.get_input_embeddings().weight.dtype  # the activations' (never quantised)
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
        return blocked.masked_fill(~allowed, torch.finfo(dtype).min)

    @property
    def cuda_graphs(self) -> bool:
        """Whether `encode` replays CUDA graphs of the forward (on a CUDA device)."""
        return self._graphs is not None

    def compile(self, backend: str | Callable = "inductor") -> int:
        """What `pipe.compile()` does to the encoder: its FP8-stored linears' arithmetic compiled
        (`dicache.quantization.fp8_storage.compile_stored_linears`: on CUDA the e4m3 conversion becomes one pass at
        memory speed) and the forward replayed from CUDA graphs (`use_cuda_graphs`). Same values as eager; returns how
        many linears were compiled (0 unless `--text-encoder-quantization fp8`)."""
        self.use_cuda_graphs()  # first: it refuses an attention it cannot capture before anything changes
        return compile_stored_linears(self.text_encoder, backend)

    def use_cuda_graphs(self, enabled: bool = True, max_graphs: int = 4) -> None:
        """Replay the forward from CUDA graphs, one per batch size (`dicache.models.static_graphs.StaticGraphs`):
        captured on the first CUDA call at each batch size (up to `max_graphs`; more run eagerly), recaptured if the
        weights are replaced (quantised). The values are the eager forward's; a CPU encoder runs eagerly. Needs the
        encoder's attention to be SDPA or eager; do not move the weights between devices (offloading) while on."""
        if not enabled:
            self._graphs = None
            return
        implementation = self._attention_implementation
        if implementation not in CUDA_GRAPH_ATTENTION:
            raise ValueError(
                f"text encoder CUDA graphs: attention implementation {implementation!r} is not supported; "
                f"allowed: {', '.join(CUDA_GRAPH_ATTENTION)}"
            )
        model = self.text_encoder
        self._graphs = StaticGraphs(
            self.tapped_hidden_states,
            weights=lambda: itertools.chain(model.parameters(), model.buffers()),  # FP8-stored weights are buffers
            max_graphs=max_graphs,
        )

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        max_sequence_length: int = 512,
        load_format: str = "auto",
        **hub_kwargs,
    ) -> Krea2TextEncoder:
        """Load `tokenizer/` and `text_encoder/` of a diffusers-layout Krea-2 folder (local or Hub; `hub_kwargs`:
        `cache_dir`, `revision`, `local_files_only`). Select layers come from `model_index.json`
        (`text_encoder_select_layers`), defaulting to `KREA2_SELECT_LAYERS`. dtype: bf16 on CUDA, else fp32.
        `load_format="dummy"`: random weights from `text_encoder/config.json` alone; `"meta"`: the model built on the
        meta device, for weights put into it afterwards (a quantised snapshot, `checkpoints.load_text_encoder`). The
        parts the taps never read are dropped after loading (`drop_untapped_parts`; their count in
        `dropped_parameters`).
        """
        device = torch.device(device if device is not None else "cpu")
        dtype = dtype if dtype is not None else default_dtype(device)
        how = "meta" if load_format == "meta" else check_load_format(load_format)
        # torchao, installed for --quantization, stays unimported: transformers would import it, for an integration
        # that dicache never uses
        with hidden_packages("torchao"):
            # transformers takes about 2 s to import: only loading a text encoder needs it
            from transformers import AutoConfig, AutoTokenizer, Qwen3VLModel

        tokenizer_dir = resolve_component_dir(path_or_repo_id, "tokenizer", **hub_kwargs)
        encoder_dir = resolve_component_dir(path_or_repo_id, "text_encoder", **hub_kwargs)
        index = _read_model_index(path_or_repo_id, tokenizer_dir.parent, hub_kwargs)
        select_layers = index.get("text_encoder_select_layers") or KREA2_SELECT_LAYERS
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            if how != "auto":  # transformers' own random init drawn on the device, or nothing drawn on "meta"
                with torch.device("meta" if how == "meta" else device):
                    text_encoder = Qwen3VLModel._from_config(AutoConfig.from_pretrained(encoder_dir), dtype=dtype)
            else:
                text_encoder = Qwen3VLModel.from_pretrained(encoder_dir, dtype=dtype)
        except (OSError, ValueError) as err:
            raise CheckpointError(
                f"cannot load the Krea-2 tokenizer/text encoder from {path_or_repo_id}: {err}"
            ) from err
        if how != "meta":
            text_encoder = text_encoder.to(device)
        encoder = cls(tokenizer, text_encoder.eval(), select_layers, max_sequence_length)
        encoder.dropped_parameters = drop_untapped_parts(text_encoder, encoder.select_layers)
        return encoder


def drop_untapped_parts(text_encoder: torch.nn.Module, select_layers: tuple[int, ...]) -> int:
    """Remove, in place, what Krea-2's taps never read from a `Qwen3VLModel`: the vision tower (only images use it)
    and, when the last tap is below the final norm, the decoder layers after the last tapped one and the final norm
    (the hidden state of layer i, un-normed, is what tap i reads, with or without the layers after it). Saves their
    memory (Qwen3-VL-4B: the 0.4 B-parameter vision tower and the untapped 36th layer) and the last layer's compute.
    Returns the number of parameters removed; a module without these parts is left as it is."""
    before = sum(p.numel() for p in text_encoder.parameters())
    if isinstance(getattr(text_encoder, "visual", None), torch.nn.Module):
        del text_encoder.visual
    language = getattr(text_encoder, "language_model", None)
    layers = getattr(language, "layers", None)
    last = max(select_layers)
    if isinstance(layers, torch.nn.ModuleList) and last < len(layers):
        del layers[last:]
        language.norm = torch.nn.Identity()  # hidden_states[-1] is the norm's output: now layer `last`'s own
    return before - sum(p.numel() for p in text_encoder.parameters())


def template_token_counts(tokenizer) -> tuple[int, int]:
    """`(prefix, suffix)` token counts of the Krea-2 template under `tokenizer`, each tokenized alone exactly as in
    `Krea2TextEncoder.tokenize` (Qwen's tokenizer: 34 and 5)."""
    return len(tokenizer(KREA2_PROMPT_PREFIX).input_ids), len(tokenizer(KREA2_PROMPT_SUFFIX).input_ids)


def _text_config(text_encoder: torch.nn.Module):
    config = text_encoder.config
    return getattr(config, "text_config", config)


def _read_model_index(path_or_repo_id: str | os.PathLike, root: pathlib.Path, hub_kwargs: dict) -> dict:
    """`model_index.json` of the pipeline folder, or `{}` if it has none."""
    if (root / "model_index.json").is_file():
        return read_json(root, "model_index.json")
    if pathlib.Path(os.path.expanduser(os.fspath(path_or_repo_id))).is_dir():
        return {}
    # A Hub snapshot resolved per subfolder does not include the top-level file: fetch it alone.
    # huggingface_hub's download client takes about 0.5 s to import: only a Hub id needs it
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        file = hf_hub_download(
            os.fspath(path_or_repo_id),
            "model_index.json",
            cache_dir=hub_kwargs.get("cache_dir"),
            revision=hub_kwargs.get("revision"),
            local_files_only=bool(hub_kwargs.get("local_files_only")),
        )
    except EntryNotFoundError:
        return {}
    except Exception as err:  # huggingface_hub raises many unrelated types; the cause stays chained
        raise CheckpointError(f"cannot fetch model_index.json of {path_or_repo_id}: {err}") from err
    file = pathlib.Path(file)
    return read_json(file.parent, file.name)
