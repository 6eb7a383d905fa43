"""The Turbo checkpoint layout: a partial checkpoint (transformer + scheduler) that takes tokenizer, text encoder and
VAE from the base named in its dicache.json; `--variant turbo` loads it by default; the distillation script's
teacher and path arithmetic (scripts/train_turbo.py)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_krea2 import build_tiny_pipeline

from dicache.models.krea2 import checkpoints as krea2_checkpoints
from dicache.models.krea2.pipeline import Krea2Pipeline, component_fingerprint, default_checkpoint, resolve_model
from dicache.models.loading import CheckpointError

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def make_partial(base: Path, out: Path, pointer: str | None = "../base", **extra) -> Path:
    """A Turbo-style folder: the base's transformer, a scheduler pinned at mu 1.15, is_distilled, a base pointer."""
    out.mkdir(parents=True)
    shutil.copytree(base / "transformer", out / "transformer")
    (out / "scheduler").mkdir()
    scheduler = json.loads((base / "scheduler" / "scheduler_config.json").read_text())
    scheduler["base_shift"] = scheduler["max_shift"] = 1.15
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    index = json.loads((base / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    meta = {"shared_components": ["tokenizer", "text_encoder", "vae"], **extra}
    if pointer is not None:
        meta["base_checkpoint"] = pointer
    (out / "dicache.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("turbo_layout")
    base = root / "base"
    build_tiny_pipeline(base)
    (base / "dicache.json").write_text(json.dumps({"default_size": [32, 32]}))
    prints = {name: component_fingerprint(base / name) for name in ("text_encoder", "vae")}
    turbo = make_partial(base, root / "turbo", base_files_sha256=prints)
    return base, turbo


def generate(pipe, variant=None):
    out = pipe("a red fox", seed=3, height=32, width=32, num_inference_steps=2, variant=variant, output_type="pt")
    return out.images


def test_partial_checkpoint_takes_the_shared_components_from_its_base(checkpoints, one_torch_thread):
    base_dir, turbo_dir = checkpoints
    turbo = Krea2Pipeline.from_pretrained(turbo_dir)
    base = Krea2Pipeline.from_pretrained(base_dir)
    assert turbo.is_distilled and not base.is_distilled
    assert turbo.vae is not None and turbo.text_encoder is not None
    assert turbo.default_size == (32, 32)  # the base's dicache.json fills what the partial one leaves out
    for a, b in zip(turbo.vae.state_dict().values(), base.vae.state_dict().values()):
        assert torch.equal(a, b)
    # same transformer, same shared parts, sigmas pinned at mu 1.15 both ways: the same image, bit for bit
    assert torch.equal(generate(turbo), generate(base, variant="turbo"))
    assert not torch.equal(generate(turbo), generate(base, variant="raw"))  # the raw preset shifts differently


def test_base_pointer_errors_and_override(checkpoints, tmp_path):
    base_dir, _ = checkpoints
    lost = make_partial(base_dir, tmp_path / "lost", pointer="../nowhere")
    with pytest.raises(CheckpointError, match=r"base checkpoint '\.\./nowhere'.*does not exist") as err:
        Krea2Pipeline.from_pretrained(lost)
    assert "tokenizer, text_encoder, vae" in str(err.value)
    assert Krea2Pipeline.from_pretrained(lost, base=base_dir).vae is not None  # base= overrides the pointer

    changed = make_partial(base_dir, tmp_path / "changed", str(base_dir), base_files_sha256={"vae": "0" * 64})
    with pytest.raises(CheckpointError, match="distilled with a different vae"):
        Krea2Pipeline.from_pretrained(changed)

    alone = make_partial(base_dir, tmp_path / "alone", pointer=None)  # no pointer: no shared parts, latents only
    pipe = Krea2Pipeline.from_pretrained(alone)
    assert pipe.vae is None and pipe.text_encoder is None


def test_variant_turbo_picks_the_turbo_checkpoint_by_default(checkpoints, tmp_path, monkeypatch):
    _, turbo_dir = checkpoints
    assert resolve_model("some/dir", "turbo") == "some/dir"
    assert resolve_model(None, "raw") == krea2_checkpoints.EMBEDDED_CHECKPOINT
    assert resolve_model(None, None) == krea2_checkpoints.EMBEDDED_CHECKPOINT
    monkeypatch.setattr(krea2_checkpoints, "EMBEDDED_TURBO_CHECKPOINT", tmp_path / "missing")
    with pytest.raises(CheckpointError, match=r"Turbo checkpoint is missing.*--model.*--variant raw"):
        default_checkpoint("turbo")
    monkeypatch.setattr(krea2_checkpoints, "EMBEDDED_TURBO_CHECKPOINT", turbo_dir)
    assert resolve_model(None, "turbo") == turbo_dir


def test_commands_load_the_turbo_checkpoint_for_variant_turbo(checkpoints, tmp_path, monkeypatch, capsys):
    from dicache.cli import main
    from dicache.commands.calibrate import _load_runner
    from dicache.commands.sweep import add_arguments, build_spec
    from dicache.server.backend import load_backend

    base_dir, turbo_dir = checkpoints
    monkeypatch.setattr(krea2_checkpoints, "EMBEDDED_TURBO_CHECKPOINT", turbo_dir)
    args = ["generate", "a cat", "--variant", "turbo", "--steps", "1", "--cache", "off", "--device", "cpu"]
    assert main([*args, "--out", str(tmp_path / "a.png")]) == 0
    assert f"(model: {turbo_dir})" in capsys.readouterr().out

    runner, _reference, meta = _load_runner(
        argparse.Namespace(model=None, variant="turbo", device="cpu", dtype=None, steps=1, guidance=None, size=(32, 32))
    )
    assert meta["model_source"] == str(turbo_dir) and meta["variant"] == "turbo" and meta["guidance_scale"] == 1.0

    backend = load_backend(None, "turbo", device="cpu", profile=None)
    assert backend.pipe.source == str(turbo_dir) and backend.pipe.is_distilled
    backend.close()

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = build_spec(parser.parse_args(["--variant", "turbo", "--prompt", "x"]), log=lambda _: None)
    assert spec.model == str(turbo_dir) and [s.name for s in spec.schedules] == ["8 steps, no CFG"]
    spec = build_spec(parser.parse_args(["--variant", "raw", "--prompt", "x"]), log=lambda _: None)
    assert spec.model is None and len(spec.schedules) == 3


# ---------------------------------------------------------------------------------------------- scripts/train_turbo


@pytest.fixture(scope="module")
def tt():
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(SCRIPTS))
    import train_turbo

    yield train_turbo
    mp.undo()


def test_path_states_are_exact_on_an_euler_path(tt):
    sigmas = [1.0, 0.7, 0.3, 0.0]
    torch.manual_seed(0)
    x0 = torch.randn(4)
    velocities = [torch.randn(4) for _ in range(3)]
    states = [x0]
    for i, v in enumerate(velocities):
        states.append(states[-1] + (sigmas[i + 1] - sigmas[i]) * v)
    got = tt.path_states(sigmas, states, velocities, [1.0, 0.85, 0.7, 0.5, 0.0])
    expected = [x0, x0 - 0.15 * velocities[0], states[1], states[1] - 0.2 * velocities[1], states[3]]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_teacher_reproduces_the_pipelines_cfg_sampling(checkpoints, tt, one_torch_thread):
    base_dir, _ = checkpoints
    pipe = Krea2Pipeline.from_pretrained(base_dir)
    pipe.set_progress_bar_config(disable=True)
    states, masks = tt.encode_captions(pipe, ["a red fox", "blue heart"])
    empty = tt.encode_captions(pipe, [""])
    teacher = tt.Teacher(pipe.transformer, pipe, empty, steps=3, scale=4.5)
    noise = torch.randn(2, teacher.positions.shape[0], pipe.transformer.config.in_channels)
    sig = [float(s) for s in teacher.sigmas]
    path = teacher.sample(noise, states, masks, [sig[0], sig[1], 0.5 * (sig[1] + sig[2]), 0.0])
    cond = pipe.transformer.encode_text(states, masks)
    uncond = pipe.transformer.encode_text(empty[0].expand(2, -1, -1, -1), empty[1].expand(2, -1))
    rows, cols = pipe.latent_grid(tt.IMAGE_SIZE, tt.IMAGE_SIZE)
    ref = pipe.denoise(cond, uncond, noise, rows, cols, teacher.sigmas, 4.5, cfg_batched=True)
    one = pipe.denoise(cond, uncond, noise, rows, cols, teacher.sigmas[:2], 4.5, cfg_batched=True)
    two = pipe.denoise(cond, uncond, one, rows, cols, teacher.sigmas[1:3], 4.5, cfg_batched=True)
    torch.testing.assert_close(path[:, 0], noise)
    torch.testing.assert_close(path[:, 1], one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(path[:, 2], 0.5 * (one + two), rtol=1e-5, atol=1e-5)  # linear within a step
    torch.testing.assert_close(path[:, 3], ref, rtol=1e-5, atol=1e-5)


def test_training_resumes_from_its_saved_state(checkpoints, tt, tmp_path, monkeypatch, one_torch_thread):
    """A 3-step run checkpointed after every step; resuming from its step-2 checkpoint ends where it ended (same
    weights, same history), as the checkpoint holds weights, optimizer, EMA, history and the batch generator."""
    base_dir, _ = checkpoints
    pipe = Krea2Pipeline.from_pretrained(base_dir)
    states, masks = tt.encode_captions(pipe, ["a red fox", "blue heart"])
    student_sigmas = tt.student_sigmas(pipe)
    tokens = tt.Student(pipe.transformer, pipe, student_sigmas).positions.shape[0]
    torch.manual_seed(0)
    pairs = {
        "paths": torch.randn(6, len(student_sigmas), tokens, pipe.transformer.config.in_channels),
        "caption_idx": torch.tensor([0, 1, 0, 1, 0, 1]),
    }
    at_step_2 = {}
    save = tt.save_training_state

    def keep_step_2(args, transformer, opt, ema, hist, budget, gen):
        save(args, transformer, opt, ema, hist, budget, gen)
        if budget.step == 2:
            at_step_2["state"] = torch.load(Path(args.work) / "train_state.pt")

    monkeypatch.setattr(tt, "save_training_state", keep_step_2)

    def run(work, resume_state=None):
        work.mkdir()
        argv = ["--device", "cpu", "--batch", "8", "--val-pairs", "2", "--teacher-samples", "6", "--warmup", "1"]
        argv += ["--train-steps", "3", "--work", str(work), "--onpolicy-start", "0.5", "--checkpoint-seconds", "0"]
        model = tt.Krea2Transformer.from_pretrained(base_dir, dtype=torch.float32)
        student = tt.Student(model, pipe, student_sigmas)
        return model, tt.train(tt.parse_args(argv), student, pairs, states, masks, torch.device("cpu"), resume_state)

    straight, straight_log = run(tmp_path / "a")
    assert at_step_2["state"]["step"] == 2
    resumed, resumed_log = run(tmp_path / "b", at_step_2["state"])
    assert resumed_log["steps"] == 3 and len(resumed_log["loss_curve"]) == 3
    assert resumed_log["loss_curve"] == straight_log["loss_curve"]
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_the_shipped_turbo_checkpoint_is_a_distilled_student_of_the_embedded_base():
    """dicache/assets/krea2-tiny-turbo: only transformer and scheduler (the base's other parts, fingerprints matching),
    distilled, mu pinned at 1.15, its own weights (not the base's copied)."""
    from safetensors import safe_open

    turbo = krea2_checkpoints.EMBEDDED_TURBO_CHECKPOINT
    assert default_checkpoint("turbo") == turbo
    assert sorted(p.name for p in turbo.iterdir() if p.is_dir()) == ["scheduler", "transformer"]
    meta = json.loads((turbo / "dicache.json").read_text())
    base = (turbo / meta["base_checkpoint"]).resolve()
    assert base == krea2_checkpoints.EMBEDDED_CHECKPOINT
    for component, digest in meta["base_files_sha256"].items():
        assert component_fingerprint(base / component) == digest
    assert json.loads((turbo / "model_index.json").read_text())["is_distilled"] is True
    scheduler = json.loads((turbo / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["base_shift"] == scheduler["max_shift"] == 1.15
    weights = "transformer/diffusion_pytorch_model.safetensors"
    with safe_open(turbo / weights, "pt") as a, safe_open(base / weights, "pt") as b:
        names = sorted(a.keys())
        assert names == sorted(b.keys())
        assert any(not torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in names)
    log = json.loads((turbo / "training_log.json").read_text())
    assert log["train"]["steps"] > 0 and "student 8 st" in log["eval_vs_teacher_psnr_db"]


def test_teacher_only_needs_a_work_folder(tt, capsys):
    """--teacher-only saves the teacher paths for --resume runs to share: without --work there is nowhere to save."""
    with pytest.raises(SystemExit):
        tt.parse_args(["--teacher-only"])
    assert "--teacher-only needs --work" in capsys.readouterr().err
    assert tt.parse_args(["--teacher-only", "--work", "/tmp/w"]).teacher_only


def test_the_shipped_turbo_log_records_every_training_stage():
    """The GPU student was trained in stages (--init): each stage's log nests the one it started from, and the
    shipped stage started from the previous stage's output."""
    log = json.loads((krea2_checkpoints.EMBEDDED_TURBO_CHECKPOINT / "training_log.json").read_text())
    stages = []
    while log:
        stages.append(log)
        log = log.get("previous_stage")
    assert len(stages) >= 2
    for later, earlier in zip(stages, stages[1:]):
        assert later["args"]["init"] and later["init"] == later["args"]["init"]
        assert later["train"]["validation_before"] > earlier["train"]["validation_before"]
