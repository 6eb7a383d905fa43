"""The package imports its API lazily: light modules (Ray Serve's proxy callback) load without torch or the engine,
while `import dicache` keeps offering the whole public API. Each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGINE = (
    "dicache.api",
    "dicache.engine.hooks",
    "dicache.engine.install",
    "dicache.engine.session",
    "dicache.engine.state",
    "dicache.models",
    "dicache.settings.cache_config",
)


def _python(*args: str) -> subprocess.CompletedProcess:
    path = (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _imported(importtime_log: str) -> set[str]:
    """Module names from `python -X importtime` output ('import time: self | cumulative | name')."""
    return {
        line.split("|")[-1].strip()
        for line in importtime_log.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    } - {"imported package"}


def test_ray_proxy_callback_imports_neither_torch_nor_the_engine():
    modules = _imported(_python("-X", "importtime", "-c", "import dicache.server.ray_proxy").stderr)
    assert "dicache.server.ray_proxy" in modules  # the log was read
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert not {m for m in modules if m.startswith(ENGINE)}
    assert "ray" not in modules


def test_the_proxy_callback_path_and_its_earlier_alias_import_neither_torch_nor_ray():
    """What Serve's proxy imports (`CALLBACK_PATH`, set by `dicache serve --ray` and the KubeRay manifest) and the
    earlier documented `dicache.server.ray_proxy:proxy_middlewares` name the same light callback."""
    from dicache.server.ray.proxy import CALLBACK_PATH

    module, _, attr = CALLBACK_PATH.partition(":")
    code = (
        f"import {module}, dicache.server.ray_proxy as earlier; "
        f"assert earlier.proxy_middlewares is {module}.{attr} and callable(earlier.proxy_middlewares)"
    )
    modules = _imported(_python("-X", "importtime", "-c", code).stderr)
    assert {module, "dicache.server.ray_proxy"} <= modules
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert not {m for m in modules if m.startswith(ENGINE)}
    assert "ray" not in modules


def test_the_public_api_resolves_on_first_use():
    check = """
import sys
import dicache
assert "torch" not in sys.modules and "dicache.api" not in sys.modules
from dicache import CacheConfig, RequestStats
assert CacheConfig().residual_diff_threshold == 0.24 and "torch" not in sys.modules
import dicache.api
import dicache.engine.stats
for name in dicache.__all__:
    assert getattr(dicache, name) is not None, name
assert dicache.enable is dicache.api.enable and dicache.stats is dicache.api.stats  # the function, not the module
stats_module = sys.modules["dicache.engine.stats"]
assert dicache.stats is not stats_module and RequestStats is stats_module.RequestStats
assert set(dicache.__all__) <= set(dir(dicache))
ns = {}
exec("from dicache import *", ns)
assert callable(ns["stats"]) and ns["CacheConfig"] is CacheConfig
try:
    dicache.no_such_name
except AttributeError as exc:
    assert "no_such_name" in str(exc)
else:
    raise AssertionError("no AttributeError")
print("ok")
"""
    assert _python("-c", check).stdout.strip() == "ok"


def test_enable_works_after_a_bare_import():
    check = """
import dicache
import torch
from toymodels import ToyTransformer, sample
model = ToyTransformer(num_blocks=4, dim=8).eval()
dicache.enable(model, dicache.CacheConfig(enable_cache=True))
sample(model, torch.randn(1, 3, 8), num_steps=8)
assert dicache.is_enabled(model) and len(dicache.stats(model).branches["cond"].computed_steps) > 0
dicache.disable(model)
assert not dicache.is_enabled(model)
print("ok")
"""
    assert _python("-c", check).stdout.strip() == "ok"
