"""The memory options on `dicache generate` / `dicache serve` and the pipeline API: SGLang's names, clear errors, the
plan printed at start-up, and whole-component offload on the embedded checkpoint (bitwise equal images)."""

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_krea2 import build_tiny_pipeline

import dicache
from dicache.cli import build_parser, main
from dicache.commands.memory import cfg_of, offload_settings
from dicache.errors import ConfigError
from dicache.models.krea2.memory import memory_needs
from dicache.models.krea2.pipeline import Krea2Pipeline
from dicache.offload.plan import GiB, OffloadSettings, plan_memory
from dicache.offload.settings import OffloadLimits
from dicache.server.backend import load_backend
from dicache.server.generation import GenerationSpec
from dicache.settings.cache_config import CacheConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLAGS = [
    "--dit-layerwise-offload",
    "--dit-offload-prefetch-size",
    "--dit-cpu-offload",
    "--text-encoder-cpu-offload",
    "--vae-cpu-offload",
    "--pin-cpu-memory",
    "--gpu-memory-budget",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("offload_krea2")
    build_tiny_pipeline(d)
    return d


def generate_args(tiny_dir, out, *extra):
    return ["generate", "a red apple", "--model", str(tiny_dir), "--steps", "3", "--guidance", "1.0"] + [
        "--height", "32", "--width", "32", "--out", str(out), "--cache", "on", "--device", "cpu", *extra
    ]  # fmt: skip


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_both_commands_take_sglangs_memory_options(command):
    help_text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
    assert all(flag in help_text for flag in FLAGS)
    args = build_parser().parse_args(
        [command, *(["x"] if command == "generate" else []), "--dit-layerwise-offload", "--pin-cpu-memory", "false"]
        + ["--dit-offload-prefetch-size", "0.25", "--gpu-memory-budget", "23.5", "--vae-cpu-offload", "true"]
    )
    settings = offload_settings(args)
    assert settings == OffloadSettings(
        dit_layerwise_offload=True,
        dit_offload_prefetch_size=0.25,
        vae_cpu_offload=True,
        pin_cpu_memory=False,
        gpu_memory_budget=23.5,
    )
    assert not offload_settings(build_parser().parse_args([command, *(["x"] if command == "generate" else [])])).any


def test_a_bad_switch_value_names_the_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--vae-cpu-offload", "maybe"])
    assert "--vae-cpu-offload='maybe' is invalid: must be true or false" in capsys.readouterr().err


def test_generate_with_layerwise_offload_prints_the_plan_and_writes_the_same_image(tiny_dir, tmp_path, capsys):
    assert main(generate_args(tiny_dir, tmp_path / "resident.png")) == 0
    pipe = Krea2Pipeline.from_pretrained(tiny_dir)
    settings = OffloadSettings(dit_layerwise_offload=True, text_encoder_cpu_offload=True, vae_cpu_offload=True)
    needs = memory_needs(pipe, 32, 32, 1, cfg=False, cfg_batched=True, config=CacheConfig.from_env({}))
    everything = plan_memory(needs, settings, None).peak_bytes
    budget = (everything - 1.5 * max(needs.block_bytes)) / GiB  # 4 of 6 blocks stream through 2 slots
    extra = ["--dit-layerwise-offload", "--text-encoder-cpu-offload", "--vae-cpu-offload", "--gpu-memory-budget"]
    assert main(generate_args(tiny_dir, tmp_path / "offloaded.png", *extra, f"{budget:.9f}")) == 0
    printed = capsys.readouterr().out
    assert "memory plan: transformer layerwise; 2 blocks resident, 4 streamed through 2 slot(s)" in printed
    a, b = (np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("resident", "offloaded"))
    assert a.shape == (32, 32, 3) and np.array_equal(a, b)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dit-offload-prefetch-size", "2.5"], "--dit-offload-prefetch-size=2.5 is invalid"),
        (["--dit-offload-prefetch-size", "-1"], "must be a number >= 0"),
        (["--gpu-memory-budget", "0"], "--gpu-memory-budget=0.0 is invalid: must be a number of GiB > 0"),
        (["--gpu-memory-budget", "0.000001"], r"available (--gpu-memory-budget 1e-06) with every block streamed"),
    ],
)
def test_generate_refuses_bad_memory_options_before_running(tiny_dir, tmp_path, capsys, extra, message):
    code = main(generate_args(tiny_dir, tmp_path / "x.png", "--dit-layerwise-offload", *extra))
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_offload_with_model_parallelism_or_concurrent_workers_is_refused():
    args = build_parser().parse_args(["generate", "x", "--dit-layerwise-offload"])
    with pytest.raises(ConfigError, match="cannot be combined with --tp-size / --ulysses-degree"):
        offload_settings(args, parallel=True)
    with pytest.raises(ConfigError, match="--workers 2 is invalid with the memory options"):
        offload_settings(args, workers=2)
    assert cfg_of(None, None) is None and cfg_of(1.0, "raw") is False and cfg_of(None, "raw") is True


