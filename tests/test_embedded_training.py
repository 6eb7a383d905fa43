"""CPU smoke test of the embedded-checkpoint training pipeline (scripts/train_embedded.py) on synthetic images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _synthetic_npz(path: Path) -> None:
    """Eight 64 px images on white — coloured discs and squares — with emoji-like captions."""
    colours = {"red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 60), "purple": (140, 60, 180)}
    yy, xx = np.mgrid[:64, :64]
    images, captions = [], []
    for name, rgb in colours.items():
        for shape in ("circle", "square"):
            img = np.full((64, 64, 3), 255, np.uint8)
            inside = (
                (yy - 32) ** 2 + (xx - 32) ** 2 < 400
                if shape == "circle"
                else (abs(yy - 32) < 18) & (abs(xx - 32) < 18)
            )
            img[inside] = rgb
            images.append(img)
            captions.append(f"large {name} {shape}")
    np.savez(path, images=np.stack(images), captions=np.array(captions), version=np.array("synthetic"))


TINY_TRANSFORMER = {
    "num_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "timestep_embed_dim": 32,
    "text_num_attention_heads": 2,
    "text_num_key_value_heads": 2,
    "text_intermediate_size": 64,
    "num_layerwise_text_blocks": 1,
    "num_refiner_text_blocks": 1,
}


@pytest.fixture(scope="module")
def te():
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(SCRIPTS))
    import train_embedded

    yield train_embedded
    mp.undo()


@pytest.fixture(scope="module")
def trained(te, tmp_path_factory):
    """The whole script on 8 synthetic images with shrunken models (same structure, far fewer channels/blocks)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(te, "TRANSFORMER_CONFIG", {**te.TRANSFORMER_CONFIG, **TINY_TRANSFORMER})
    mp.setattr(te, "VAE_CONFIG", {**te.VAE_CONFIG, "base_dim": 8})
    tmp = tmp_path_factory.mktemp("embedded")
    data = tmp / "synthetic.npz"
    _synthetic_npz(data)
    out = tmp / "krea2-tiny"
    args = ["--data", str(data), "--out", str(out), "--grid", str(tmp / "grid.png"), "--device", "cpu"]
    args += ["--vae-steps", "1", "--dit-steps", "2", "--vae-batch", "2", "--dit-batch", "4"]
    args += ["--grid-seeds", "1", "--grid-cfg-steps", "2", "--grid-turbo-steps", "1", "--grid-max-prompts", "1"]
    try:
        log = te.main(args)
    finally:
        mp.undo()
    yield out, log


def test_diffusers_layout(trained):
    out, log = trained
    assert "error" not in log
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "Krea2Pipeline"
    assert index["tokenizer"] == ["transformers", "PreTrainedTokenizerFast"]
    assert index["text_encoder"] == ["transformers", "Qwen3VLModel"]
    assert index["is_distilled"] is False and index["patch_size"] == 2
    for sub, weights in [
        ("transformer", "diffusion_pytorch_model.safetensors"),
        ("vae", "diffusion_pytorch_model.safetensors"),
        ("text_encoder", "model.safetensors"),
    ]:
        assert (out / sub / "config.json").is_file() and (out / sub / weights).is_file(), sub
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / "tokenizer" / f).is_file()
    sched = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert sched["use_dynamic_shifting"] and (sched["base_shift"], sched["max_shift"]) == (0.5, 1.15)
    assert (sched["base_image_seq_len"], sched["max_image_seq_len"]) == (256, 6400)
    tcfg = json.loads((out / "transformer" / "config.json").read_text())
    assert tcfg["num_text_layers"] == len(index["text_encoder_select_layers"]) and tcfg["in_channels"] == 64
    vcfg = json.loads((out / "vae" / "config.json").read_text())
    assert len(vcfg["dim_mult"]) == 3 and len(vcfg["temperal_downsample"]) == 2 and vcfg["z_dim"] == 16
    assert len(vcfg["latents_mean"]) == 16 and min(vcfg["latents_std"]) > 0

    from safetensors import safe_open

    with safe_open(out / "transformer" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())  # noqa: SIM118

    prompts = json.loads((out / "heldout_prompts.json").read_text())["prompts"]
    assert sum(p["split"] == "heldout" for p in prompts) >= 16
    assert all(isinstance(p["seed"], int) and p["prompt"] for p in prompts)
    assert log["dit"]["steps"] == 2 and log["vae"]["steps"] == 1
    assert log["vae"]["single_frame_conv_check_rel"] < 1e-4
    assert log["padding_invariance_32_vs_512"]["rel"] < 1e-4
    assert log["dit"]["loss_last"] > 0 and log["vae"]["loss_last"] > 0
    assert (out / "training_log.json").is_file() and Path(log["grid"]["path"]).is_file()


