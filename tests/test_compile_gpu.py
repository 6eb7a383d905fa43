"""`pipe.compile()` on a CUDA GPU with inductor: the compiled VAE decoder gives the eager decoder's images within
rounding, and a second call at the same size compiles nothing. Run on the GPU machine: `pytest -m gpu`."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dicache.models.krea2 import Krea2Pipeline

pytestmark = pytest.mark.gpu


def test_inductor_compiled_vae_decoder_matches_eager_and_reuses_its_graph():
    torch._dynamo.reset()
    pipe = Krea2Pipeline.from_pretrained(device="cuda")
    latents = torch.randn(1, pipe.vae.z_dim, 32, 32, device="cuda")
    with torch.no_grad():
        eager = pipe.vae.decode(latents).float()
        pipe.compile(vae=True)
        compiled = pipe.vae.decode(latents).float()
        graphs = counters["stats"]["unique_graphs"]
        again = pipe.vae.decode(latents).float()
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(compiled, again)
    mse = (compiled - eager).pow(2).mean().item()
    assert 10 * torch.log10(torch.tensor(4.0 / max(mse, 1e-20))).item() > 40  # images in [-1, 1]: peak-to-peak 2
    torch._dynamo.reset()
