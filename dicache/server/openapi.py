"""The server's OpenAPI document (`/openapi.json`, served with `--docs`), made to state what this server does.

- The generation body carries this server's bounds, taken from the declarations the checks use (`REQUEST_BOUNDS`,
  `SizeRule`); a field whose default is past them (a preset of 50 steps with `--max-steps 8`) is required.
- `cache_dit_params` lists every cache setting with its JSON type and range, from `CacheConfig`'s declarations, and
  this server's value as its default; the rules between settings, which JSON Schema cannot state, are in its
  description (a request breaking one is a 400 naming `cache_dit_params`).
- Every status an endpoint can answer is listed (`responses`) with its content type, body and headers: OpenAI's
  error shape, `Retry-After` on 429 / 503, `WWW-Authenticate` on 401; `/metrics` is Prometheus text.
- With an API key, the protected endpoints declare bearer security (and 401). FastAPI's own 422 entries are
  removed: this server answers a request it cannot validate with 400 (`errors`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ..settings.cache_config import CacheConfig
from .auth import is_protected
from .errors import ApiError
from .generation import REQUEST_BOUNDS, Defaults, SizeRule, check_step_mask, default_breaks_bound
from .schemas import ErrorResponse, ImageGenerationRequest
from .settings import ServerSettings

SECURITY_SCHEME = "bearer"
_COMPONENTS = "#/components/schemas/{model}"
_ERROR_REF = {"$ref": _COMPONENTS.format(model=ErrorResponse.__name__)}
"""Errors are JSON whatever the endpoint's own content type (`/metrics` is text): the schema is referenced, not
given as FastAPI's `model`, which would file it under the endpoint's content type."""

_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}
_WWW_AUTHENTICATE = {"WWW-Authenticate": {"description": "the expected scheme: Bearer", "schema": {"type": "string"}}}


def error_descriptions(settings: ServerSettings) -> dict[int, str]:
    """What each error status means on this server, in words (limits included)."""
    return {
        400: "a bad request: the message names the field, the value given and what is allowed",
        401: "a missing or wrong API key ('Authorization: Bearer <key>')",
        404: "no such model here",
        408: f"the request body did not arrive within {settings.body_timeout_s:g} s (server option --body-timeout)",
        413: f"the request body is over {settings.max_body_bytes} bytes (server option --max-body-bytes)",
        429: f"the queue is full ({settings.max_queue} requests waiting; server option --max-queue): retry later",
        503: "the server is shutting down (drain), or cannot serve the request now: retry later",
        504: f"the request was not answered within {settings.request_timeout_s:g} s, waiting included (server option "
        "--timeout); its generation was stopped",
    }


def responses(settings: ServerSettings, path: str, codes: Iterable[int]) -> dict[int | str, dict[str, Any]]:
    """The error answers of the endpoint at `path` (FastAPI's `responses=`): `codes`, plus 401 where the API key
    protects it, each in OpenAI's error shape with its headers."""
    codes = set(codes)
    if settings.api_key and is_protected(path, settings.protect_metrics):
        codes.add(401)
    words = error_descriptions(settings)
    documented: dict[int | str, dict[str, Any]] = {}
    for code in sorted(codes):
        entry: dict[str, Any] = {"description": words[code], "content": {"application/json": {"schema": _ERROR_REF}}}
        if code in (429, 503):
            entry["headers"] = _RETRY_AFTER
        elif code == 401:
            entry["headers"] = _WWW_AUTHENTICATE
        documented[code] = entry
    return documented


def generation_request_schema(
    settings: ServerSettings, defaults: Defaults, base: CacheConfig, num_blocks: int | None
) -> dict[str, Any]:
    """The JSON Schema of `POST /v1/images/generations`'s body on this server."""
    schema = ImageGenerationRequest.model_json_schema()
    properties = schema["properties"]
    required = set(schema.get("required", []))
    for bound in REQUEST_BOUNDS:
        _value_schema(properties[bound.field])[bound.keyword] = bound.limit(settings)
    properties["num_inference_steps"]["default"] = defaults.num_inference_steps  # the served variant's preset
    fewest = fewest_masked_steps(base, settings.max_steps)
    if fewest is not None:  # a rule between fields (caching on, this server's mask): in words
        properties["num_inference_steps"]["description"] += (
            f" With this server's step mask (caching on) at least {fewest}; fewer with enable_cache false."
        )
    properties["guidance_scale"]["default"] = defaults.guidance_scale
    for bound in REQUEST_BOUNDS:
        if default_breaks_bound(bound, settings, defaults):
            required.add(bound.field)
            _without_null(properties, bound.field)
    rule = SizeRule.of(settings, defaults)
    size = _value_schema(properties["size"])
    size["pattern"] = rule.pattern
    example = rule.default if rule.fits(*rule.default) else (rule.sides[0], rule.sides[0])
    properties["size"]["examples"] = [f"{example[0]}x{example[1]}"]
    if not rule.fits(*rule.default):
        required.add("size")
        _without_null(properties, "size")
    _value_schema(properties["model"])["enum"] = [settings.model_id]
    properties["cache_dit_params"] = {
        "anyOf": [cache_params_schema(base, num_blocks), {"type": "null"}],
        "default": None,
        "description": properties["cache_dit_params"]["description"],
    }
    schema["required"] = sorted(required, key=list(properties).index)
    return schema


def fewest_masked_steps(base: CacheConfig, max_steps: int) -> int | None:
    """The fewest steps this server's own step mask takes when a request caches (`check_step_mask`), or None
    when it has no mask or caching is off by default."""
    if not (base.enable_cache and base.has_step_mask):
        return None
    for steps in range(1, max_steps + 1):
        try:
            check_step_mask(base, steps, {})
        except ApiError:
            continue
        return steps
    return None


CROSS_RULES = (
    "Settings are also checked together, as the engine checks them (a 400 naming cache_dit_params): "
    "Fn_compute_blocks + Bn_compute_blocks < the model's blocks; cached_step_blocks within [Fn, blocks - Bn) and "
    "fewer than them; scm_compute_bins and scm_cache_bins set together (compute with as many runs as cache or one "
    "more), not with scm_preset, summing to num_inference_steps; a preset needs num_inference_steps >= 4; a "
    "forecaster other than taylor needs enable_taylorseer; enable_dmd excludes enable_taylorseer; policies teacache, "
    "magcache and easycache need scm_policy dynamic; teacache needs Fn_compute_blocks >= 1; magcache needs "
    "magcache_ratios; Fn_compute_blocks 0 needs a static step mask. Unset keys keep this server's values (each "
    "key's default here)."
)


def cache_params_schema(base: CacheConfig, num_blocks: int | None) -> dict[str, Any]:
    """`cache_dit_params` as JSON Schema: each cache setting (`CacheConfig`'s declaration) with its exact JSON type
    and range, its default this server's value (`base`), no other key."""
    declared = CacheConfig.model_json_schema()["properties"]
    values = base.model_dump(mode="json")
    properties = {}
    for key, field_schema in declared.items():
        entry = {k: v for k, v in field_schema.items() if k not in ("env", "short", "allowed", "title")}
        entry["default"] = values[key]
        properties[key] = entry
    if num_blocks is not None:
        for key in ("Fn_compute_blocks", "Bn_compute_blocks"):
            properties[key]["maximum"] = num_blocks - 1
        blocks = _value_schema(properties["cached_step_blocks"])
        blocks["items"]["maximum"] = num_blocks - 1
    _value_schema(properties["cached_step_blocks"])["uniqueItems"] = True
    coefficients = _value_schema(properties["teacache_coefficients"])  # 1 to 8, never null (`CacheConfig`'s rule)
    properties["teacache_coefficients"] = {**coefficients, "maxItems": 8, "default": values["teacache_coefficients"]}
    properties["teacache_coefficients"]["description"] = declared["teacache_coefficients"]["description"]
    return {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "description": CROSS_RULES,
    }


def _without_null(properties: dict[str, Any], name: str) -> None:
    """Field `name` required and not null (null means its default, which this server refuses)."""
    prop = properties[name]
    value = _value_schema(prop)
    properties[name] = {
        **{k: v for k, v in prop.items() if k not in ("anyOf", "default")},
        **value,
        "description": prop.get("description", ""),
    }


def _value_schema(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of an optional field's schema (`anyOf: [X, null]`), or the schema itself."""
    for branch in prop.get("anyOf", ()):
        if branch.get("type") != "null":
            return branch
    return prop


def install_openapi(app: FastAPI, settings: ServerSettings, bodies: dict[str, dict[str, Any]]) -> None:
    """Replace `app.openapi` with the document described in the module docstring (built once, on first use).
    `bodies`: the JSON Schema of each POST endpoint's body, by path, put in as given (FastAPI's document model
    would turn integer bounds into floats, e.g. a seed bound of 2**63 - 1 into 2**63, and drop null defaults)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = _truthful(copy.deepcopy(document), settings, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a JSON body with `schema`."""
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _truthful(document: dict[str, Any], settings: ServerSettings, bodies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template=_COMPONENTS)
    schemas.update(error_schema.pop("$defs", {}))
    schemas[ErrorResponse.__name__] = error_schema
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            operation.get("responses", {}).pop("422", None)
            if settings.api_key and is_protected(path, settings.protect_metrics):
                operation["security"] = [{SECURITY_SCHEME: []}]
            if method == "post" and path in bodies:
                operation["requestBody"] = request_body(copy.deepcopy(bodies[path]))
    if settings.api_key:
        components["securitySchemes"] = {
            SECURITY_SCHEME: {"type": "http", "scheme": "bearer", "description": "the server's API key"}
        }
    return document
