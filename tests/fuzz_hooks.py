"""Schemathesis hooks of the schema fuzz (`tests/test_schema_fuzz.py`): loaded by the `schemathesis` command through
`SCHEMATHESIS_HOOKS=fuzz_hooks`, with `tests/` on its path.

- `openai_error_shape`, a check on every response: an answer >= 400 is OpenAI's error object (`error.message`,
  `error.type`, `error.param`, `error.code`); a 400 to a generation request names the field it is about (`param`,
  a field of the request, quoted in the message) or says that the body as a whole is not a JSON object.
- `map_case`, on the positive (schema-valid) generation requests only: the `cache_dit_params` settings are also
  checked against each other and against `num_inference_steps` (the rules between settings, which JSON Schema
  cannot state and the schema lists in words), so a generated override keeps, in its order, each key that is
  consistent with the ones kept before it, as the server judges it (`dicache.server.generation`). The server's
  cache settings and block count are read from the served schema itself (each key's default, the blocks bound).
  Negative cases are sent as generated.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.generation import GenerationMode

from dicache.server.errors import ApiError
from dicache.server.generation import check_step_mask, effective_cache_config
from dicache.settings.cache_config import CacheConfig

GENERATIONS = "/v1/images/generations"
WHOLE_BODY = (
    "malformed JSON body",
    "request body is not JSON",
    "request body must be a JSON object",
    "request body is missing",
    "invalid Content-Length header",
)
"""How a 400 about the body as a whole begins (no field to name)."""


@schemathesis.check
def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code < 400:
        return None
    try:
        error = response.json()["error"]
    except Exception:
        raise AssertionError(f"{response.status_code}: not OpenAI's error object: {response.text[:300]!r}") from None
    assert isinstance(error.get("message"), str) and error["message"], error
    assert isinstance(error.get("type"), str) and error["type"], error
    assert error.get("param") is None or isinstance(error["param"], str), error
    assert error.get("code") is None or isinstance(error["code"], str), error
    if response.status_code == 400 and case.path == GENERATIONS and case.method.upper() == "POST":
        param, message = error["param"], error["message"]
        if param is None:
            assert message.startswith(WHOLE_BODY), f"a 400 names no field: {message!r}"
        else:
            fields = body_schema(case)["properties"]
            sent = case.body if isinstance(case.body, dict) else {}
            named = param in fields or any(key[:100] == param for key in sent)  # a long name is cut to 100
            assert named, f"param {param!r} is not a field of the request"
            assert param in message or repr(param)[1:-1] in message, f"the message does not name {param!r}"
    return None


def body_schema(case: Any) -> dict[str, Any]:
    """The generation body's schema as the server serves it (the loaded document, not the generator's copy)."""
    operation = case.operation.schema.raw_schema["paths"][GENERATIONS]["post"]
    return operation["requestBody"]["content"]["application/json"]["schema"]


_SERVER_CACHE: dict[int, tuple[CacheConfig, int | None]] = {}


def server_cache(case: Any) -> tuple[CacheConfig, int | None]:
    """The server's cache settings (each `cache_dit_params` key's default) and its model's blocks (the
    `Fn_compute_blocks` bound), from the served schema."""
    schema = body_schema(case)
    key = id(schema)
    if key not in _SERVER_CACHE:
        params = next(b for b in schema["properties"]["cache_dit_params"]["anyOf"] if b.get("type") == "object")
        values = {name: prop.get("default") for name, prop in params["properties"].items()}  # absent: null
        blocks = params["properties"]["Fn_compute_blocks"].get("maximum")
        _SERVER_CACHE[key] = (CacheConfig.defaults().merged(values), None if blocks is None else blocks + 1)
    return _SERVER_CACHE[key]


def consistent(overrides: dict[str, Any], base: CacheConfig, blocks: int | None, steps: int) -> bool:
    """Whether the server takes these overrides together (`resolve`'s cache checks)."""
    try:
        effective = effective_cache_config(overrides, base, blocks)
        if effective.enable_cache:
            check_step_mask(effective, steps, {k: v for k, v in overrides.items() if k != "enable_cache"})
    except ApiError:
        return False
    return True


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    meta = case.meta
    if (
        case.path != GENERATIONS
        or meta is None
        or meta.generation.mode != GenerationMode.POSITIVE
        or not isinstance(case.body, dict)
        or not isinstance(case.body.get("cache_dit_params"), dict)
    ):
        return case
    base, blocks = server_cache(case)
    properties = body_schema(case)["properties"]
    steps = case.body.get("num_inference_steps") or properties["num_inference_steps"]["default"]
    top = case.body.get("enable_cache")  # wins over the key in cache_dit_params (`resolve`)
    kept: dict[str, Any] = {}
    for key, value in case.body["cache_dit_params"].items():
        trial = {**kept, key: value}
        if consistent(trial if top is None else {**trial, "enable_cache": top}, base, blocks, steps):
            kept = trial
    case.body = {**case.body, "cache_dit_params": kept}
    return case
