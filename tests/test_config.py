import json
from pathlib import Path

import pytest

from dicache import CacheConfig, ConfigError
from dicache.settings.cache_config import SETTINGS
from dicache.settings.docs import env_example, markdown_table

P = "SGLANG_CACHE_DIT_"


def test_defaults_are_sglangs():
    c = CacheConfig.from_env({})
    assert (c.enable_cache, c.Fn_compute_blocks, c.Bn_compute_blocks, c.max_warmup_steps) == (False, 1, 0, 4)
    assert (c.residual_diff_threshold, c.max_continuous_cached_steps) == (0.24, 3)
    assert (c.enable_taylorseer, c.taylorseer_order, c.scm_preset, c.scm_policy) == (False, 1, "none", "dynamic")
    assert c.scm_compute_bins is None and c.scm_cache_bins is None
    assert set(c.sources().values()) == {"default"}


def test_every_variable_is_read():
    env = {
        P + "ENABLED": "yes",
        P + "FN": "2",
        P + "BN": "1",
        P + "WARMUP": "0",
        P + "RDT": "0.12",
        P + "MC": "-1",
        P + "MAX_CACHED_STEPS": "5",
        P + "TAYLORSEER": "on",
        P + "TS_ORDER": "2",
        P + "TS_DISTANCE": "sigma",
        P + "SCM_COMPUTE_BINS": "8, 3,3",
        P + "SCM_CACHE_BINS": "1,2",
        P + "SCM_POLICY": "STATIC",
        P + "POLICY": "never",
    }
    c = CacheConfig.from_env(env)
    assert c.enable_cache is True and c.enable_taylorseer is True
    assert (c.Fn_compute_blocks, c.Bn_compute_blocks, c.max_warmup_steps, c.max_continuous_cached_steps) == (
        2,
        1,
        0,
        -1,
    )
    assert c.residual_diff_threshold == 0.12 and c.max_cached_steps == 5
    assert (c.taylorseer_order, c.taylorseer_distance) == (2, "sigma")
    assert c.scm_compute_bins == [8, 3, 3] and c.scm_cache_bins == [1, 2]
    assert (c.scm_policy, c.policy) == ("static", "never")
    assert c.sources()["Fn_compute_blocks"] == "env SGLANG_CACHE_DIT_FN"
    assert CacheConfig.from_env({P + "SCM_PRESET": "Fast"}).scm_preset == "fast"


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("FN", "0", ">= 1"),
        ("FN", "one", ">= 1"),
        ("BN", "-1", ">= 0"),
        ("WARMUP", "-2", ">= 0"),
        ("RDT", "-0.1", ">= 0"),
        ("RDT", "nan", ">= 0"),
        ("MC", "-2", ">= -1"),
        ("MAX_CACHED_STEPS", "-5", ">= -1"),
        ("TS_ORDER", "3", "1 or 2"),
        ("TS_DISTANCE", "time", "'step' or 'sigma'"),
        ("SCM_PRESET", "turbo", "none, slow, medium, fast, ultra"),
        ("SCM_POLICY", "sometimes", "'dynamic' or 'static'"),
        ("POLICY", "random", "one of dbcache, teacache, magcache, easycache"),
        ("ENABLED", "maybe", "a boolean"),
        ("TAYLORSEER", "enabled", "a boolean"),
    ],
)
def test_invalid_variable_names_variable_value_and_range(name, value, allowed):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_env({P + name: value})
    message = str(info.value)
    assert P + name in message and repr(value) in message and allowed in message


def test_bins_must_be_paired_and_positive_and_exclusive_with_preset():
    with pytest.raises(ConfigError, match="set together.*SGLANG_CACHE_DIT_SCM_COMPUTE_BINS"):
        CacheConfig.from_env({P + "SCM_COMPUTE_BINS": "4,2"})
    with pytest.raises(ConfigError, match=r"SGLANG_CACHE_DIT_SCM_CACHE_BINS='1,0'.*integers in \[1, 10000\]"):
        CacheConfig.from_env({P + "SCM_COMPUTE_BINS": "4,2", P + "SCM_CACHE_BINS": "1,0"})
    with pytest.raises(ConfigError, match="not both"):
        CacheConfig.from_env({P + "SCM_COMPUTE_BINS": "4", P + "SCM_CACHE_BINS": "1", P + "SCM_PRESET": "fast"})
    with pytest.raises(ConfigError, match="one more"):
        CacheConfig.from_env({P + "SCM_COMPUTE_BINS": "4", P + "SCM_CACHE_BINS": "1,2,3"})


