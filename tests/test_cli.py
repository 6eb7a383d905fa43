import json
import subprocess
import sys

import pytest
from PIL import Image
from tiny_krea2 import build_tiny_pipeline

from dicache.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_krea2")
    build_tiny_pipeline(d)
    return d


def test_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "dicache.cli", "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout and "config" in out.stdout and "calibrate" in out.stdout


def test_config_prints_values_and_origins(monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_CACHE_DIT_RDT", "0.08")
    assert main(["config"]) == 0
    text = capsys.readouterr().out
    assert "SGLANG_CACHE_DIT_RDT" in text and "0.08" in text and "env SGLANG_CACHE_DIT_RDT" in text
    assert main(["config", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["residual_diff_threshold"] == 0.08


def test_bad_environment_is_a_clear_error_with_exit_code_2(monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_CACHE_DIT_MC", "lots")
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "SGLANG_CACHE_DIT_MC='lots'" in err and "integer >= -1" in err


def test_generate_writes_images_and_prints_cache_stats(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_CACHE_DIT_ENABLED", "true")
    monkeypatch.setenv("SGLANG_CACHE_DIT_WARMUP", "2")
    monkeypatch.setenv("SGLANG_CACHE_DIT_RDT", "10")
    out = tmp_path / "img.png"
    stats_file = tmp_path / "stats.json"
    code = main(
        [
            "generate",
            "a red apple",
            "--model",
            str(tiny_dir),
            "--steps",
            "6",
            "--guidance",
            "2.0",
            "--height",
            "64",
            "--width",
            "48",
            "--num-images",
            "2",
            "--out",
            str(out),
            "--stats-json",
            str(stats_file),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    for i in range(2):
        image = Image.open(tmp_path / f"img-{i}.png")
        assert image.size == (48, 64)
    assert "cond" in printed and "uncond" in printed and "compute fraction" in printed
    stats = json.loads(stats_file.read_text())
    assert stats["branches"]["cond"]["computed_steps"][:2] == [0, 1] and stats["cached_calls"] > 0


def test_generate_without_cache_and_with_bad_model(tiny_dir, tmp_path, capsys):
    code = main(
        [
            "generate",
            "a cat",
            "--model",
            str(tiny_dir),
            "--steps",
            "2",
            "--height",
            "32",
            "--width",
            "32",
            "--out",
            str(tmp_path / "a.png"),
            "--cache",
            "off",
            "--device",
            "cpu",
        ]
    )
    assert code == 0 and "caching off" in capsys.readouterr().out
    code = main(["generate", "a cat", "--model", str(tmp_path / "missing"), "--device", "cpu"])
    assert code == 2 and "missing" in capsys.readouterr().err


def test_a_device_or_output_this_machine_cannot_use_is_refused_before_loading(tmp_path, capsys):
    import pytest
    import torch

    from dicache.errors import ConfigError
    from dicache.settings.devices import resolve_device

    assert resolve_device("cpu:0") == torch.device("cpu:0") and resolve_device(None).type in ("cpu", "cuda")
    with pytest.raises(ConfigError, match=r"--device='gpu' is invalid: not a torch device; allowed: cpu"):
        resolve_device("gpu")
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ConfigError, match=rf"device='{missing}' is invalid: .*allowed here: cpu"):
        resolve_device(missing, "device")
    for command in (["generate", "a"], ["calibrate", "--prompts", "2"], ["sweep", "--dry-run"]):
        assert main([*command, "--out", str(tmp_path / "x.png"), "--device", missing]) == 2
        assert f"--device='{missing}' is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "a", "--out", str(tmp_path / "no-suffix")])
    err = capsys.readouterr().err
    assert "--out=" in err and "no-suffix" in err and ".png" in err and ".webp" in err


def test_base_install_commands_do_not_need_the_extras(tmp_path):
    """`dicache --help` and `generate` work without fastapi/matplotlib/diffusers; `serve` says what to install."""
    blocked = [
        "fastapi",
        "uvicorn",
        "prometheus_client",
        "matplotlib",
        "pytorch_msssim",
        "cache_dit",
        "diffusers",
    ]
    prelude = f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\nfrom dicache.cli import main\n"
    run = lambda code: subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True)  # noqa: E731
    assert run("sys.exit(main(['--help']))").returncode == 0
    out = run(f"sys.exit(main(['generate', 'red apple', '--steps', '2', '--out', {str(tmp_path / 'a.png')!r}]))")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "a.png").is_file()
    served = run("sys.exit(main(['serve']))")
    assert served.returncode == 2 and "pip install 'dicache[serve]'" in served.stderr
