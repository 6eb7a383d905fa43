"""Speed options users reach: `--compile` / `pipe.compile()` and `--quantization fp8` (plumbing and clear errors on
CPU; FP8 itself runs only on a CUDA GPU with compute capability >= 8.9, see the `gpu` tests)."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dicache.cli import main
from dicache.models.krea2 import Krea2Pipeline
from dicache.quantization import (
    LAYER_GROUPS,
    QuantizationError,
    QuantizationSpec,
    check_fp8_support,
    parse_quantization,
    selected_linears,
)
from dicache.server.backend import PipelineBackend, variant_defaults
from dicache.server.generation import GenerationSpec
from dicache.settings.cache_config import CacheConfig

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def block_linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("transformer_")]


def test_default_fp8_selection_is_the_block_linears_but_the_key_value_and_output_projections():
    from dicache.models.krea2.tiny import random_tiny_transformer

    model = random_tiny_transformer()
    assert selected_linears(model, QuantizationSpec(exclude=())) == block_linears(model)
    assert len(block_linears(model)) == 4 * 8  # 4 blocks x (q, k, v, gate, out, ff gate, ff up, ff down)
    chosen = selected_linears(model, QuantizationSpec())
    kept = {"attn.to_k", "attn.to_v", "attn.to_out.0"}  # q in FP8 since issue 27 (35.4 dB on Raw 28)
    assert chosen == [n for n in block_linears(model) if n.split(".", 2)[2] not in kept]
    assert len(chosen) == 4 * 5
    old_default = selected_linears(model, QuantizationSpec(exclude=("attn_qkv", "attn_out")))
    assert set(chosen) - set(old_default) == {f"transformer_blocks.{i}.attn.to_q" for i in range(4)}


def test_exclusions_by_group_and_glob():
    from dicache.models.krea2.tiny import random_tiny_transformer

    model = random_tiny_transformer()
    spec = QuantizationSpec(exclude=("attn_gate", "last_block", "transformer_blocks.0.ff.*"))
    chosen = selected_linears(model, spec)
    assert not any(n.endswith("attn.to_gate") for n in chosen)
    assert not any(n.startswith("transformer_blocks.3.") for n in chosen)
    assert not any(n.startswith("transformer_blocks.0.ff.") for n in chosen)
    assert "transformer_blocks.0.attn.to_q" in chosen and "transformer_blocks.2.ff.down" in chosen
    assert set(LAYER_GROUPS) >= {"attn_qkv", "attn_gate", "attn_out", "ff_in", "ff_out"}


def test_bad_quantization_inputs_name_the_value():
    from dicache.models.krea2.tiny import random_tiny_transformer

    with pytest.raises(QuantizationError, match="int4.*none, fp8"):
        parse_quantization("int4")
    with pytest.raises(QuantizationError, match="without --quantization"):
        parse_quantization("none", ["attn_gate"])
    assert parse_quantization(None) is None and parse_quantization("none") is None
    with pytest.raises(QuantizationError, match="match no linear.*attn_qkv"):
        selected_linears(random_tiny_transformer(), QuantizationSpec(exclude=("*.to_qq",)))


@pytest.mark.skipif(CUDA_FP8, reason="checks the error where FP8 cannot run")
def test_fp8_on_cpu_is_a_clear_error_not_a_silent_fallback(capsys):
    with pytest.raises(QuantizationError, match="compute capability >= 8.9.*'cpu'"):
        check_fp8_support("cpu")
    with pytest.raises(QuantizationError, match="fp8"):
        Krea2Pipeline.from_pretrained(quantization="fp8")
    code = main(["generate", "red apple", "--variant", "turbo", "--device", "cpu", "--quantization", "fp8"])
    assert code == 2
    assert "quantization='fp8' needs an NVIDIA GPU" in capsys.readouterr().err


def test_cli_rejects_an_unknown_exclusion_before_loading(capsys):
    code = main(["generate", "x", "--device", "cpu", "--quantization-exclude", "attn_gate"])
    assert code == 2 and "without --quantization (fp8, int8, fp8-emulated)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "cache", [{"scm_preset": "fast"}, {"scm_compute_bins": [2, 1, 1, 4], "scm_cache_bins": [1, 3, 1]}], ids=str
)
def test_the_warm_up_runs_under_a_step_mask_profile(cache):
    """A server configured with a step mask (a preset, which needs at least 4 steps, or bins covering 12) warms up
    with it: the cached generations follow the mask, none fails for its step count."""
    pipe = Krea2Pipeline.from_pretrained()
    config = CacheConfig.defaults().merged({"enable_cache": True, **cache})
    backend = PipelineBackend(pipe, config, variant_defaults(pipe, default_size=(32, 32)))
    warm = backend.warm_up()
    assert warm["generations"] == 4 and [run["cache"] for run in warm["runs"]] == [False, True, False, True]
    backend.close()


def _spec(defaults, prompt, variant, seed, enable_cache=True, size=None):
    from dicache.models.krea2.pipeline import PRESETS

    return GenerationSpec(
        prompt=prompt,
        negative_prompt=None,
        n=1,
        width=size or defaults.width,
        height=size or defaults.height,
        num_inference_steps=5,
        guidance_scale=PRESETS[variant].guidance_scale,
        seed=seed,
        cache=CacheConfig.defaults().merged(
            {"enable_cache": enable_cache, "max_warmup_steps": 2, "residual_diff_threshold": 0.5}
        ),
        variant=variant,
    )


def test_compiled_server_warm_up_leaves_nothing_to_compile_for_requests():
    """`dicache serve --compile` warms up at start-up; afterwards Turbo and Raw requests with caching on, other prompt
    lengths and seeds compile nothing, and the images equal the eager pipeline's."""
    torch._dynamo.reset()
    eager_pipe = Krea2Pipeline.from_pretrained()
    eager = PipelineBackend(eager_pipe, CacheConfig(), variant_defaults(eager_pipe, default_size=(64, 64)))
    pipe = Krea2Pipeline.from_pretrained()
    backend = PipelineBackend(pipe, CacheConfig(), variant_defaults(pipe, default_size=(64, 64)))
    pipe.compile(backend="eager")  # dynamo's tracing and guards without inductor's codegen: fast on CPU
    warm = backend.warm_up()  # the server's own warm-up (`WARM_UP_STEPS`)
    assert warm["generations"] == 4 and warm["graphs_compiled"] > 0
    runs = warm["runs"]  # where the warm-up's seconds went, per generation: the first compiles, the rest reuse
    assert [(run["variant"], run["cache"], run["steps"]) for run in runs] == [
        ("turbo", False, PipelineBackend.UNCACHED_WARM_UP_STEPS),
        ("turbo", True, PipelineBackend.WARM_UP_STEPS),
        ("raw", False, PipelineBackend.UNCACHED_WARM_UP_STEPS),
        ("raw", True, PipelineBackend.WARM_UP_STEPS),
    ]
    assert PipelineBackend.UNCACHED_WARM_UP_STEPS < PipelineBackend.WARM_UP_STEPS
    assert runs[0]["graphs_compiled"] > 0 and sum(run["graphs_compiled"] for run in runs) == warm["graphs_compiled"]
    assert all(set(run["phases"]) == {"encode", "denoise", "decode", "image"} for run in runs)
    assert sum(run["seconds"] for run in runs) <= warm["seconds"] + 0.05
    assert warm["compile_time_s"] and all(seconds > 0 for seconds in warm["compile_time_s"].values())
    assert list(warm["compile_time_s"].values()) == sorted(warm["compile_time_s"].values(), reverse=True)
    before = counters["stats"]["unique_graphs"]
    specs = [
        _spec(backend.defaults, "red apple", "turbo", 3),
        _spec(backend.defaults, "grinning face with smiling eyes", "raw", 5),
        _spec(backend.defaults, "a dog", "raw", 1, enable_cache=False),
    ]
    cached = 0
    for spec in specs:
        got = backend.generate(spec)
        ref = eager.generate(spec)
        assert got.sha256 == ref.sha256
        assert got.stats.to_dict() == ref.stats.to_dict()
        cached += got.stats.cached_calls
    assert cached > 0  # the cached path ran too
    assert counters["stats"]["unique_graphs"] == before  # no recompilation after warm-up
    backend.generate(_spec(backend.defaults, "red apple", "turbo", 3, size=80))  # a new resolution
    assert counters["stats"]["unique_graphs"] - before <= 1
    backend.close()
    eager.close()
    torch._dynamo.reset()