def test_serve_backend_plans_for_the_largest_request_it_accepts(tiny_dir):
    args = build_parser().parse_args(["serve", "--dit-layerwise-offload", "--max-side", "64", "--max-n", "2"])
    limits = OffloadLimits(max_height=64, max_width=64, max_images=2, cfg=True, size_source=" (--max-side)")
    backend = load_backend(
        str(tiny_dir),
        device="cpu",
        cache_config=CacheConfig.from_env({}),
        offload=offload_settings(args),
        offload_limits=limits,
    )
    offload = backend.pipe.offload
    assert offload.max_pixels == 64 * 64 and offload.max_images == 2 and offload.cfg and offload.cfg_batched
    spec = GenerationSpec(
        "a cat", None, 1, 32, 32, 3, 2.0, 7, cache=backend.cache_config.merged({"enable_cache": True})
    )
    result = backend.generate(spec)
    assert len(result.images_b64) == 1 and offload.last_request.calls  # one batched call per step
    assert {c.branch for c in offload.last_request.calls} == {"batched"}
    backend.close()


def test_embedded_checkpoint_with_every_offload_is_bitwise_equal_to_resident():
    kw = dict(height=64, width=64, num_inference_steps=5, guidance_scale=3.0, seed=2, output_type="np")
    cache = {"max_warmup_steps": 1, "residual_diff_threshold": 0.3}
    ref = Krea2Pipeline.from_pretrained()
    ref.set_progress_bar_config(disable=True)
    dicache.enable(ref, cache)
    expected = ref("a red apple", cfg_batched=True, **kw).images
    pipe = Krea2Pipeline.from_pretrained(
        dit_layerwise_offload=True,
        text_encoder_cpu_offload=True,
        vae_cpu_offload=True,
        gpu_memory_budget=1.0,  # roomy: every block stays, the components still move per phase
        offload_limits=OffloadLimits(max_height=64, max_width=64),
    )
    pipe.set_progress_bar_config(disable=True)
    dicache.enable(pipe, cache)
    images = pipe("a red apple", **kw).images
    assert np.array_equal(images, expected)
    components = pipe.offload.components
    moved = sum(c.packed.nbytes for c in components.components.values())
    assert components.bytes_in == moved and set(components.components) == {"text_encoder", "vae"}
    assert components.on_device("vae") and not components.on_device("text_encoder")  # the last phase was decode
    pipe("a red apple", **kw)
    assert components.bytes_in == 2 * moved  # each brought in once per call (both prompts encoded together)
    whole = Krea2Pipeline.from_pretrained(
        dit_cpu_offload=True, offload_limits=OffloadLimits(max_height=64, max_width=64)
    )
    whole.set_progress_bar_config(disable=True)
    dicache.enable(whole, cache)
    assert np.array_equal(whole("a red apple", cfg_batched=True, **kw).images, expected)
    assert not whole.offload.components.on_device("transformer")  # back on the host after denoising
    assert whole.transformer.img_in.weight.device == torch.device("cpu")


def test_fp8_with_offload_quantizes_before_planning_and_names_what_is_missing_here(tiny_dir, tmp_path, capsys):
    code = main(generate_args(tiny_dir, tmp_path / "q.png", "--dit-layerwise-offload", "--quantization", "fp8"))
    assert code == 2 and "quantization='fp8' needs an NVIDIA GPU" in capsys.readouterr().err
