"""Block forms: which arguments of a block call are residual streams, and how the block returns them (pure data).

Two streams have names: `h`, the image (or joint) stream every block updates, and `e`, the text stream. A form lists
the streams a block takes, read from the leading positional arguments in that order or else from the keywords named
in `names`, and the streams it returns: a bare tensor for one output, else a tuple in the listed order. A stream a
block takes but does not return (the text of a cross-attention block) is a constant argument; one it returns but does
not take is an output-only stream, handed from block to block by the model's loop. A returned `e` may be `None`
(SD3's last block keeps no text stream); a returned `h` never is.

`FORMS` declares every form in use; `form_named` turns a label such as `"(h, e) -> (e, h)"` into its form.
`misfit(form, ...)` says why one observed block call does not fit a form (or None), so the hook layer can check the
form against real calls and name the forms that do fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Streams = tuple[torch.Tensor, ...]

H, E = "h", "e"
DEFAULT_NAMES: Mapping[str, str] = {H: "hidden_states", E: "encoder_hidden_states"}
DIFF_STREAMS = (H,)
"""The streams whose Fn residual the dynamic decision reads (the image stream, as cache-dit does)."""


@dataclass(frozen=True)
class BlockForm:
    """`inputs`: the streams a block takes, in positional order; `outputs`: the streams it returns, in order (one:
    a bare tensor). `names`: each stream's keyword parameter name."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    names: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_NAMES), hash=False)

    def __post_init__(self) -> None:
        if H not in self.inputs or H not in self.outputs:
            raise ValueError(f"a block form takes and returns the stream {H!r}: {self.inputs} -> {self.outputs}")

    @property
    def label(self) -> str:
        """`"(h, e) -> (e, h)"`: what `form=` accepts and error messages print."""
        return f"{_tuple_label(self.inputs)} -> {_tuple_label(self.outputs)}"

    def __str__(self) -> str:
        return self.label

    def renamed(self, names: Mapping[str, str]) -> BlockForm:
        """The same form with other keyword names for its streams."""
        return BlockForm(self.inputs, self.outputs, {**self.names, **names})

    # ------------------------------------------------------------------ reading a call
    def read_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """The streams of a call `(args, kwargs)`, as passed (a missing one is absent), and how many leading
        positional arguments they took."""
        values: dict[str, Any] = {}
        taken = 0
        for stream in self.inputs:
            if taken < len(args):
                values[stream] = args[taken]
                taken += 1
            elif self.names[stream] in kwargs:
                values[stream] = kwargs[self.names[stream]]
        return values, taken

    def rebuild_call(self, values: Mapping[str, Any], taken: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call `(args, kwargs)` with its streams replaced by `values` (the positions `read_inputs` found)."""
        positional = tuple(values[s] for s in self.inputs[:taken]) + tuple(args[taken:])
        keywords = dict(kwargs)
        for stream in self.inputs[taken:]:
            if stream in values:
                keywords[self.names[stream]] = values[stream]
        return positional, keywords

    def read_outputs(self, result: Any) -> dict[str, Any] | None:
        """What a block returned, per stream; None when its structure is not this form's."""
        if len(self.outputs) == 1:
            return {self.outputs[0]: result} if isinstance(result, torch.Tensor) else None
        if not isinstance(result, tuple | list) or len(result) != len(self.outputs):
            return None
        return dict(zip(self.outputs, result))

    def pack(self, values: Mapping[str, Any]) -> Any:
        """What a block of this form returns for the stream `values`."""
        if len(self.outputs) == 1:
            return values[self.outputs[0]]
        return tuple(values[s] for s in self.outputs)


def _tuple_label(streams: tuple[str, ...]) -> str:
    return streams[0] if len(streams) == 1 else "(" + ", ".join(streams) + ")"


H_TO_H = BlockForm((H,), (H,))
"""`block(h, ...) -> h`: single-stream blocks (PixArt, Sana, Lumina 2, Krea-2, the single blocks of Chroma)."""
HE_TO_H = BlockForm((H, E), (H,))
"""`block(h, e, ...) -> h`: cross-attention blocks, the text is a constant argument (Wan)."""
HE_TO_HE = BlockForm((H, E), (H, E))
"""`block(h, e, ...) -> (h, e)`: both streams updated, image first (HunyuanVideo, CogVideoX, CogView4, HiDream)."""
HE_TO_EH = BlockForm((H, E), (E, H))
"""`block(h, e, ...) -> (e, h)`: diffusers' MMDiT order (Flux, SD3, Qwen-Image, Chroma's double blocks)."""
H_TO_HE = BlockForm((H,), (H, E))
"""`block(h, ...) -> (h, e)`: a block that also emits a text stream it does not take."""
H_TO_EH = BlockForm((H,), (E, H))
"""`block(h, ...) -> (e, h)`: as `H_TO_HE`, text first."""

FORMS: dict[str, BlockForm] = {f.label: f for f in (H_TO_H, HE_TO_H, HE_TO_HE, HE_TO_EH, H_TO_HE, H_TO_EH)}
"""Every declared form by its label."""


def SingleStream(name: str = "hidden_states") -> BlockForm:  # noqa: N802 (kept as the historic constructor name)
    """`h -> h` with the image stream's keyword named `name`."""
    return H_TO_H.renamed({H: name})


def DualStream(names: tuple[str, str] = ("hidden_states", "encoder_hidden_states")) -> BlockForm:  # noqa: N802
    """`(h, e) -> (h, e)` with the streams' keywords named `names`."""
    return HE_TO_HE.renamed({H: names[0], E: names[1]})


def form_named(value: BlockForm | str, field_name: str = "form") -> BlockForm:
    """A form, or the form a label names; else a `ValueError` that lists the labels."""
    if isinstance(value, BlockForm):
        return value
    if isinstance(value, str) and value.strip() in FORMS:
        return FORMS[value.strip()]
    raise ValueError(
        f"{field_name}={value!r} is not a block form; allowed: a dicache.adapters.BlockForm or one of "
        + ", ".join(repr(label) for label in FORMS)
    )


# ---------------------------------------------------------------------- checking a form against an observed call
def describe(value: Any) -> str:
    """A short description of a block argument or result for messages: `Tensor[1, 16, 32]`, `(None, Tensor[...])`."""
    if isinstance(value, torch.Tensor):
        return "Tensor[" + ", ".join(str(d) for d in value.shape) + "]"
    if isinstance(value, tuple | list):
        inner = ", ".join(describe(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return "None" if value is None else type(value).__name__


def misfit(
    form: BlockForm,
    args: tuple,
    kwargs: Mapping[str, Any],
    result: Any,
    before: Mapping[str, Any] | None = None,
    following: Mapping[str, Any] | None = None,
) -> str | None:
    """Why the block call `(args, kwargs) -> result` does not fit `form`, or None when it does.

    before: the streams as they stood before this block (for an output-only stream, the previous block's value).
    following: the streams the model passed to the next block, read with `form` (None: not known). A returned stream
        that the model hands on under the other stream's name means the form has the output order wrong.
    """
    inputs, _ = form.read_inputs(args, kwargs)
    for stream in form.inputs:
        value = inputs.get(stream)
        if not isinstance(value, torch.Tensor):
            passed = describe(value) if stream in inputs else "none"
            return f"it takes argument {form.names[stream]!r} as a tensor, and the call passed {passed}"
    outputs = form.read_outputs(result)
    if outputs is None:
        return f"it returns {_expected(form)}, and the block returned {describe(result)}"
    for stream, value in outputs.items():
        if value is None and stream != H:
            continue
        if not isinstance(value, torch.Tensor):
            return f"it returns {stream!r} as a tensor, and the block returned {describe(value)} there"
        reference = inputs.get(stream, (before or {}).get(stream))
        if isinstance(reference, torch.Tensor) and reference.shape != value.shape:
            return (
                f"the block returned {describe(value)} as {stream!r}, whose input was {describe(reference)} "
                "(a stream keeps its shape through a block)"
            )
    if following is not None:
        for stream, value in outputs.items():
            passed = following.get(stream)
            if passed is value or passed is None:
                continue
            swapped = [other for other, out in outputs.items() if other != stream and out is passed]
            if swapped:
                return (
                    f"the model passed the block's returned {swapped[0]!r} to the next block as {stream!r} "
                    "(the form has the order of what blocks return wrong)"
                )
    return None


def _expected(form: BlockForm) -> str:
    if len(form.outputs) == 1:
        return "one tensor"
    return f"a tuple ({', '.join(form.outputs)})"


def fitting_forms(
    names: Mapping[str, str],
    args: tuple,
    kwargs: Mapping[str, Any],
    result: Any,
    before: Mapping[str, Any] | None = None,
    following_call: tuple[tuple, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Labels of the declared forms (with the keyword `names`) the observed call fits, those reading more streams
    first; `following_call` is the next block's `(args, kwargs)` when known."""
    labels = []
    ranked = sorted(FORMS.items(), key=lambda item: (-len(item[1].inputs), -len(item[1].outputs)))
    for label, declared in ranked:
        form = declared.renamed(names)
        following = form.read_inputs(*following_call)[0] if following_call is not None else None
        if misfit(form, args, kwargs, result, before, following) is None:
            labels.append(label)
    return labels
