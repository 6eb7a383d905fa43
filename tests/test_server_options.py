"""Server options declared once (`dicache.settings.options.option`): the `dicache serve` options, their defaults and
help are derived from the `ServerSettings` / `ConnectionLimits` / `RayServeOptions` fields, and a bad value names the
field, the value and what is allowed."""

from __future__ import annotations

import pytest

from dicache.cli import main as cli_main
from dicache.commands.fields import flagged
from dicache.commands.serve import limits_from_args, parse_serve_argv, settings_from_args
from dicache.commands.serve_ray import replica_spec_from_args, serve_options_from_args
from dicache.errors import ConfigError
from dicache.server.ray.options import RayServeOptions
from dicache.server.settings import ConnectionLimits, ServerSettings

MODELS = (ServerSettings, ConnectionLimits, RayServeOptions)


def test_every_declared_flag_is_in_the_help_with_its_meaning(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for model in MODELS:
        for field in flagged(model).values():
            assert field.json_schema_extra["flag"] in text and " ".join(field.description.split()) in text
    assert "--timeout TIMEOUT seconds per request" in text and "(default: 600)" in text
    assert "--max-queue MAX_QUEUE requests allowed to wait" in text and "(default: 16)" in text


def test_no_options_give_the_declared_defaults(monkeypatch):
    monkeypatch.delenv("DICACHE_API_KEY", raising=False)
    args = parse_serve_argv([])
    assert settings_from_args(args) == ServerSettings()
    assert limits_from_args(args) == ConnectionLimits()
    options = serve_options_from_args(args, replica_spec_from_args(args, None), cluster_gpus=0)
    assert options == RayServeOptions()


def test_options_reach_their_fields_by_name(monkeypatch):
    monkeypatch.setenv("DICACHE_API_KEY", "k" * 16)
    args = parse_serve_argv(
        ["--timeout", "12", "--drain-timeout", "0", "--body-timeout", "3", "--max-side", "64", "--metrics-auth"]
    )
    settings = settings_from_args(args)
    assert (settings.request_timeout_s, settings.drain_grace_s, settings.body_timeout_s) == (12.0, 0.0, 3.0)
    assert settings.max_side == 64 and settings.protect_metrics and settings.api_key == "k" * 16
    limits = limits_from_args(parse_serve_argv(["--keep-alive-timeout", "2", "--header-timeout", "4"]))
    assert (limits.keep_alive_s, limits.header_timeout_s) == (2.0, 4.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_queue=-1), "ServerSettings.max_queue=-1 is invalid: must be an integer between 0 and 100000"),
        (dict(workers=True), "ServerSettings.workers=True is invalid: must be an integer between 1 and 64"),
        (dict(request_timeout_s=float("nan")), "ServerSettings.request_timeout_s=nan is invalid: must be a finite"),
        (
            dict(max_body_bytes=10),
            "ServerSettings.max_body_bytes=10 is invalid: must be an integer between 1024 and 1073741824",
        ),
        (
            dict(max_side=10**24),
            "ServerSettings.max_side=1000000000000000000000000 is invalid: must be an integer between 16 and 8192",
        ),
        (
            dict(request_timeout_s=1e300),
            "ServerSettings.request_timeout_s=1e+300 is invalid: must be a finite number > 0 and <= 86400",
        ),
        (dict(max_side=16, min_side=32), "ServerSettings.max_side=16 must be >= min_side=32"),
        (dict(api_key=" "), "ServerSettings.api_key is empty"),
        (dict(maxqueue=3), "ServerSettings: unknown option 'maxqueue'"),
    ],
)
def test_bad_settings_name_the_field_the_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError) as caught:
        ServerSettings(**kwargs)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_api_key_is_never_shown():
    assert "secret" not in repr(ServerSettings(api_key="secret"))
    with pytest.raises(ValueError) as caught:
        ServerSettings(api_key=12345)
    assert "12345" not in str(caught.value) and "ServerSettings.api_key is invalid" in str(caught.value)


def test_settings_are_frozen_and_copied_with_changes():
    settings = ServerSettings(workers=2)
    with pytest.raises(ValueError):
        settings.workers = 3  # type: ignore[misc]
    assert settings.model_copy(update={"workers": 3}).workers == 3 and settings.workers == 2
    with pytest.raises(ValueError, match="^max_connections=0 is invalid: must be an integer between 1 and 1000000$"):
        ConnectionLimits(max_connections=0)
    with pytest.raises(ConfigError, match="^--replicas=0 is invalid: must be an integer >= 1$"):
        RayServeOptions(replicas=0)


def test_a_default_size_outside_the_limits_is_refused_before_loading(monkeypatch, capsys):
    """A request without `size` gets the default size: it must obey --max-side like a request's own size (a
    --default-size or a model default larger than --max-side used to be served, bypassing the limit)."""
    monkeypatch.delenv("DICACHE_API_KEY", raising=False)
    assert cli_main(["serve", "--default-size", "4096x4096", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "--default-size 4096x4096 is invalid" in err and "between 16 and 2048" in err and "Traceback" not in err


def test_a_model_default_size_outside_the_limits_asks_for_a_size():
    """A model whose default size exceeds --max-side: requests without `size` get a 400 asking for one (they were
    generated at the default size, past the limit); requests with an allowed size are served."""
    from dicache.server.errors import ApiError
    from dicache.server.generation import Defaults, resolve
    from dicache.server.schemas import ImageGenerationRequest
    from dicache.settings.cache_config import CacheConfig

    defaults = Defaults(variant=None, num_inference_steps=4, guidance_scale=1.0, width=1024, height=1024)
    settings = ServerSettings(max_side=512)
    for size in (None, "auto"):
        with pytest.raises(ApiError) as caught:
            resolve(ImageGenerationRequest(prompt="x", size=size), settings, defaults, CacheConfig.defaults())
        assert caught.value.status == 400 and caught.value.param == "size"
        assert "the default size 1024x1024 is outside this server's limits: send a size" in caught.value.message
        assert "between 16 and 512" in caught.value.message
    spec = resolve(ImageGenerationRequest(prompt="x", size="512x256"), settings, defaults, CacheConfig.defaults())
    assert (spec.width, spec.height) == (512, 256)


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_option_is_refused_not_ignored(key, monkeypatch, capsys):
    """`--api-key "$KEY"` with KEY unset must not start a server without authentication."""
    monkeypatch.delenv("DICACHE_API_KEY", raising=False)
    assert cli_main(["serve", "--api-key", key, "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "--api-key is empty" in err and "Traceback" not in err