def test_random_weights_give_norms_their_identity_gain_and_compute_on_real_values():
    """`load_format="dummy"` (materialize_random): a zero-centred gain (Krea-2's RMSNorm, scale 1 + w) is 0, a plain
    gain (the VAE's, the Qwen3 text encoder's) is 1, so no normalised activation is all zeros (zero gains made the
    model compute on zeros: unrepresentative speed, and NaN through FP8's per-row scales)."""
    from dicache.models.krea2 import Krea2Pipeline
    from dicache.models.krea2.transformer import RMSNorm as ZeroCentredNorm
    from dicache.models.loading import is_norm_gain

    pipe = Krea2Pipeline.from_pretrained(load_format="dummy")
    seen = {"zero-centred": 0, "plain": 0}
    for component in (pipe.transformer, pipe.vae, pipe.text_encoder.text_encoder):
        for owner in component.modules():
            for name, param in owner.named_parameters(recurse=False):
                if not is_norm_gain(owner, name):
                    continue
                centred = isinstance(owner, ZeroCentredNorm)
                seen["zero-centred" if centred else "plain"] += 1
                assert bool((param == (0 if centred else 1)).all()), (type(owner).__name__, name)
    assert seen["zero-centred"] > 0 and seen["plain"] > 0
    text = pipe.text_encoder.encode(["a red fox"])[0]
    assert text.float().abs().amax(dim=-1).min() > 0  # no all-zero text row
    out = pipe("a red fox", num_inference_steps=2, height=64, width=64, seed=0, output_type="pt").images
    assert torch.isfinite(out).all() and out.std() > 0


