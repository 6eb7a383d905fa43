"""A command imports an optional library only when asked, and prints no warning of one it does not use: with torchao
installed (the FP8/INT8 path needs it), `dicache generate` without `--quantization` leaves it unimported, although
transformers, loading the text encoder, would import it. Runs in a fresh interpreter."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from dicache.models.loading import hidden_packages

ROOT = pathlib.Path(__file__).resolve().parents[1]

GENERATE = """
import sys
from dicache.cli import main
out, quantization = sys.argv[1], sys.argv[2:]
assert main(["generate", "red apple", "--device", "cpu", "--steps", "2", "--out", out]) == 0
print("after plain:", "torchao" in sys.modules)
print("--- asked for", quantization, file=sys.stderr, flush=True)
assert main(["generate", "red apple", "--device", "cpu", "--steps", "2", "--out", out, *quantization]) == 0
print("after asking:", "torchao" in sys.modules)
"""

PROGRESS_BAR = re.compile(r"^\s*[^|]*\d+%\|.*\]\s*$")
"""A tqdm progress line (the checkpoint loader's, the denoising loop's), which is output, not a warning."""


def _messages(stderr: str) -> list[str]:
    """stderr's lines other than progress bars (tqdm rewrites its line with carriage returns)."""
    return [line for line in re.split(r"[\r\n]+", stderr) if line.strip() and not PROGRESS_BAR.match(line)]


def test_hidden_packages_look_uninstalled_only_within_the_block():
    assert "tabnanny" not in sys.modules and importlib.util.find_spec("tabnanny") is not None  # a stdlib module
    with hidden_packages("tabnanny", "json"):
        assert importlib.util.find_spec("tabnanny") is None
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("tabnanny")
        assert importlib.import_module("json") is json  # imported already: left alone
    assert "tabnanny" not in sys.modules and importlib.util.find_spec("tabnanny") is not None
    assert importlib.import_module("tabnanny").check


def test_the_progress_filter_keeps_warnings():
    bar = "denoise:  50%|█████     | 1/2 [00:00<00:00, 11.86it/s]\rdenoise: 100%|██████████| 2/2 [00:00<00:00]\n"
    warning = "W1204 18:53:44.241000 8135 site-packages/torch/utils/_pytree.py:630] <enum 'X'> is an Enum subclass"
    assert _messages(bar) == []
    assert _messages(bar + "Failed to load torchao/_C_mxfp8.so\n" + warning) == [
        "Failed to load torchao/_C_mxfp8.so",
        warning,
    ]


def test_generate_imports_torchao_only_when_a_quantization_asks_for_it(tmp_path):
    pytest.importorskip("torchao")
    path = (str(ROOT), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "OMP_NUM_THREADS": "1"}  # tiny model
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, str(tmp_path / "apple.png"), "--quantization", "int8"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [line for line in done.stdout.splitlines() if line.startswith("after ")]
    assert answers == ["after plain: False", "after asking: True"], done.stdout
    plain, _, _ = done.stderr.partition("--- asked for")
    assert _messages(plain) == []