@pytest.mark.parametrize(
    "compute, expected",
    [
        ("400000000", r"SGLANG_CACHE_DIT_SCM_COMPUTE_BINS='400000000' is invalid: .*integers in \[1, 10000\]"),
        ("10000000000", r"SGLANG_CACHE_DIT_SCM_COMPUTE_BINS='10000000000' is invalid"),
        (",".join(["1"] * 1001), r"_SCM_COMPUTE_BINS='1,1,1.*\(2003 characters\) is invalid: must be at most 1000"),
        ("[" * 5000, r"SGLANG_CACHE_DIT_SCM_COMPUTE_BINS='\[\[\[.*\(5002 characters\) is invalid"),
    ],
    ids=["4e8", "1e10", "1001-bins", "deep-nesting"],
)
def test_step_mask_bins_are_bounded_when_read(compute, expected):
    """Issue 18, defect 1: a huge bin used to be expanded step by step (3.5 GB for 4e8); now it is refused at once."""
    with pytest.raises(ConfigError, match=expected):
        CacheConfig.from_env({P + "SCM_COMPUTE_BINS": compute, P + "SCM_CACHE_BINS": "1"})
    with pytest.raises(ConfigError, match="cache override key 'scm_compute_bins'"):
        CacheConfig.defaults().merged({"scm_compute_bins": compute, "scm_cache_bins": [1]})
    assert CacheConfig.defaults().merged({"scm_compute_bins": "[10000]", "scm_cache_bins": [1]}).scm_compute_bins == [
        10000
    ]


def test_unknown_variable_under_prefix_is_an_error_but_secondary_ones_are_ignored():
    with pytest.raises(ConfigError, match="SGLANG_CACHE_DIT_RTD.*SGLANG_CACHE_DIT_RDT"):
        CacheConfig.from_env({P + "RTD": "0.1"})
    assert CacheConfig.from_env({P + "SECONDARY_FN": "3"}).Fn_compute_blocks == 1


def test_overrides_merge_over_environment_and_name_the_key():
    base = CacheConfig.from_env({P + "RDT": "0.3", P + "FN": "2"})
    merged = base.merged({"residual_diff_threshold": 0.1, "scm_preset": "slow"})
    assert merged.residual_diff_threshold == 0.1 and merged.Fn_compute_blocks == 2 and merged.scm_preset == "slow"
    assert merged.sources()["residual_diff_threshold"] == "override"
    assert merged.sources()["Fn_compute_blocks"] == "env SGLANG_CACHE_DIT_FN"
    assert base.residual_diff_threshold == 0.3  # the base is not modified
    with pytest.raises(ConfigError) as info:
        base.merged({"Fn_compute_blocks": -1})
    assert "'Fn_compute_blocks'=-1" in str(info.value) and ">= 1" in str(info.value)
    with pytest.raises(ConfigError, match="Fn_compute_blocks=0 needs a static step mask.*scm_policy='dynamic'"):
        base.merged({"Fn_compute_blocks": 0})
    whole_step = base.merged({"Fn_compute_blocks": 0, "scm_preset": "curved", "scm_policy": "static"})
    assert whole_step.Fn_compute_blocks == 0 and whole_step.decides_statically
    with pytest.raises(ConfigError, match="unknown cache override key.*'rdt'.*residual_diff_threshold"):
        base.merged({"rdt": 0.1})
    with pytest.raises(ConfigError, match="'enable_taylorseer'='sure'.*boolean"):
        base.merged({"enable_taylorseer": "sure"})


def test_from_env_reads_process_environment(monkeypatch):
    monkeypatch.setenv(P + "WARMUP", "7")
    assert CacheConfig.from_env().max_warmup_steps == 7
    monkeypatch.setenv(P + "WARMUP", "x")
    with pytest.raises(ConfigError, match="SGLANG_CACHE_DIT_WARMUP='x'"):
        CacheConfig.from_env()


