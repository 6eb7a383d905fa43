"""The server's /openapi.json says what the server does (issue 45, the defects the schema fuzz found), checked
endpoint by endpoint without a model: every bound the schema documents is the one requests are checked against,
content types and statuses are the ones answered, and a 405 lists the allowed methods.

The app runs in-process (`TestClient`) over a backend with only what routing and validation read (its defaults,
cache settings and block count); nothing here generates an image (tests/test_schema_fuzz.py does, for real).
"""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from dicache.server import ServerSettings, create_app
from dicache.server.errors import ApiError
from dicache.server.generation import Defaults, parse_size, resolve
from dicache.server.schemas import ImageGenerationRequest
from dicache.settings.cache_config import SETTINGS, CacheConfig

GENERATIONS = "/v1/images/generations"
KEY = "schema-key-0123456789"
ENDPOINTS = {  # path: the methods its routes answer
    GENERATIONS: "POST",
    "/v1/models": "GET",
    "/v1/models/krea-2": "GET",
    "/v1/server_info": "GET",
    "/health": "GET, HEAD",
    "/health_generate": "GET",
    "/metrics": "GET",
}
RAW = Defaults("raw", 50, 4.5, 32, 32, 8)  # the embedded checkpoint's preset: 50 steps, CFG 4.5, 32x32


class Backend:
    """What the app reads of a backend for routing, validation and its schema; it never generates here."""

    def __init__(self, defaults: Defaults = RAW, cache_config: CacheConfig | None = None) -> None:
        self.defaults, self.num_blocks = defaults, 10
        self.cache_config = cache_config or CacheConfig.defaults()

    def generate(self, spec, should_stop=None):
        raise AssertionError("no generation in these tests")


def document(settings: ServerSettings, backend: Backend | None = None) -> dict:
    with TestClient(create_app(backend or Backend(), settings)) as client:
        return client.get("/openapi.json").json()


def body_schema(doc: dict) -> dict:
    return doc["paths"][GENERATIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]


def value_schema(prop: dict) -> dict:
    return next((b for b in prop.get("anyOf", ()) if b.get("type") != "null"), prop)


