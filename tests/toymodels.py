"""Small block-stack models for engine tests (no Krea-2 code involved)."""

from __future__ import annotations

import torch
from torch import nn


class ToyBlock(nn.Module):
    """`h + tanh(W h + b) * (1 + t)`: a residual block whose output drifts smoothly with the timestep."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return hidden_states + torch.tanh(self.proj(hidden_states)) * (1 + temb)


class LinearInTimeBlock(nn.Module):
    """`h + t · c`: its residual is linear in the timestep, so a stack of them has a middle residual linear in t."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c = nn.Parameter(torch.randn(dim))

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return hidden_states + temb * self.c


class ScaleBlock(nn.Module):
    """`h · (1 + k)`, `k` a scalar: a stack of them has a middle residual proportional to its input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.k = nn.Parameter(0.3 * torch.randn(()))

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return hidden_states * (1 + self.k)


class ToyTransformer(nn.Module):
    """`forward(hidden_states, timestep)` with a `blocks` ModuleList looped in the usual way."""

    def __init__(self, num_blocks: int = 6, dim: int = 16, block: type[nn.Module] = ToyBlock) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([block(dim) for _ in range(num_blocks)])
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = timestep.reshape(-1, 1, 1).to(hidden_states.dtype)
        h = self.proj_in(hidden_states)
        for block in self.blocks:
            h = block(h, temb)
        return self.proj_out(h)


class SeamTransformer(ToyTransformer):
    """Runs its stack through a `run_blocks` seam, like the native Krea-2 transformer."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = timestep.reshape(-1, 1, 1).to(hidden_states.dtype)
        return self.proj_out(self.run_blocks(self.proj_in(hidden_states), temb))

    def run_blocks(self, hidden_states: torch.Tensor, *block_args) -> torch.Tensor:
        for block in self.blocks:
            hidden_states = block(hidden_states, *block_args)
        return hidden_states


class DualBlock(nn.Module):
    """`(h, e) -> (h', e')`: two streams updated together."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ph = nn.Linear(dim, dim)
        self.pe = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, e: torch.Tensor, temb: torch.Tensor):
        mix = torch.tanh(self.ph(h) + self.pe(e).mean(1, keepdim=True)) * (1 + temb)
        return h + mix, e + torch.tanh(self.pe(e)) * temb


class DualTransformer(nn.Module):
    def __init__(self, num_blocks: int = 5, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DualBlock(dim) for _ in range(num_blocks)])

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        temb = timestep.reshape(-1, 1, 1)
        h, e = hidden_states, encoder_hidden_states
        for block in self.blocks:
            h, e = block(h, e, temb)
        return h


def timesteps(num_steps: int) -> list[float]:
    """Decreasing timesteps in (0, 1], like a flow-matching schedule."""
    return [1.0 - i / num_steps for i in range(num_steps)]


def sample(model: nn.Module, x: torch.Tensor, num_steps: int, branches: int = 1) -> list[torch.Tensor]:
    """Call `model` `branches` times per step (CFG-like), feeding an Euler-like update; return every output."""
    outputs = []
    for t in timesteps(num_steps):
        v = None
        for k in range(branches):
            out = model(x + 0.1 * k, torch.tensor([t]))
            outputs.append(out)
            v = out if v is None else v + 0.5 * (out - v)
        x = x - 0.05 * v
    return outputs


class FormBlock(nn.Module):
    """One toy block per declared form: takes `h` (and `e` when the form does) and returns what the form says.

    Residual updates that drift with `temb`, so a cache has something to skip; `e` (when returned but not taken) is
    computed from `h`. `none_e=True` returns `None` for `e` (as SD3's last block does).
    """

    def __init__(self, dim: int, inputs: tuple[str, ...], outputs: tuple[str, ...], none_e: bool = False) -> None:
        super().__init__()
        self.inputs, self.outputs, self.none_e = inputs, outputs, none_e
        self.ph = nn.Linear(dim, dim)
        self.pe = nn.Linear(dim, dim)

    def forward(self, hidden_states, *args, temb=None):
        e = args[0] if "e" in self.inputs else None
        context = self.pe(e).mean(1, keepdim=True) if e is not None else 0.0
        h = hidden_states + torch.tanh(self.ph(hidden_states) + context) * (1 + temb)
        if self.outputs == ("h",):
            return h
        new_e = e + torch.tanh(self.pe(e)) * temb if e is not None else torch.tanh(self.pe(hidden_states[:, :3]))
        if self.none_e:
            new_e = None
        return (h, new_e) if self.outputs == ("h", "e") else (new_e, h)


class FormTransformer(nn.Module):
    """A stack of `FormBlock`s looped the diffusers way: `h` (and `e`) handed from block to block as returned."""

    def __init__(self, inputs, outputs, num_blocks: int = 5, dim: int = 8, none_last: bool = False) -> None:
        super().__init__()
        self.inputs, self.outputs = inputs, outputs
        self.blocks = nn.ModuleList(
            [FormBlock(dim, inputs, outputs, none_e=none_last and i == num_blocks - 1) for i in range(num_blocks)]
        )

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        temb = timestep.reshape(-1, 1, 1)
        h, e = hidden_states, encoder_hidden_states
        for block in self.blocks:
            args = (h, e) if "e" in self.inputs else (h,)
            out = block(*args, temb=temb)
            if self.outputs == ("h",):
                h = out
            elif self.outputs == ("h", "e"):
                h, e = out
            else:
                e, h = out
        return h


class TwoListTransformer(nn.Module):
    """Chroma-like: dual-stream blocks `(h, e) -> (e, h)`, then the model joins `[e, h]` for single-stream blocks
    `h -> h`, and adds a per-block residual (like ControlNet) after each dual block when `extra` is given."""

    def __init__(self, num_dual: int = 2, num_single: int = 3, dim: int = 8) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList([FormBlock(dim, ("h", "e"), ("e", "h")) for _ in range(num_dual)])
        self.single_transformer_blocks = nn.ModuleList([FormBlock(dim, ("h",), ("h",)) for _ in range(num_single)])

    def forward(self, hidden_states, encoder_hidden_states, timestep, extra=None):
        temb = timestep.reshape(-1, 1, 1)
        h, e = hidden_states, encoder_hidden_states
        for index, block in enumerate(self.transformer_blocks):
            e, h = block(h, e, temb=temb)
            if extra is not None:
                h = h + extra[index]
        joint = torch.cat([e, h], dim=1)
        for block in self.single_transformer_blocks:
            joint = block(joint, temb=temb)
        return joint[:, e.shape[1] :]
