"""Probe: the live-tensor peak of one Qwen-Image VAE decode (Krea-2's decoder, full size, bf16), counted without a
GPU: the decode runs on fake tensors (no compute) under a dispatch mode that adds each new storage's bytes when an
op creates it and removes them when the tensor is freed. Activations only (the weights, 0.05 GB, are real tensors
outside the count). This is what the caching allocator must find on top of the weights while an image decodes;
the server's decode phase runs beside the denoising, so it adds to the serving peak.

    python experiments/probe_vae_memory.py [--sizes 512 1024] [--results benchmarks/RESULTS.md]

Both RMSNorm forms are measured: the decoder's (row chunks) and the one it replaced (one float32 copy of the whole
input).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import weakref

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # publish, bench_*

from publish import command_line, publish  # noqa: E402

from dicache.models.krea2 import vae  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it and still alive (`live`), and their maximum (`peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._seen:  # a view of a storage already counted
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._freed, key, storage.nbytes())
        return out


def decode_peak_gb(decoder: vae.QwenImageVAEDecoder, side: int) -> float:
    with FakeTensorMode(allow_non_fake_inputs=True):
        latents = torch.randn(1, decoder.z_dim, side // decoder.scale_factor, side // decoder.scale_factor)
        with torch.no_grad(), LiveBytes() as counter:
            decoder.decode(latents.to(torch.bfloat16))
    return round(counter.peak / 1e9, 3)


def one_shot_norm(self: vae.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The decoder's RMSNorm as it was before the row chunks: the whole input widened to float32 at once."""
    normed = F.normalize(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, dim=1).to(x.dtype)
    return normed * self.scale * self.gamma.view(-1, 1, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[512, 1024])
    parser.add_argument("--results", default=None)
    args = parser.parse_args(argv)
    decoder = vae.QwenImageVAEDecoder(vae.QwenImageVAEConfig()).to(torch.bfloat16)
    variants = {"row chunks (dicache)": vae.RMSNorm.forward, "one float32 copy (before)": one_shot_norm}
    rows = []
    for label, forward in variants.items():
        vae.RMSNorm.forward = forward
        for side in args.sizes:
            rows.append({"rmsnorm": label, "size": f"{side}²", "decode_live_peak_GB": decode_peak_gb(decoder, side)})
            print(rows[-1], flush=True)
    lines = [
        f"\n## VAE decode memory (`probe_vae_memory.py`), {datetime.datetime.now():%Y-%m-%d %H:%M}\n",
        f"Command: `{command_line('probe_vae_memory.py', argv, folder='experiments')}`  ",
        "Qwen-Image VAE decoder (Krea-2's), bf16, one image; live tensors counted on fake tensors (no GPU needed)\n",
        "| rmsnorm | size | decode_live_peak_GB |",
        "|---|---|---|",
        *[f"| {r['rmsnorm']} | {r['size']} | {r['decode_live_peak_GB']} |" for r in rows],
    ]
    publish("\n".join(lines) + "\n", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