def accepted(body: dict, settings: ServerSettings, defaults: Defaults = RAW) -> bool:
    """Whether the server takes `body` (parsing and `resolve`, everything before the queue)."""
    try:
        resolve(ImageGenerationRequest.model_validate(body), settings, defaults, CacheConfig.defaults(), 10)
    except (ApiError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------- 405 + Allow
@pytest.mark.parametrize("method", ["TRACE", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_a_405_lists_the_methods_its_path_answers(method):
    """RFC 9110: a 405 carries `Allow` (it had none, on every endpoint); `/health` answers GET and HEAD, two routes."""
    with TestClient(create_app(Backend(), ServerSettings(docs=True))) as client:
        for path, allow in ENDPOINTS.items():
            answer = client.request(method, path)
            assert answer.status_code == 405, (method, path)
            assert answer.headers["allow"] == allow, (method, path)
            error = answer.json()["error"]
            assert error["message"] == f"method {method} is not allowed on {path}; allowed: {allow}"
            assert error["type"] == "invalid_request_error"
        assert client.post("/v1/models").headers["allow"] == "GET"


# ---------------------------------------------------------------------------------------------- content types
def test_metrics_is_documented_as_prometheus_text_and_its_401_as_json():
    """/metrics was documented as JSON; it serves Prometheus text. An error is JSON on every endpoint."""
    settings = ServerSettings(docs=True, api_key=KEY, protect_metrics=True)
    with TestClient(create_app(Backend(), settings)) as client:
        doc = client.get("/openapi.json").json()
        served = client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        refused = client.get("/metrics")
    responses = doc["paths"]["/metrics"]["get"]["responses"]
    assert list(responses["200"]["content"]) == ["text/plain"]
    assert served.headers["content-type"].startswith("text/plain")
    assert list(responses["401"]["content"]) == ["application/json"]
    assert responses["401"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert refused.status_code == 401 and refused.headers["content-type"] == "application/json"


def test_every_documented_status_and_only_those():
    """FastAPI's 422 is gone (a bad request is a 400); 401 and bearer security only where the key protects;
    429 and 503 say Retry-After; the 504 gives the server's --timeout (a client waiting longer waits in vain)."""
    doc = document(ServerSettings(docs=True, api_key=KEY, request_timeout_s=30))
    assert "422" not in str(doc) and "HTTPValidationError" not in str(doc)
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's API key",
    }
    for path, operations in doc["paths"].items():
        (operation,) = operations.values()
        protected = path.startswith("/v1/")
        assert ("401" in operation["responses"]) == protected == ("security" in operation), path
        for code in ("429", "503"):
            if code in operation["responses"] and path != "/health":
                assert "Retry-After" in operation["responses"][code]["headers"], (path, code)
    generation = doc["paths"][GENERATIONS]["post"]["responses"]
    assert set(generation) == {"200", "400", "401", "408", "413", "429", "503", "504"}
    assert "within 30 s" in generation["504"]["description"] and "--timeout" in generation["504"]["description"]
    open_doc = document(ServerSettings(docs=True))
    assert "securitySchemes" not in open_doc["components"]
    assert not [p for p, ops in open_doc["paths"].items() for op in ops.values() if "401" in op["responses"]]


# ---------------------------------------------------------------------------------------------- bounds
def test_integer_bounds_are_exact():
    """FastAPI's document model turned integer bounds into floats: the seed's 2**63 - 1 became 2**63, a seed the
    schema allowed and the server refused."""
    settings = ServerSettings(docs=True)
    seed = value_schema(body_schema(document(settings))["properties"]["seed"])
    assert seed["maximum"] == 2**63 - 1 and isinstance(seed["maximum"], int)
    assert accepted({"prompt": "x", "num_inference_steps": 4, "seed": 2**63 - 1}, settings)
    assert not accepted({"prompt": "x", "num_inference_steps": 4, "seed": 2**63}, settings)


def test_every_documented_bound_is_the_one_applied():
    settings = ServerSettings(docs=True, max_n=3, max_steps=7, max_prompt_chars=50, max_side=64)
    properties = body_schema(document(settings))["properties"]
    bounds = {
        "n": ("maximum", 3),
        "num_inference_steps": ("maximum", 7),
        "prompt": ("maxLength", 50),
        "negative_prompt": ("maxLength", 50),
    }
    for field, (keyword, limit) in bounds.items():
        assert value_schema(properties[field])[keyword] == limit, field
        at, past = (limit, limit + 1) if keyword == "maximum" else ("y" * limit, "y" * (limit + 1))
        base = {"prompt": "x", "num_inference_steps": 4}
        assert accepted({**base, field: at}, settings) and not accepted({**base, field: past}, settings), field
    assert value_schema(properties["model"])["enum"] == ["krea-2"]
    assert accepted({"prompt": "x", "num_inference_steps": 4, "model": "krea-2"}, settings)
    assert not accepted({"prompt": "x", "num_inference_steps": 4, "model": "krea-3"}, settings)


SIZES = [
    "16x16", "64x64", "32x48", "auto", "80x16", "16x80", "17x16", "8x8", "0x0", "016x16", " 16x16", "16x16 ",
    "16X16", "16×16", "16 x 16", "١٦x١٦", "AUTO", "", "x", "16x", "16x16x16", "1e1x16",
]  # fmt: skip


@pytest.mark.parametrize("defaults", [RAW, Defaults("raw", 50, 4.5, 1024, 1024, 8)], ids=["fits", "too_large"])
def test_the_size_pattern_is_the_size_rule(defaults):
    """The server took sizes its schema did not state (spaces, 'X', '×', Unicode digits such as '١٦', leading
    zeros) and the schema's example (1024x1024) was past --max-side: now one expression says both."""
    settings = ServerSettings(docs=True, max_side=64)
    schema = body_schema(document(settings, Backend(defaults)))
    pattern = value_schema(schema["properties"]["size"])["pattern"]
    for size in SIZES:
        try:
            parse_size(size, settings, defaults)
            taken = True
        except ApiError as exc:
            assert exc.param == "size"
            taken = False
        assert taken == bool(re.search(pattern, size)), size
    assert re.search(pattern, schema["properties"]["size"]["examples"][0])
    assert ("size" in schema["required"]) == (defaults.width > 64)


def test_a_default_past_the_limits_makes_its_field_required():
    """The preset's 50 steps are past --max-steps 8: leaving the steps out is a 400 naming the field, and the
    schema lists it as required (not null either)."""
    settings = ServerSettings(docs=True, max_steps=8)
    schema = body_schema(document(settings))
    assert "num_inference_steps" in schema["required"]
    assert schema["properties"]["num_inference_steps"]["type"] == "integer"  # null is not allowed
    with pytest.raises(ApiError) as caught:
        resolve(ImageGenerationRequest(prompt="x"), settings, RAW, CacheConfig.defaults(), 10)
    assert caught.value.param == "num_inference_steps"
    assert "omitted, and its default 50" in caught.value.message and "--max-steps" in caught.value.message
    roomy = body_schema(document(ServerSettings(docs=True)))
    assert "num_inference_steps" not in roomy["required"]
    assert roomy["properties"]["num_inference_steps"]["default"] == 50  # the preset, stated


# ---------------------------------------------------------------------------------------------- JSON types
def test_an_integer_may_be_written_as_a_number_equal_to_it():
    """JSON Schema's "integer" admits 2.0, and the schema says "integer": the server refused it (n, seed, steps...,
    and cache_dit_params integers); a fraction, a boolean or a string is still refused."""
    settings = ServerSettings(max_steps=8)
    base = {"prompt": "x", "num_inference_steps": 2.0}
    for extra in ({"n": 2.0}, {"seed": 7.0}, {"output_compression": 50.0}, {"partial_images": 0.0}, {}):
        assert accepted({**base, **extra}, settings), extra
    for params in ({"max_warmup_steps": 2.0}, {"scm_compute_bins": [1.0], "scm_cache_bins": [1.0]}):
        assert accepted({**base, "cache_dit_params": params}, settings), params
    for extra in ({"n": 1.5}, {"n": True}, {"seed": "7"}, {"partial_images": 1.0}):
        assert not accepted({**base, **extra}, settings), extra


def test_a_list_of_numbers_takes_numbers():
    """teacache_coefficients and magcache_ratios were refused unless every item was an integer."""
    settings = ServerSettings(max_steps=8)
    params = {"teacache_coefficients": [1.5, -0.02], "magcache_ratios": [1.0, 0.98, 0.95]}
    assert accepted({"prompt": "x", "num_inference_steps": 2, "cache_dit_params": params}, settings)
    text = {"prompt": "x", "num_inference_steps": 2, "cache_dit_params": {"teacache_coefficients": "1.5,-0.02"}}
    assert not accepted(text, settings)  # the environment's comma-separated text is not a JSON list


def test_cache_dit_params_are_documented_key_by_key():
    """It was any object: each key now has its JSON type, range and this server's value; no other key; a choice
    is taken exactly as documented (it was lowercased: 'DBCache' passed)."""
    base = CacheConfig.defaults().merged({"residual_diff_threshold": 0.12, "enable_cache": True})
    schema = body_schema(document(ServerSettings(docs=True), Backend(cache_config=base)))
    params = value_schema(schema["properties"]["cache_dit_params"])
    assert params["additionalProperties"] is False and set(params["properties"]) == {s.key for s in SETTINGS}
    assert params["properties"]["residual_diff_threshold"]["default"] == 0.12
    assert params["properties"]["enable_cache"]["default"] is True
    assert params["properties"]["Fn_compute_blocks"]["maximum"] == 9  # the model's 10 blocks
    assert params["properties"]["policy"]["enum"][0] == "dbcache"
    settings = ServerSettings(max_steps=8)
    assert accepted({"prompt": "x", "num_inference_steps": 2, "cache_dit_params": {"policy": "dbcache"}}, settings)
    assert not accepted({"prompt": "x", "num_inference_steps": 2, "cache_dit_params": {"policy": "DBCache"}}, settings)


def test_openai_only_fields_state_their_single_value():
    properties = body_schema(document(ServerSettings(docs=True)))["properties"]
    assert properties["stream"]["anyOf"] == [{"const": False}, {"type": "null"}]
    assert properties["partial_images"]["anyOf"] == [{"const": 0}, {"type": "null"}]
    for field in ("frame_count", "frame_duration_ms", "svg"):
        assert properties[field]["anyOf"] == [{"type": "null"}], field


def test_a_server_step_mask_states_its_fewest_steps():
    """A rule between fields JSON Schema cannot state (the server's SGLANG_CACHE_DIT_SCM_PRESET needs 4 steps while
    caching) is said in words, with the number the check applies."""
    base = CacheConfig.defaults().merged({"enable_cache": True, "scm_preset": "fast"})
    steps = body_schema(document(ServerSettings(docs=True), Backend(cache_config=base)))["properties"]
    assert "at least 4" in steps["num_inference_steps"]["description"]
    for count, taken in ((3, False), (4, True)):
        try:
            resolve(ImageGenerationRequest(prompt="x", num_inference_steps=count), ServerSettings(), RAW, base, 10)
        except ApiError:
            assert not taken
        else:
            assert taken
    plain = body_schema(document(ServerSettings(docs=True)))["properties"]["num_inference_steps"]
    assert "step mask" not in plain["description"]
