"""The server's staged generations (`dicache.server.stages`, `PipelineBackend`): the encode, denoise and decode
phases on threads of their own give the very bytes the pipeline gives in one thread, alone or with other requests
in flight; each phase always runs on its own thread; the answer's JSON is built off the event loop, unchanged."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dicache.models.krea2 import Krea2Pipeline
from dicache.server.backend import (
    PipelineBackend,
    can_stage,
    encode_image,
    host_images,
    quantize_pixels,
    to_float_images,
    variant_defaults,
)
from dicache.server.generation import GenerationSpec
from dicache.server.handling import images_json, response_body
from dicache.server.schemas import GenerationInfo, ImageObject, ImagesResponse, Timings
from dicache.server.stages import GenerationStages
from dicache.settings.cache_config import CacheConfig

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

CACHED = CacheConfig.defaults().merged({"enable_cache": True, "max_warmup_steps": 1, "residual_diff_threshold": 0.8})


def spec(prompt: str, seed: int, guidance: float = 1.0, steps: int = 3, cache: CacheConfig = CACHED, n: int = 1):
    return GenerationSpec(
        prompt=prompt,
        negative_prompt=None,
        n=n,
        width=32,
        height=32,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        cache=cache,
        variant="raw",
    )


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def pipe(request):
    """The embedded checkpoint on the CPU, and on a CUDA GPU where there is one (`pytest -m gpu`): there each phase
    runs on a CUDA stream of its own, so the byte checks also show that no phase reads another's unfinished work."""
    return Krea2Pipeline.from_pretrained(device=request.param)


def backend_of(pipe, staged: bool) -> PipelineBackend:
    return PipelineBackend(pipe, CACHED, variant_defaults(pipe, "raw", (32, 32)), staged=staged)


def outputs(result) -> list:
    return [result.images_b64, result.sha256, result.stats.to_dict()]


def test_staged_generation_gives_the_bytes_of_the_pipeline_call(pipe):
    """Caching off: the staged backend's PNG and fingerprint equal those of `pipe(...)` in one thread (the path
    the server used before the phases), whatever stream or thread each phase ran on."""
    request = spec("a red fox", 3, guidance=2.0, cache=CacheConfig.defaults(), n=2)
    backend = backend_of(pipe, staged=True)
    try:
        result = backend.generate(request)
    finally:
        backend.close()
    images = pipe(
        prompt=request.prompt,
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=2.0,
        seed=3,
        num_images_per_prompt=2,
        output_type="np",
        variant="raw",
    ).images
    floats = to_float_images(images)
    assert result.sha256 == [hashlib.sha256(image.tobytes()).hexdigest() for image in floats]
    assert [base64.b64decode(b) for b in result.images_b64] == [encode_image(image) for image in floats]


def test_staged_and_unstaged_backends_agree_under_concurrency(pipe):
    """With the cache on, several requests in flight through the staged backend (three caller threads) give the
    bytes and cache statistics each gets alone through the unstaged one; the denoise phase ran on one thread."""
    requests = [spec("a red fox", 1), spec("a blue car in the snow", 2, guidance=3.0), spec("a cat", 5, steps=4)]
    unstaged = backend_of(pipe, staged=False)
    try:
        alone = [outputs(unstaged.generate(r)) for r in requests]
    finally:
        unstaged.close()
    staged = backend_of(pipe, staged=True)
    threads: set[str] = set()
    denoise = pipe.run_denoise

    def recording_denoise(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return denoise(*args, **kwargs)

    pipe.run_denoise = recording_denoise
    try:
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda r: outputs(staged.generate(r)), requests * 2))
    finally:
        del pipe.run_denoise
        staged.close()
    assert together == alone * 2
    assert len(threads) == 1 and threads.pop().startswith("dicache-denoise")


def test_a_phase_sees_the_callers_context_and_raises_its_errors():
    import contextvars

    marker = contextvars.ContextVar("marker", default="unset")
    stages = GenerationStages("cpu")
    try:
        marker.set("caller")
        assert stages.run("encode", lambda: (marker.get(), torch.is_inference_mode_enabled())) == ("caller", True)
        assert stages.thread_of("encode").name.startswith("dicache-encode")
        with pytest.raises(ZeroDivisionError):
            stages.run("decode", lambda: 1 / 0)
        with pytest.raises(ValueError, match="phase='paint' is invalid: must be one of encode, denoise, decode"):
            stages.run("paint", print)
    finally:
        stages.close()
    with pytest.raises(RuntimeError, match="closed"):
        stages.run("encode", print)


def test_offloaded_or_split_pipelines_are_not_staged(pipe):
    assert can_stage(pipe)
    pipe.offload = object()
    try:
        assert not can_stage(pipe)
    finally:
        pipe.offload = None
    pipe.transformer.parallel_layout = object()
    try:
        assert not can_stage(pipe)
    finally:
        del pipe.transformer.parallel_layout