def test_an_environment_given_is_the_only_one_read(monkeypatch, tmp_path):
    """`defaults()` and `from_env(environ)` read no process variable: before, the process's RDT and profile came in
    through the settings sources, labelled "default", and a missing profile made `defaults()` raise."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"settings": {"max_warmup_steps": 6}}))
    monkeypatch.setenv(P + "RDT", "0.7")
    monkeypatch.setenv(P + "PROFILE", str(profile))
    assert CacheConfig.from_env().residual_diff_threshold == 0.7  # the process environment, when none is given
    defaults = CacheConfig.defaults()
    assert defaults == CacheConfig.from_env({}) and set(defaults.sources().values()) == {"default"}
    declared = {name: field.default for name, field in CacheConfig.model_fields.items()}
    assert defaults.residual_diff_threshold == declared["residual_diff_threshold"] != 0.7
    assert defaults.max_warmup_steps == declared["max_warmup_steps"] != 6
    given = CacheConfig.from_env({P + "WARMUP": "2"})
    assert (given.residual_diff_threshold, given.max_warmup_steps) == (declared["residual_diff_threshold"], 2)
    monkeypatch.setenv(P + "PROFILE", str(tmp_path / "missing.json"))  # gone since start-up: merging reads no file
    assert CacheConfig.defaults().merged({"max_warmup_steps": 3}).max_warmup_steps == 3
    assert given.merged({"enable_taylorseer": True}).sources()["max_warmup_steps"] == f"env {P}WARMUP"


def test_profile_layer_sits_under_environment(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"settings": {"residual_diff_threshold": 0.05, "max_warmup_steps": 6}}))
    c = CacheConfig.from_env({P + "PROFILE": str(profile), P + "WARMUP": "2"})
    assert c.residual_diff_threshold == 0.05 and c.max_warmup_steps == 2
    assert c.sources()["residual_diff_threshold"].startswith("profile ")
    profile.write_text(json.dumps({"settings": {"bogus": 1}}))
    with pytest.raises(ConfigError, match="bogus"):
        CacheConfig.from_env({P + "PROFILE": str(profile)})
    with pytest.raises(ConfigError, match="no such file"):
        CacheConfig.from_env({P + "PROFILE": str(tmp_path / "missing.json")})


def test_block_split_error_names_both_values_and_limit():
    c = CacheConfig.from_env({P + "FN": "4", P + "BN": "2"})
    c.check_block_split(7)
    with pytest.raises(ConfigError, match=r"Fn_compute_blocks=4 \+ Bn_compute_blocks=2 must be < the model's 6"):
        c.check_block_split(6)


def test_describe_lists_every_knob_and_env_example_is_current():
    text = CacheConfig.from_env({P + "MC": "5"}).describe()
    for knob in SETTINGS:
        assert knob.env_name in text
    assert "env SGLANG_CACHE_DIT_MC" in text
    committed = (Path(__file__).parent.parent / "env.example").read_text()
    assert committed == env_example(), "env.example is stale: run `dicache config --env-example > env.example`"


def test_docs_settings_table_is_generated_from_the_field_declarations():
    page = (Path(__file__).parent.parent / "docs" / "settings.md").read_text()
    table = markdown_table()
    assert table in page, "docs/settings.md's table is stale: paste the output of `dicache config --markdown`"
    header = table.splitlines()[0]
    assert page.count(header) == 1, "docs/settings.md holds more than one settings table (a stale copy beside it)"
    for setting in SETTINGS:
        assert f"| `{setting.env_name}` | `{setting.key}` |" in table and setting.meaning in table.replace("\\|", "|")


def test_corrected_forecaster_without_taylorseer_is_an_error_naming_both_settings():
    with pytest.raises(ConfigError, match=r"forecaster='corrected'.*enable_taylorseer=true.*FORECASTER='corrected'"):
        CacheConfig.from_env({P + "FORECASTER": "corrected"})
    with pytest.raises(ConfigError, match=r"forecaster='corrected'.*enable_taylorseer=true"):
        CacheConfig.from_env({P + "TAYLORSEER": "true", P + "FORECASTER": "corrected"}).merged(
            {"enable_taylorseer": False}
        )
    assert CacheConfig.from_env({P + "TAYLORSEER": "1", P + "FORECASTER": "Corrected"}).forecaster == "corrected"
