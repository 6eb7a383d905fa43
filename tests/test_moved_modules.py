"""Modules that moved keep their earlier import paths (`dicache.MOVED_MODULES`, `_lazy.alias_modules`): the 8-bit
modules now in `dicache/quantization/`, the block-stack description now in `dicache/blocks/`. Each earlier path is
imported in a fresh interpreter, where nothing of dicache was loaded before it."""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys

import pytest

import dicache
import dicache.adapters
import dicache.engine.adapters
import dicache.quantization
import dicache.quantization.weights

ROOT = pathlib.Path(__file__).resolve().parents[1]

QUANTIZATION_NAMES = {
    "DEFAULT_EXCLUDE",
    "DEFAULT_FP8_EXCLUDE",
    "DEFAULT_FP8_INCLUDE",
    "FP8_ACTIVATION_FLOOR",
    "FP8_MIN_CAPABILITY",
    "INT8_MIN_CAPABILITY",
    "JOIN_PROJECTIONS_DEFAULT",
    "LAYER_GROUPS",
    "NO_EXCLUSIONS",
    "QUANTIZATION_METHODS",
    "TEXT_ENCODER_FP8_INCLUDE",
    "TEXT_ENCODER_QUANTIZATION_METHODS",
    "QuantizationError",
    "QuantizationSpec",
    "check_fp8_support",
    "check_int8_support",
    "fp8_linears",
    "int8_linears",
    "join_linears",
    "join_selected",
    "joinable_groups",
    "joint_name",
    "parse_quantization",
    "quantize_text_encoder",
    "quantize_transformer",
    "selected_linears",
    "store_linears_in_fp8",
}
"""The public names `dicache/quantization.py` offered before it became a package."""

ADAPTER_NAMES = {
    "FAMILIES",
    "FORMS",
    "LIST_LAYOUTS",
    "HE_TO_EH",
    "HE_TO_H",
    "HE_TO_HE",
    "H_TO_EH",
    "H_TO_H",
    "H_TO_HE",
    "BlockForm",
    "BlockList",
    "DiffusersPipelineAdapter",
    "DualStream",
    "Family",
    "NativePipelineAdapter",
    "SingleStream",
    "StackSpec",
    "find_block_list",
    "find_family",
    "find_pipeline_adapter",
    "form_named",
    "generic_spec",
    "stack_spec",
    "stack_specs",
}
"""`dicache.engine.adapters.__all__` before the block-stack description moved out of the engine."""

CHECK_ONE_PATH = """
import importlib, sys
old, new = sys.argv[1], sys.argv[2]
assert not [m for m in sys.modules if m.startswith("dicache")]
module = importlib.import_module(old)
assert module is sys.modules[new] is sys.modules[old] is importlib.import_module(new), (old, module)
assert module.__name__ == module.__spec__.name == new, (module.__name__, module.__spec__.name)
parent, _, child = old.rpartition(".")
assert getattr(importlib.import_module(parent), child) is module
names = [n for n in vars(module) if not n.startswith("_")]
namespace = {}
exec(f"from {old} import {', '.join(names)}", namespace)
assert all(namespace[n] is getattr(module, n) for n in names)
exec(f"from {parent} import {child} as again", namespace)
assert namespace["again"] is module
print(len(names))
"""


def _fresh_python(code: str, *args: str) -> subprocess.CompletedProcess:
    path = (str(ROOT), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180
    )


def test_every_earlier_path_imports_the_moved_module_in_a_fresh_interpreter():
    """One interpreter imports torch (what every moved module imports; seconds on a small CPU), then forks a child per
    earlier path, in which no dicache module was imported before that path."""
    code = (
        "import os, sys, torch\n"
        "moved = dict(arg.split('=') for arg in sys.argv[1:])\n"
        "failed = []\n"
        "for old, new in moved.items():\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        sys.argv = ['-', old, new]\n"
        "        try:\n"
        f"            exec({CHECK_ONE_PATH!r}, {{}})\n"
        "        except BaseException as exc:\n"
        "            print(old, repr(exc), flush=True)\n"
        "            os._exit(1)\n"
        "        sys.stdout.flush()\n"
        "        os._exit(0)\n"
        "    if os.waitpid(pid, 0)[1] != 0:\n"
        "        failed.append(old)\n"
        "print('failed:', failed)\n"
    )
    done = _fresh_python(code, *(f"{old}={new}" for old, new in dicache.MOVED_MODULES.items()))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("failed: []"), done.stdout + done.stderr[-3000:]
    counts = [int(line) for line in done.stdout.splitlines()[:-1]]
    assert len(counts) == len(dicache.MOVED_MODULES) and all(counts), done.stdout


def test_the_earlier_paths_are_the_moved_modules():
    assert {old.removeprefix("dicache.") for old in dicache.MOVED_MODULES} == {
        "fp8_storage",
        "hadamard",
        "fp8_emulation",
        "fp8_attention_emulation",
        "joint_linears",
        "engine.adapters.forms",
        "engine.adapters.stack",
        "engine.adapters.families",
        "engine.adapters.generic",
        "engine.adapters.family_docs",
    }
    for old, new in dicache.MOVED_MODULES.items():
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old} still has a file"
        assert (ROOT / (new.replace(".", "/") + ".py")).is_file(), f"{new} has no file"


def test_the_top_level_holds_at_most_seven_modules():
    modules = sorted(p.name for p in (ROOT / "dicache").glob("*.py"))
    assert len(modules) <= 7, modules


def test_quantization_and_the_adapters_offer_the_names_they_did():
    assert set(dicache.quantization.__all__) == QUANTIZATION_NAMES
    for name in QUANTIZATION_NAMES:
        assert getattr(dicache.quantization, name) is getattr(dicache.quantization.weights, name), name
    assert set(dicache.engine.adapters.__all__) == ADAPTER_NAMES == set(dicache.adapters.__all__)
    for name in ADAPTER_NAMES:
        assert getattr(dicache.adapters, name) is getattr(dicache.engine.adapters, name), name


@pytest.mark.parametrize("path", ["dicache.no_such_module", "dicache.engine.adapters.no_such_module"])
def test_an_unknown_path_is_still_an_import_error(path):
    with pytest.raises(ModuleNotFoundError, match=path.rpartition(".")[2]):
        importlib.import_module(path)
