"""`torch.compile` of the transformer blocks works together with caching: after warm-up no step recompiles."""

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import dicache
from dicache.models.krea2.pipeline import Krea2Pipeline
from dicache.models.krea2.tiny import random_tiny_transformer


def make_pipe():
    pipe = Krea2Pipeline(transformer=random_tiny_transformer())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, steps, scale, valid=5):
    embeds = torch.randn(1, 12, 2, 32, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[:, :valid] = True
    return pipe(
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=embeds * 0.5,
        negative_prompt_embeds_mask=mask,
        height=64,
        width=64,
        num_inference_steps=steps,
        guidance_scale=scale,
        seed=0,
        output_type="latent",
    ).images


def test_compiled_blocks_with_caching_do_not_recompile_after_warmup():
    torch._dynamo.reset()
    pipe = make_pipe()
    config = {"max_warmup_steps": 2, "residual_diff_threshold": 0.5, "enable_taylorseer": True}
    dicache.enable(pipe, config)
    eager = generate(pipe, 10, 3.0)
    eager_stats = dicache.stats(pipe).to_dict()
    counter = CompileCounter()
    for block in pipe.transformer.transformer_blocks:
        block.compile(backend=counter, fullgraph=True)
    compiled = generate(pipe, 10, 3.0)  # warm-up: compiles
    warm = counter.frame_count
    assert warm > 0 and dicache.stats(pipe).cached_calls > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert dicache.stats(pipe).to_dict() == eager_stats  # same decisions compiled and eager
    generate(pipe, 10, 3.0)  # every step of a second request reuses the compiled graphs
    generate(pipe, 7, 3.0)  # another step count, same shapes
    with dicache.request(pipe, config={"scm_preset": "fast", "scm_policy": "static"}):
        generate(pipe, 12, 3.0)  # a static mask: cached steps skip blocks, computed ones reuse the graphs
    assert counter.frame_count == warm
    dicache.disable(pipe)
    torch._dynamo.reset()


def test_compiled_blocks_compile_one_graph_for_every_sequence_length():
    """`compile_blocks()` marks the joint sequence's length symbolic from the first call (issue 41): the blocks
    compile once for every prompt length and image size, where automatic dynamic shapes compiled the first shape
    static and then again, symbolic; `dynamic=False` keeps a graph per shape."""
    torch._dynamo.reset()
    counter = CompileCounter()
    pipe = make_pipe()
    pipe.transformer.compile_blocks(backend=counter)
    generate(pipe, 2, 1.0, valid=5)
    generate(pipe, 2, 1.0, valid=9)  # another prompt length
    rows, cols = 8, 8
    positions = pipe.position_ids(rows, cols, pipe.device)
    pipe.transformer.prepare_text_lengths(positions, range(3, 12))  # other joint lengths, another image size
    assert counter.frame_count == 1
    torch._dynamo.reset()

    static = CompileCounter()
    pipe = make_pipe()
    pipe.transformer.compile_blocks(backend=static, dynamic=False)
    generate(pipe, 2, 1.0, valid=5)
    generate(pipe, 2, 1.0, valid=9)
    assert static.frame_count == 2
    torch._dynamo.reset()
