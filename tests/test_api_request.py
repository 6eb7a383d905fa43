"""The public per-request API: `dicache.request` configs and `dicache.stats` (docs/architecture.md §4)."""

import pytest
import torch
from toymodels import ToyTransformer, sample, timesteps

import dicache
from dicache import CacheConfig, NotEnabledError

STATIC = {
    "Fn_compute_blocks": 0,
    "max_warmup_steps": 0,
    "scm_preset": "curved",
    "scm_policy": "static",
    "scm_compute_fraction": 0.3,
}


@pytest.fixture
def model():
    torch.manual_seed(0)
    return ToyTransformer(num_blocks=6, dim=16).eval()


def test_explicit_request_after_an_implicit_one_reports_its_own_stats(model):
    """Bare forwards open an implicit request; a later `dicache.request` ends it, and `stats` then reports the
    explicit request (it used to report the stale implicit one)."""
    torch.manual_seed(1)
    x = torch.randn(2, 5, 16)
    dicache.enable(model, CacheConfig.from_env({}))
    with torch.no_grad():
        sample(model, x, 8)  # implicit request, Fn=1 defaults
        implicit = dicache.stats(model)
        assert implicit.computed_calls + implicit.cached_calls == 8
        with dicache.request(model, num_inference_steps=28, config=STATIC):
            for i, t in enumerate(timesteps(28)):
                with dicache.step(model, i):
                    model(x, torch.tensor([t]))
    st = dicache.stats(model)
    assert st is not implicit
    assert st.computed_calls + st.cached_calls == 28 and st.num_steps == 28
    assert st.compute_fraction == pytest.approx(8 / 28) and st.fn_blocks == 0
    with torch.no_grad():
        sample(model, x, 8)  # bare forwards afterwards open a fresh implicit request
    assert dicache.stats(model).computed_calls + dicache.stats(model).cached_calls == 8
    dicache.disable(model)


def test_per_model_calls_on_a_model_without_cache_raise_a_dicache_error(model):
    with pytest.raises(NotEnabledError, match="not enabled on this ToyTransformer"):
        dicache.stats(model)
    assert issubclass(NotEnabledError, dicache.DicacheError) and issubclass(NotEnabledError, RuntimeError)


def test_a_request_caches_iff_its_config_says_so(model):
    """One representation of "enabled": the request's `config.enable_cache`. `dicache.enable` turns it on for the
    model's base settings; a request's dict merges over them, a request's `CacheConfig` is taken whole."""
    torch.manual_seed(1)
    x = torch.randn(2, 5, 16)
    base = CacheConfig.from_env({}, max_warmup_steps=1, residual_diff_threshold=1e9)
    assert base.enable_cache is False
    dicache.enable(model, base)
    assert dicache.session_of(model).config.enable_cache is True
    forms = {
        "base": None,
        "dict": {"max_warmup_steps": 2},
        "dict off": {"enable_cache": False},
        "config off": base,
        "config on": base.merged({"enable_cache": True}),
    }
    seen = {}
    for name, config in forms.items():
        with torch.no_grad(), dicache.request(model, config=config) as state:
            sample(model, x, 4)
        st = dicache.stats(model)
        assert st.enabled is state.enabled is state.config.enable_cache
        seen[name] = (st.enabled, st.cached_calls)
    dicache.disable(model)
    assert seen == {
        "base": (True, 3),
        "dict": (True, 2),
        "dict off": (False, 0),
        "config off": (False, 0),
        "config on": (True, 3),
    }