def test_compile_settings_reach_other_threads(pipe):
    """torch.compile's recompile limit is per thread from torch 2.12 on: `apply_compile_settings` raises it in the
    thread that runs the compiled blocks."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    seen = {}
    pipe.transformer.recompile_limit = 4 * len(pipe.transformer.transformer_blocks)
    try:

        def in_thread():
            pipe.transformer.apply_compile_settings()
            seen["limit"] = getattr(config, name)

        thread = threading.Thread(target=in_thread)
        thread.start()
        thread.join()
    finally:
        del pipe.transformer.recompile_limit
    assert seen["limit"] >= 40


def test_pixels_quantised_on_the_device_equal_the_host_arithmetic():
    values = torch.rand(2, 3, 17, 19)
    values[0, 0, 0, :6] = torch.tensor([0.0, 1.0, 0.5 / 255, 1.5 / 255, 254.5 / 255, 1e-9])  # ties and edges
    floats, pixels = host_images(values)
    assert floats.dtype == np.float32 and floats.shape == (2, 17, 19, 3) and floats.flags["C_CONTIGUOUS"]
    assert np.array_equal(floats, values.permute(0, 2, 3, 1).numpy())
    assert np.array_equal(pixels, quantize_pixels(floats))
    assert np.array_equal(pixels, quantize_pixels(values.permute(0, 2, 3, 1)).numpy())


def test_the_prebuilt_answer_is_the_models_json():
    images, digests = ["iVBORw0KGgo+/A==", "QUJD"], ["ab" * 32, "cd" * 32]
    info = GenerationInfo(
        model="krea-2", variant="raw", width=32, height=32, n=2, num_inference_steps=3, guidance_scale=1.0, seed=1,
        enable_cache=True, cache_overrides={"data": []},
    )  # fmt: skip
    fields = dict(created=1, size="32x32", generation=info, timings=Timings(queued_s=0.1, generate_s=0.2))
    full = ImagesResponse(data=[ImageObject(b64_json=b, sha256=h) for b, h in zip(images, digests)], **fields)
    built = response_body(ImagesResponse(data=[], **fields), images_json(images, digests))
    assert json.loads(built) == json.loads(full.model_dump_json())
    for unsafe in ('a"b', "a\\b", "a\nb", "a\x01b", "aéb", "a?b"):
        with pytest.raises(ValueError, match="base64 and hex digests only"):
            images_json([unsafe], ["00"])
        with pytest.raises(ValueError, match="base64 and hex digests only"):
            images_json(["QUJD"], [unsafe])
    assert images_json([], []) == b"[]" and json.loads(images_json([""], ["00"])) == [{"b64_json": "", "sha256": "00"}]


def test_serve_runs_two_requests_at_once_unless_offloaded():
    from dicache.cli import build_parser
    from dicache.commands.memory import offload_settings
    from dicache.commands.serve_args import settings_from_args
    from dicache.errors import ConfigError

    def parsed(*options):
        return build_parser().parse_args(["serve", *options])

    assert settings_from_args(parsed()).workers == 2 and settings_from_args(parsed("--workers", "3")).workers == 3
    offloaded = parsed("--dit-cpu-offload")
    workers = settings_from_args(offloaded).workers
    assert workers == 1 and offload_settings(offloaded, workers=workers).any  # accepted: one at a time
    explicit = parsed("--dit-cpu-offload", "--workers", "2")
    with pytest.raises(ConfigError, match="--workers 2 is invalid with the memory options"):
        offload_settings(explicit, workers=settings_from_args(explicit).workers)


def test_prepared_text_lengths_run_on_cuda_in_the_denoise_thread_and_change_no_bytes(pipe):
    """On CUDA the staged backend meets every prompt length's attention plan on its denoise thread (where requests
    will meet them), one length per plan;
    elsewhere, and unstaged, it does nothing. Either way a request's bytes stay those of an unprepared backend."""
    request = spec("an owl at night", 3, cache=CacheConfig.defaults())
    backend = backend_of(pipe, staged=True)
    try:
        before = backend.generate(request)
        threads = []
        block = pipe.transformer.transformer_blocks[0]
        handle = block.register_forward_pre_hook(lambda *_: threads.append(threading.current_thread()))
        try:
            prepared = backend.prepare_text_lengths()
        finally:
            handle.remove()
        after = backend.generate(request)
        if pipe.device.type == "cuda":
            plans = set(pipe.attention_plan_lengths(32, 32).values())  # one length met per attention plan
            assert prepared["lengths"] == len(plans) == len(threads) and len(plans) < len(pipe.text_lengths())
            assert prepared["prompt_lengths"] == len(pipe.text_lengths())
            assert set(threads) == {backend.stages().thread_of("denoise")}
        else:
            assert prepared == {} and threads == []
        assert outputs(after) == outputs(before)
    finally:
        backend.close()
    unstaged = backend_of(pipe, staged=False)
    try:
        assert unstaged.prepare_text_lengths() == {}
    finally:
        unstaged.close()


def test_the_denoise_stream_outranks_the_others_on_cuda(pipe):
    """On CUDA each phase has its own stream and the denoising loop's has the higher priority (so overlapping
    requests' encoding and decoding fit around it); off CUDA there are no streams."""
    from dicache.server.stages import PHASES, GenerationStages

    stages = GenerationStages(pipe.device)
    try:
        streams = stages._streams
        if pipe.device.type != "cuda":
            assert set(streams) == set(PHASES) and all(s is None for s in streams.values())
            return
        assert len({id(s) for s in streams.values()}) == len(PHASES)
        assert streams["denoise"].priority < streams["encode"].priority == streams["decode"].priority == 0
    finally:
        stages.close()