def test_compile_takes_the_vae_decoder_too():
    """`pipe.compile()` compiles the VAE decoder with the blocks (its elementwise passes fuse); the images stay the
    eager pipeline's (dynamo's eager backend: the same kernels), and `vae=False` leaves the decoder alone."""
    torch._dynamo.reset()
    eager = Krea2Pipeline.from_pretrained()
    pipe = Krea2Pipeline.from_pretrained().compile(backend="eager")
    assert pipe.vae.decoder._compiled_call_impl is not None
    assert eager.vae.decoder._compiled_call_impl is None
    graphs = counters["stats"]["unique_graphs"]
    kwargs = dict(seed=4, num_inference_steps=2, height=64, width=64, output_type="pt")
    assert torch.equal(pipe("a kite", **kwargs).images, eager("a kite", **kwargs).images)
    assert counters["stats"]["unique_graphs"] > graphs
    other = Krea2Pipeline.from_pretrained().compile(backend="eager", vae=False)
    assert other.vae.decoder._compiled_call_impl is None
    torch._dynamo.reset()


def test_fp8_leaves_torch_compile_settings_alone(monkeypatch):
    """torchao's FP8 config would turn inductor's coordinate-descent tuning on for the whole process (issue 41: a
    slower, hungrier cold compile for no faster block); `fp8_linears` asks it not to. The GPU check is stubbed: what
    is tested is the config handed to torchao and the process's settings after."""
    pytest.importorskip("torchao")
    import dicache.quantization.weights as quantization

    seen = []
    monkeypatch.setattr(quantization, "check_fp8_support", lambda device: None)
    monkeypatch.setattr(quantization, "_quantize_linears", lambda model, names, config: seen.append(config))
    inductor = torch._inductor.config
    before = (inductor.coordinate_descent_tuning, inductor.coordinate_descent_check_all_directions)
    quantization.fp8_linears(torch.nn.Sequential(torch.nn.Linear(32, 32)), {"0"})
    (config,) = seen
    assert config.set_inductor_config is False
    assert (inductor.coordinate_descent_tuning, inductor.coordinate_descent_check_all_directions) == before