def test_tokenizer_template_counts(te, trained):
    out, _ = trained
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert len(tok(te.TEMPLATE_PREFIX)["input_ids"]) == 34
    assert len(tok("<|im_end|>\n<|im_start|>assistant\n")["input_ids"]) == 5
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"
    ids = tok(te.TEMPLATE_PREFIX + "large red circle")["input_ids"]
    assert len(ids) == 37 and tok.unk_token_id not in ids


def test_from_pretrained_generates(trained):
    out, _ = trained
    from diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(out)
    assert pipe.vae_scale_factor == 4
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator("cpu").manual_seed(0)
    image = pipe("large red circle", height=128, width=128, num_inference_steps=2, guidance_scale=3.5, generator=gen)
    assert image.images[0].size == (128, 128)


def test_full_size_checkpoint(te, tmp_path):
    """The shipped configuration (random weights: same size): ≤ 25 MB, ≥ 8 blocks, loads and decodes 128 px."""
    words = [f"w{i}" for i in range(1800)]  # about the Twemoji vocabulary's size
    tok = te.build_tokenizer([" ".join(words[i : i + 10]) for i in range(0, 1800, 10)] + te.HELDOUT_PROMPTS)
    pipe = te.make_pipeline(tok, seed=0)
    assert 5e6 < sum(p.numel() for p in pipe.transformer.parameters()) < 8e6
    assert pipe.transformer.config.num_layers >= 8
    assert pipe.transformer.config.num_text_layers == len(pipe.config.text_encoder_select_layers)
    te.save_pipeline(pipe, tmp_path)
    total = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) / 1e6
    assert total < 25, total

    from diffusers import Krea2Pipeline

    loaded = Krea2Pipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    image = loaded("w1 w2", height=128, width=128, num_inference_steps=1, guidance_scale=0.0, max_sequence_length=32)
    assert image.images[0].size == (128, 128)


def test_single_frame_convs_exact(te):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(**{**te.VAE_CONFIG, "base_dim": 8})
    assert te.check_single_frame_convs(vae, torch.rand(2, 3, 128, 128) * 2 - 1) < 1e-5


def test_training_convention_matches_pipeline_sampler(te, monkeypatch):
    """With the exact velocity of the training objective for one image (``(x_t - x0) / σ``), diffusers' Krea2Pipeline
    must land on that image: checks packing, timestep = σ, the sign of the target and the latent normalisation."""
    monkeypatch.setattr(te, "TRANSFORMER_CONFIG", {**te.TRANSFORMER_CONFIG, **TINY_TRANSFORMER})
    monkeypatch.setattr(te, "VAE_CONFIG", {**te.VAE_CONFIG, "base_dim": 8})
    pipe = te.make_pipeline(te.build_tokenizer(["large red circle"]), seed=0)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(1)
    x = torch.rand(1, 3, 128, 128) * 2 - 1
    with torch.no_grad():
        z = te.encode_latents(pipe.vae, x)
    mean, std = z.mean(dim=(0, 2, 3)), z.std(dim=(0, 2, 3))
    pipe.vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    x0 = te.pack((z - mean[None, :, None, None]) / std[None, :, None, None])

    def oracle(hidden_states, timestep, return_dict=False, **_):
        return ((hidden_states - x0) / timestep[:, None, None],)

    monkeypatch.setattr(pipe.transformer, "forward", oracle)
    kw = {"height": 128, "width": 128, "num_inference_steps": 8, "guidance_scale": 0.0}
    latents = pipe("large red circle", output_type="latent", **kw).images
    torch.testing.assert_close(latents, x0, atol=1e-4, rtol=1e-4)
    image = pipe("large red circle", output_type="pt", **kw).images
    with torch.no_grad():
        expected = (pipe.vae.decode(z[:, :, None]).sample[:, :, 0] / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(image, expected, atol=1e-4, rtol=1e-4)
