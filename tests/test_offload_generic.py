"""Offload knows blocks, bytes and the block plan, not Krea-2: a toy pipeline (no Krea-2 code) described by its own
memory glue is planned, streamed and phased by `install_offload`, bitwise equal to the resident run; and the one
`OffloadSettings` a caller builds is the one the installed offload holds."""

import pytest
import torch
from torch import nn
from toymodels import SeamTransformer, sample

from dicache.engine.adapters import generic_spec
from dicache.errors import ConfigError
from dicache.models.krea2.pipeline import Krea2Pipeline
from dicache.offload.packing import module_bytes, packed_bytes
from dicache.offload.pipeline import TRANSFORMER, PipelineMemory, PlannedRequest, install_offload
from dicache.offload.plan import GiB, MemoryNeeds
from dicache.offload.settings import OffloadLimits, OffloadSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_BLOCKS, DIM, STEPS = 6, 16, 5


class ToyPipeline:
    """Encode (a linear), denoise (the seam transformer over a few steps), decode (a linear): three phases."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.encoder, self.transformer, self.decoder = (
            nn.Linear(DIM, DIM),
            SeamTransformer(NUM_BLOCKS, DIM),
            nn.Linear(DIM, DIM),
        )
        self.offload = None

    def encode(self, x):
        return self.encoder(x)

    def denoise(self, x):
        return sample(self.transformer, x, STEPS)[-1]

    def decode(self, x):
        return self.decoder(x)

    def __call__(self, x):
        with torch.no_grad():
            return self.decode(self.denoise(self.encode(x)))


def toy_memory(pipe: ToyPipeline) -> tuple[PipelineMemory, MemoryNeeds]:
    """The toy's memory glue: its stack, its components by role and phase, and its bytes."""
    stack = generic_spec(pipe.transformer)
    memory = PipelineMemory(
        pipeline=pipe,
        transformer=pipe.transformer,
        stack=stack,
        components={"text_encoder": pipe.encoder, "vae": pipe.decoder},
        phases={"encode": ("text_encoder",), "denoise": (TRANSFORMER,), "decode": ("vae",)},
        counted="denoise",
    )
    blocks = tuple(packed_bytes(b) for b in stack.blocks)
    needs = MemoryNeeds(
        block_bytes=blocks,
        other_dit_bytes=module_bytes(pipe.transformer) - sum(module_bytes(b) for b in stack.blocks),
        dit_activation_bytes=0,
        text_encoder_bytes=module_bytes(pipe.encoder),
        vae_bytes=module_bytes(pipe.decoder),
    )
    return memory, needs


def test_a_model_that_is_not_krea2_is_planned_streamed_and_phased():
    x = torch.randn(1, 3, DIM)
    expected = ToyPipeline()(x)
    pipe = ToyPipeline()
    memory, needs = toy_memory(pipe)
    room = needs.other_dit_bytes + 4.5 * max(needs.block_bytes) + needs.vae_bytes  # 2 resident + 2 slots, 1 component
    settings = OffloadSettings(
        dit_layerwise_offload=True, text_encoder_cpu_offload=True, vae_cpu_offload=True, gpu_memory_budget=room / GiB
    )
    request = PlannedRequest(max_pixels=1, max_images=1, cfg=False, cfg_batched=False)
    handle = install_offload(memory, settings, needs, request, torch.device("cpu"), always_run=(0, NUM_BLOCKS - 1))
    assert pipe.offload is handle and handle.settings is settings
    assert handle.plan.resident == (0, NUM_BLOCKS - 1) and handle.plan.num_slots == 2  # the blocks every call runs
    assert torch.equal(pipe(x), expected)
    calls = handle.last_request.calls
    assert len(calls) == STEPS and all(c.ran == list(range(NUM_BLOCKS)) and c.copied == [1, 2, 3, 4] for c in calls)
    per_block = handle.layerwise.packed[1].nbytes
    # nothing says the request ends: the last call also prefetched the next call's first two blocks
    assert handle.last_request.blocks == (4 * STEPS + 2) * per_block
    components = handle.components
    assert set(components.components) == {"text_encoder", "vae"}
    assert components.on_device("vae") and not components.on_device("text_encoder")  # the last phase was decode
    handle.remove()
    assert pipe.offload is None and "denoise" not in pipe.__dict__ and torch.equal(pipe(x), expected)


def test_one_offload_settings_object_travels_to_the_installed_offload(tmp_path):
    from tiny_krea2 import build_tiny_pipeline

    build_tiny_pipeline(tmp_path)
    settings = OffloadSettings(dit_layerwise_offload=True, gpu_memory_budget=1.0)
    limits = OffloadLimits(max_height=32, max_width=32)
    pipe = Krea2Pipeline.from_pretrained(tmp_path, offload_settings=settings, offload_limits=limits)
    assert pipe.offload.settings is settings and pipe.offload.max_pixels == 32 * 32
    by_name = Krea2Pipeline.from_pretrained(
        tmp_path, dit_layerwise_offload=True, gpu_memory_budget=1.0, offload_limits=limits
    )
    assert by_name.offload.settings == settings  # the same options by name build the same settings
    with pytest.raises(ConfigError, match="not both"):
        Krea2Pipeline.from_pretrained(tmp_path, offload_settings=settings, vae_cpu_offload=True)
    with pytest.raises(ConfigError, match=r"OffloadSettings: unknown option 'dit_offload'"):
        Krea2Pipeline(transformer=pipe.transformer).enable_offload(dit_offload=True)
