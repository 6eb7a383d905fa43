"""`dicache serve`: a live server on loopback, driven with the official `openai` client and with raw HTTP.

The served model is the real native `Krea2Pipeline` (the embedded checkpoint when it ships, else a tiny random one
built here with diffusers' classes). Torch runs one thread per op so that two workers really run side by side.
"""

from __future__ import annotations

import base64
import io
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from server_helpers import (
    GatedBackend,
    backend_with_env,
    decode_png,
    dumps,
    metrics_text_to_dict,
    pipeline_source,
    post_request,
    raw_http,
    wait_until,
)

import dicache
from dicache.cli import main as cli_main
from dicache.models.krea2 import Krea2Pipeline
from dicache.server import ServerSettings, create_app
from dicache.server.background import BackgroundServer
from dicache.server.jobs import JobQueue, QueueFullError, ShuttingDownError

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

GENERATIONS = "/v1/images/generations"
ENV = {
    "SGLANG_CACHE_DIT_ENABLED": "true",
    "SGLANG_CACHE_DIT_WARMUP": "2",
    "SGLANG_CACHE_DIT_RDT": "0.5",
    "SGLANG_CACHE_DIT_MC": "2",
}
SETTINGS = ServerSettings(
    workers=2, max_queue=16, max_n=2, max_side=64, max_steps=60, max_prompt_chars=200, max_body_bytes=8192
)

# Turbo-style (guidance 1: one branch) and Raw-style (CFG: cond + uncond) requests, with per-request cache settings.
CASES = {
    "turbo": dict(prompt="a red fox", size="32x32", num_inference_steps=8, guidance_scale=1.0, seed=1),
    "raw": dict(
        prompt="a blue car in the snow", negative_prompt="sun", size="48x32", num_inference_steps=10,
        guidance_scale=4.5, seed=2,
    ),
    "raw_taylorseer": dict(
        prompt="a green tree", size="32x48", num_inference_steps=12, guidance_scale=3.0, seed=3,
        cache_dit_params={"enable_taylorseer": True, "residual_diff_threshold": 0.8, "max_warmup_steps": 3},
    ),
    "turbo_mask": dict(
        prompt="a smiling face", size="32x32", n=2, num_inference_steps=12, guidance_scale=1.0, seed=4,
        cache_dit_params={"scm_preset": "fast", "scm_policy": "static", "max_warmup_steps": 0},
    ),
    "turbo_uncached": dict(
        prompt="a red fox", size="32x32", num_inference_steps=6, guidance_scale=1.0, seed=5, enable_cache=False
    ),
    "raw_capped": dict(
        prompt="a cat with a dog", size="32x32", num_inference_steps=6, guidance_scale=2.0, seed=6,
        cache_dit_params={"max_cached_steps": 1, "max_warmup_steps": 1},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def model_source(tmp_path_factory):
    return pipeline_source(tmp_path_factory.mktemp("krea2"))


@pytest.fixture(scope="module")
def backend(model_source):
    """The real backend, its cache settings read from SGLANG_CACHE_DIT_* at start-up (as `dicache serve` does)."""
    return backend_with_env(model_source, ENV)


@pytest.fixture(scope="module")
def server(backend):
    with BackgroundServer(create_app(backend, SETTINGS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


_http = httpx.Client(timeout=120)  # one keep-alive connection pool for the module's plain HTTP calls


def post(server, body):
    return _http.post(server.url + GENERATIONS, json=body)


def metrics_of(server) -> dict[tuple[str, tuple], float]:
    return metrics_text_to_dict(_http.get(server.url + "/metrics").text)


# ---------------------------------------------------------------------------------------------- happy path
def test_openai_client_round_trip(server, client, backend):
    assert [m.id for m in client.models.list()] == ["krea-2"]
    kwargs = dict(model="krea-2", prompt="a red fox", n=2, size="48x32", response_format="b64_json")
    first = client.images.generate(**kwargs, extra_body={"seed": 7, "num_inference_steps": 6})
    assert len(first.data) == 2
    images = [decode_png(d.b64_json) for d in first.data]
    assert images[0].shape == (32, 48, 3) and not (images[0] == images[1]).all()  # two noises, two images

    generation, stats = first.model_extra["generation"], first.model_extra["cache_stats"]
    assert generation["seed"] == 7 and generation["num_inference_steps"] == 6 and generation["n"] == 2
    preset = backend.defaults  # the checkpoint's variant (turbo for the tiny distilled one: guidance 1, no CFG)
    assert generation["variant"] == preset.variant and generation["guidance_scale"] == preset.guidance_scale
    assert generation["enable_cache"] is True  # SGLANG_CACHE_DIT_ENABLED=true at start-up
    branches = ["cond", "uncond"] if preset.guidance_scale > 1 else ["cond"]
    assert stats["enabled"] and stats["num_steps"] == 6 and list(stats["branches"]) == branches
    assert stats["branches"]["cond"]["computed_steps"][:2] == [0, 1]  # SGLANG_CACHE_DIT_WARMUP=2
    assert (
        stats["branches"]["cond"]["reasons"]["1"] == "warmup" and stats["branches"]["cond"]["reasons"]["2"] != "warmup"
    )

    again = client.images.generate(**kwargs, extra_body={"seed": 7, "num_inference_steps": 6})
    assert [d.model_extra["sha256"] for d in again.data] == [d.model_extra["sha256"] for d in first.data]
    other = client.images.generate(**kwargs, extra_body={"seed": 8, "num_inference_steps": 6})
    assert other.data[0].model_extra["sha256"] != first.data[0].model_extra["sha256"]

    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # minimal: details are in server_info
    head = httpx.head(server.url + "/health")  # load balancers probe with HEAD too
    assert head.status_code == 200 and head.content == b""
    info = httpx.get(server.url + "/v1/server_info").json()
    assert info["status"] == "ok" and info["cache"]["enabled_by_default"] is True
    assert info["cache"]["sources"]["max_warmup_steps"] == "env SGLANG_CACHE_DIT_WARMUP"
    assert info["cache"]["settings"]["residual_diff_threshold"] == 0.5
    assert info["limits"]["max_n"] == 2 and info["limits"]["api_key_set"] is False
    assert len(info["gc"]["collections"]) == 3 and len(info["gc"]["pause_s"]) == 3  # the collector's pauses


def engine_run(pipe, case, variant):
    """The same generation through the engine directly: `dicache.request` scope + the native pipeline."""
    overrides = {**case.get("cache_dit_params", {}), "enable_cache": case.get("enable_cache", True)}
    width, height = (int(v) for v in case["size"].split("x"))
    with torch.inference_mode(), dicache.request(pipe, config=overrides):
        out = pipe(
            case["prompt"], negative_prompt=case.get("negative_prompt"), height=height, width=width,
            num_inference_steps=case["num_inference_steps"], guidance_scale=case.get("guidance_scale", 1.0),
            seed=case["seed"], num_images_per_prompt=case.get("n", 1), output_type="np", variant=variant,
        )  # fmt: skip
    return out.images, dicache.stats(pipe).to_dict()


def test_turbo_and_raw_requests_cache_exactly_as_the_engine_does(server, backend, model_source):
    """Each request's image and cache statistics equal a direct engine run with the environment's config merged
    with the request's overrides; CFG requests keep a cond and an uncond branch, Turbo-style requests one."""
    import hashlib

    reference = Krea2Pipeline.from_pretrained(model_source, device="cpu")
    dicache.enable(reference, backend.cache_config)
    plain = Krea2Pipeline.from_pretrained(model_source, device="cpu")  # never cache-enabled
    plain.set_progress_bar_config(disable=True)
    reference.set_progress_bar_config(disable=True)
    for name, case in CASES.items():
        response = post(server, case)
        assert response.status_code == 200, response.text
        body = response.json()
        images, stats = engine_run(reference, case, backend.defaults.variant)
        assert [d["sha256"] for d in body["data"]] == [hashlib.sha256(i.tobytes()).hexdigest() for i in images], name
        assert body["cache_stats"] == stats, name
        cfg = case.get("guidance_scale", 1.0) > 1.0
        assert set(stats["branches"]) == ({"cond", "uncond"} if cfg else {"cond"}), name
        assert stats["num_steps"] == case["num_inference_steps"], name
        if name == "turbo_uncached":
            assert stats["enabled"] is False and stats["cached_calls"] == 0
            with torch.inference_mode():
                out = plain(
                    case["prompt"], height=32, width=32, num_inference_steps=6, guidance_scale=1.0, seed=5,
                    output_type="np",
                    variant=backend.defaults.variant,
                )  # fmt: skip
            assert body["data"][0]["sha256"] == hashlib.sha256(out.images[0].tobytes()).hexdigest()  # off means off
        else:
            assert stats["cached_calls"] > 0, name
    mask = dicache.engine.policies.preset_mask("fast", 12)
    turbo_mask = post(server, CASES["turbo_mask"]).json()["cache_stats"]["branches"]["cond"]
    assert turbo_mask["cached_steps"] == [i for i, m in enumerate(mask) if m == 0]
    capped = post(server, CASES["raw_capped"]).json()["cache_stats"]["branches"]
    assert all(len(b["cached_steps"]) == 1 for b in capped.values())  # max_cached_steps=1 per branch


def test_mixed_concurrent_requests_are_bitwise_identical_to_solo_runs(server, client):
    """Every mode, fired together (two workers, a queue, the openai client and raw HTTP mixed), gives the very
    bytes and cache statistics it gives alone."""
    solo = {name: post(server, case).json() for name, case in CASES.items()}
    jobs = [name for name in CASES for _ in range(2)]
    random.Random(0).shuffle(jobs)
    barrier = threading.Barrier(len(jobs))
    peak = {"running": 0, "waiting": 0}
    done = threading.Event()

    def monitor():
        while not done.is_set():
            queue = httpx.get(server.url + "/v1/server_info").json()["queue"]
            peak["running"] = max(peak["running"], queue["running"])
            peak["waiting"] = max(peak["waiting"], queue["waiting"])
            time.sleep(0.01)

    def fire(index_name):
        index, name = index_name
        case = dict(CASES[name])
        barrier.wait()
        if index % 2:
            return post(server, case).json()
        extra = {k: case.pop(k) for k in list(case) if k not in ("prompt", "size", "n")}
        return client.images.generate(**case, extra_body=extra).model_dump()

    watcher = threading.Thread(target=monitor)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(fire, enumerate(jobs)))
    finally:
        done.set()
        watcher.join()
    assert peak["running"] == 2 and peak["waiting"] >= 1  # really concurrent, and really queued
    for name, result in zip(jobs, results):
        assert [(d["b64_json"], d["sha256"]) for d in result["data"]] == [
            (d["b64_json"], d["sha256"]) for d in solo[name]["data"]
        ], name
        assert result["cache_stats"] == solo[name]["cache_stats"], name


# ---------------------------------------------------------------------------------------------- bad input
BAD_REQUESTS = [
    (dict(prompt="x", size="40x40"), "size", ["size='40x40'", "multiple of 16", "between 16 and 64"]),
    (dict(prompt="x", size="128x128"), "size", ["size='128x128'", "between 16 and 64"]),
    (dict(prompt="x", size="big"), "size", ["size='big'", "WIDTHxHEIGHT"]),
    (dict(prompt="x", n=3), "n", ["n=3", "between 1 and 2"]),
    (dict(prompt="x", n=0), "n", ["n=0", "greater than or equal to 1"]),
    (dict(prompt="x", num_inference_steps=61), "num_inference_steps", ["num_inference_steps=61", "between 1 and 60"]),
    (dict(prompt="x", num_inference_steps=2.5), "num_inference_steps", ["num_inference_steps=2.5", "integer"]),
    (dict(prompt="x", guidance_scale=0.5), "guidance_scale", ["guidance_scale=0.5", "greater than or equal to 1"]),
    (dict(prompt="x", seed=-1), "seed", ["seed=-1", "greater than or equal to 0"]),
    (dict(prompt="x", seed=2**64), "seed", ["seed=18446744073709551616", "less than or equal to"]),
    (dict(prompt=""), "prompt", ["prompt=''", "at least 1 character"]),
    (dict(size="32x32"), "prompt", ["prompt is required"]),
    (dict(prompt="x" * 201), "prompt", ["prompt is 201 characters long", "the limit is 200"]),
    (dict(prompt="x", negative_prompt="y" * 300), "negative_prompt", ["negative_prompt is 300 characters long"]),
    (dict(prompt=["a", "b"]), "prompt", ["prompt=['a', 'b']", "valid string"]),
    (dict(prompt="x", model="dall-e-3"), "model", ["model='dall-e-3' is not served here", "'krea-2'"]),
    (dict(prompt="x", response_format="url"), "response_format", ["response_format='url'", "'b64_json'"]),
    (dict(prompt="x", colour="red"), "colour", ["unknown field 'colour'", "accepted fields: model, prompt"]),
    (dict(prompt="x", enable_cache="maybe"), "enable_cache", ["enable_cache='maybe'", "boolean"]),
    # issue 18 defect 7: strict numbers and booleans, as OpenAI's API has them
    (dict(prompt="x", n=True), "n", ["n=True is invalid", "integer"]),
    (dict(prompt="x", n=1.5), "n", ["n=1.5 is invalid", "integer"]),  # 1.0 is the JSON number 1: accepted
    (dict(prompt="x", guidance_scale="4.5"), "guidance_scale", ["guidance_scale='4.5' is invalid", "number"]),
    (dict(prompt="x", guidance_scale=True), "guidance_scale", ["guidance_scale=True is invalid", "number"]),
    (dict(prompt="x", enable_cache="yes"), "enable_cache", ["enable_cache='yes' is invalid", "boolean"]),
    (dict(prompt="x", enable_cache=1), "enable_cache", ["enable_cache=1 is invalid", "boolean"]),
    (dict(prompt="x", seed="7"), "seed", ["seed='7' is invalid", "integer"]),
    (dict(prompt="x", num_inference_steps="8"), "num_inference_steps", ["num_inference_steps='8'", "integer"]),
    # issue 18 defect 8: OpenAI values that cannot be honoured say why
    (dict(prompt="x", background="transparent"), "background", ["background='transparent'", "no alpha channel"]),
    (dict(prompt="x", output_format="gif"), "output_format", ["output_format='gif'", "png, jpeg or webp"]),
    (dict(prompt="x", output_format="bmp"), "output_format", ["output_format='bmp'", "'png', 'jpeg' or 'webp'"]),
    (dict(prompt="x", output_compression=101), "output_compression", ["output_compression=101", "less than"]),
    (dict(prompt="x", stream=True), "stream", ["stream=True", "does not stream"]),
    (dict(prompt="x", partial_images=2), "partial_images", ["partial_images=2", "streaming"]),
    (dict(prompt="x", quality="ultra"), "quality", ["quality='ultra'", "'low'"]),
    # issue 18 defects 1 and 6: found before queueing, naming the field
    (
        dict(prompt="x", cache_dit_params={"scm_compute_bins": [400000000], "scm_cache_bins": [1]}),
        "cache_dit_params",
        ["'scm_compute_bins'=[400000000] is invalid", "integers in [1, 10000]"],
    ),
    (
        dict(prompt="x", cache_dit_params={"scm_compute_bins": "[" * 5000, "scm_cache_bins": [1]}),
        "cache_dit_params",
        ["'scm_compute_bins'='[[[", "(5002 characters) is invalid"],
    ),
    (
        dict(prompt="x", num_inference_steps=8, cache_dit_params={"scm_compute_bins": [2, 1], "scm_cache_bins": [3]}),
        "cache_dit_params",
        ["cover 6 steps", "num_inference_steps=8"],
    ),
    (
        dict(prompt="x", num_inference_steps=3, cache_dit_params={"scm_preset": "fast"}),
        "cache_dit_params",
        ["scm_preset='fast' needs num_inference_steps >= 4", "the request has 3"],
    ),
    (dict(prompt="x", cache_dit_params=[1]), "cache_dit_params", ["cache_dit_params=[1]", "object"]),
    (dict(prompt="x", cache_dit_params={"foo": 1}), "cache_dit_params", ["'foo'", "allowed keys: enable_cache"]),
    (
        dict(prompt="x", cache_dit_params={"residual_diff_threshold": -1}),
        "cache_dit_params",
        ["'residual_diff_threshold'=-1 is invalid", "a number >= 0"],
    ),
    (
        dict(prompt="x", cache_dit_params={"taylorseer_order": 3}),
        "cache_dit_params",
        ["'taylorseer_order'=3", "1 or 2"],
    ),
    (
        dict(prompt="x", cache_dit_params={"Fn_compute_blocks": 99}),
        "cache_dit_params",
        ["Fn_compute_blocks=99", "at least one middle block"],
    ),
    (dict(prompt="x", cache_dit_params={"scm_compute_bins": [2, 2]}), "cache_dit_params", ["set together"]),
    (dict(prompt="x", cache_dit_params={"enable_cache": "sometimes"}), "cache_dit_params", ["'sometimes'", "boolean"]),
    # issue 18 defect 7 inside cache_dit_params: JSON values are strict too (they used to be converted)
    (
        dict(prompt="x", cache_dit_params={"enable_cache": "yes"}),
        "cache_dit_params",
        ["'enable_cache'='yes' is invalid", "a JSON boolean (true or false), got a string"],
    ),
    (
        dict(prompt="x", cache_dit_params={"residual_diff_threshold": "0.2"}),
        "cache_dit_params",
        ["'residual_diff_threshold'='0.2' is invalid", "a JSON number, got a string"],
    ),
    (
        dict(prompt="x", cache_dit_params={"max_warmup_steps": True}),
        "cache_dit_params",
        ["'max_warmup_steps'=True is invalid", "a JSON integer, got a boolean"],
    ),
    (
        dict(prompt="x", cache_dit_params={"max_warmup_steps": 2.5}),
        "cache_dit_params",
        ["'max_warmup_steps'=2.5 is invalid", "a JSON integer, got a number"],
    ),
    (
        dict(prompt="x", cache_dit_params={"taylorseer_order": "2"}),
        "cache_dit_params",
        ["'taylorseer_order'='2' is invalid", "1 or 2, got a string"],
    ),
    (
        dict(prompt="x", cache_dit_params={"scm_compute_bins": [True, 1], "scm_cache_bins": [1]}),
        "cache_dit_params",
        ["'scm_compute_bins'=[True, 1] is invalid", "a JSON list of integers"],
    ),
]


@pytest.mark.parametrize("body, param, expected", BAD_REQUESTS, ids=[f"{i}-{c[1]}" for i, c in enumerate(BAD_REQUESTS)])
def test_bad_field_is_a_400_naming_field_value_and_allowed(server, body, param, expected):
    before = metrics_of(server)
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    for text in expected:
        assert text in error["message"], (text, error["message"])
    assert _http.get(server.url + "/health").status_code == 200
    after = metrics_of(server)
    for outcome in ("ok", "failed", "stopped"):  # refused before it was queued: no worker ever saw it
        key = ("dicache_generations_total", (("outcome", outcome),))
        assert after[key] == before[key], outcome


def test_server_mask_too_short_for_the_request_is_a_400_on_num_inference_steps(backend):
    """A step mask set by the server (SGLANG_CACHE_DIT_SCM_*) that a request's step count does not fit is found
    before queueing and names num_inference_steps (it used to fail in the worker with param null)."""
    from dicache.server.errors import ApiError
    from dicache.server.generation import resolve
    from dicache.server.schemas import ImageGenerationRequest

    config = backend.cache_config.merged({"scm_preset": "fast"})
    request = ImageGenerationRequest(prompt="x", num_inference_steps=3)
    with pytest.raises(ApiError) as caught:
        resolve(request, SETTINGS, backend.defaults, config, backend.num_blocks)
    assert caught.value.status == 400 and caught.value.param == "num_inference_steps"
    assert "scm_preset='fast' needs num_inference_steps >= 4" in caught.value.message
    assert "SGLANG_CACHE_DIT_SCM_*" in caught.value.message
    uncached = ImageGenerationRequest(prompt="x", num_inference_steps=3, enable_cache=False)
    assert resolve(uncached, SETTINGS, backend.defaults, config, backend.num_blocks).num_inference_steps == 3


@pytest.mark.parametrize(
    "overrides",
    [
        {"cached_step_blocks": list(range(1000, 101_000))},  # not middle blocks
        {"cached_step_blocks": [1] * 100_000},  # repeated
        {"scm_compute_bins": [1] * 1000, "scm_cache_bins": [1] * 1000},  # too short for the step count
    ],
    ids=["outside", "repeated", "bins-too-short"],
)
def test_a_long_list_in_cache_dit_params_gives_a_short_error(backend, overrides):
    """The 400 quotes a long list clipped (it used to quote it whole: a 0.7 MB body gave a 1.4 MB error)."""
    from dicache.server.errors import ApiError
    from dicache.server.generation import resolve
    from dicache.server.schemas import ImageGenerationRequest

    settings = SETTINGS.model_copy(update={"max_steps": 5000})
    request = ImageGenerationRequest(
        prompt="x", num_inference_steps=4000, enable_cache=True, cache_dit_params=overrides
    )
    with pytest.raises(ApiError) as caught:
        resolve(request, settings, backend.defaults, backend.cache_config, backend.num_blocks)
    assert caught.value.param == "cache_dit_params" and "characters)" in caught.value.message
    assert len(caught.value.message) < 1000, caught.value.message[:300]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "k" * 500_000: 1},  # one huge unknown field name
        {"prompt": "x", **{f"k{i}": 1 for i in range(50_000)}},  # many unknown fields
        {"prompt": "x", "cache_dit_params": {"k" * 500_000: 1}},  # one huge unknown cache key
        {"prompt": "x", "cache_dit_params": {f"k{i}": 1 for i in range(50_000)}},  # many unknown cache keys
    ],
    ids=["long-name", "many-fields", "long-cache-key", "many-cache-keys"],
)
def test_unknown_names_give_a_short_error(backend, body):
    """A 0.5 MB body of unknown names gets a short 400 (it got up to 17 MB: each name quoted whole, each with the
    list of accepted fields)."""
    from dicache.server.errors import ApiError, describe_validation_error
    from dicache.server.generation import resolve
    from dicache.server.schemas import ImageGenerationRequest

    try:
        request = ImageGenerationRequest.model_validate_json(dumps(body))
    except ValueError as exc:
        message, param = describe_validation_error(exc.errors())
    else:
        with pytest.raises(ApiError) as caught:
            resolve(request, SETTINGS, backend.defaults, backend.cache_config, backend.num_blocks)
        message, param = caught.value.message, caught.value.param
    assert "unknown" in message and len(message) < 2000 and len(param or "") <= 100, message[:300]


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b'{"prompt": "x",', "malformed JSON body"),
        (b'{"prompt": NaN}', "prompt=nan"),
        (b'{"prompt": "x", "guidance_scale": Infinity}', "guidance_scale=inf is invalid"),
        (b"[1, 2]", "request body must be a JSON object"),
        (b'"a fox"', "request body must be a JSON object"),
        (b"", "request body is missing"),
        (b"\xff\xfe\x00", "malformed JSON body"),
        (b"prompt=a+fox", "Content-Type: application/json"),
        # issue 18 defect 6: these were "could not be decoded (send UTF-8)"
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "malformed JSON body: number out of range at line 1"),
        (b'{"prompt": "x", "cache_dit_params": ' + b"[" * 5000, "malformed JSON body: recursion limit exceeded"),
    ],
    ids=["truncated", "nan-prompt", "inf", "array", "string", "empty", "not-utf8", "form", "5000-digits", "deep"],
)
def test_malformed_bodies_are_400_over_raw_http(server, raw, expected):
    content_type = "application/x-www-form-urlencoded" if raw.startswith(b"prompt=") else "application/json"
    status, body = raw_http(server.host, server.port, post_request(GENERATIONS, raw, content_type))
    assert status == 400 and expected in body.decode(), body


@pytest.mark.parametrize(
    "raw, key, param",
    [
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "seed", "seed"),
        (b'{"prompt": "x",\n "n": ' + b"1" * 5000 + b"}", "n", "n"),
        (b'{"prompt": "x", "cache_dit_params": {"max_warmup_steps": ' + b"9" * 5000 + b"}}", "max_warmup_steps", None),
    ],
    ids=["seed", "second-line", "nested"],
)
def test_a_number_too_long_to_parse_names_its_field(server, raw, key, param):
    """Issue 18 defect 6: a 5000-digit integer is refused by the JSON parser; the 400 names the key it was for."""
    response = _http.post(server.url + GENERATIONS, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "number out of range" in error["message"] and f"(the value of {key!r})" in error["message"]
    assert error["param"] == param


def test_oversize_and_unknown_requests_are_refused_cleanly(server, client):
    big = dumps({"prompt": "x", "negative_prompt": "y" * 10_000})
    status, body = raw_http(server.host, server.port, post_request(GENERATIONS, big))
    assert status == 413 and b"the limit is 8192 bytes" in body

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(20):
            yield b" " * 1000

    chunked = httpx.post(server.url + GENERATIONS, content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "more than 8192 bytes" in chunked.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + GENERATIONS).status_code == 405
    assert httpx.get(server.url + "/v1/models/dall-e-3").status_code == 404
    with pytest.raises(openai.BadRequestError, match="size='33x33' is invalid"):
        client.images.generate(prompt="x", size="33x33")
    ok = post(server, dict(prompt="a red fox", size="16x16", num_inference_steps=2, seed=0))  # still serving
    assert ok.status_code == 200 and decode_png(ok.json()["data"][0]["b64_json"]).shape == (16, 16, 3)


def test_metrics_count_requests_errors_latency_queue_and_cached_ratio(server):
    before = metrics_of(server)
    ok = post(server, CASES["raw"]).json()
    assert post(server, dict(prompt="x", n=9)).status_code == 400
    after = metrics_of(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    endpoint = {"endpoint": GENERATIONS}
    assert delta("dicache_http_requests_total", **endpoint, status="200") == 1
    assert delta("dicache_http_requests_total", **endpoint, status="400") == 1
    assert delta("dicache_http_errors_total", **endpoint, status="400") == 1
    assert delta("dicache_http_request_duration_seconds_count", **endpoint) == 2
    assert delta("dicache_transformer_calls_total", kind="computed") == ok["cache_stats"]["computed_calls"]
    assert delta("dicache_transformer_calls_total", kind="cached") == ok["cache_stats"]["cached_calls"] > 0
    assert delta("dicache_generations_total", outcome="ok") == 1
    computed = after[("dicache_transformer_calls_total", (("kind", "computed"),))]
    cached = after[("dicache_transformer_calls_total", (("kind", "cached"),))]
    assert after[("dicache_cached_step_ratio", ())] == pytest.approx(cached / (cached + computed))
    assert after[("dicache_queue_depth", ())] == 0 and after[("dicache_generations_running", ())] == 0


def test_metrics_for_operators_wait_generate_images_steps_process_build_and_flops(server, backend, model_source):
    """Issue 18 defect 10: separate wait / generate histograms, image and step counters, process RSS and open
    descriptors, build and model info, and the transformer FLOPs of each generation, equal to what torch's FLOP
    counter measures for the same request run directly."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    case = dict(CASES["raw"], n=2)
    before = metrics_of(server)
    response = post(server, case).json()
    after = metrics_of(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("dicache_images_total") == 2 and delta("dicache_denoise_steps_total") == 10
    assert delta("dicache_request_wait_seconds_count") == 1 and delta("dicache_generation_seconds_count") == 1
    assert delta("dicache_generation_seconds_sum") == pytest.approx(response["timings"]["generate_s"], abs=1e-3)
    phases = response["timings"]["phases"]  # issue 27: where a request's time goes, phase by phase
    assert list(phases) == ["encode", "denoise", "decode", "image"] and min(phases.values()) > 0
    assert phases["denoise"] > phases["image"] and sum(phases.values()) <= response["timings"]["generate_s"]
    assert after[("process_resident_memory_bytes", ())] > 50e6 and after[("process_open_fds", ())] > 3
    build = [k for k in after if k[0] == "dicache_build_info"]
    assert len(build) == 1 and ("torch", torch.__version__) in build[0][1]
    model = [dict(k[1]) for k in after if k[0] == "dicache_model_info"]
    assert model == [dict(model_id="krea-2", variant=backend.defaults.variant, device="cpu", dtype="float32",
                          num_blocks=str(backend.num_blocks))]  # fmt: skip
    assert (
        delta("dicache_generation_achieved_tflops_count") == 1 and delta("dicache_generation_achieved_tflops_sum") > 0
    )

    pipe = Krea2Pipeline.from_pretrained(model_source, device="cpu")
    dicache.enable(pipe, backend.cache_config)
    pipe.set_progress_bar_config(disable=True)
    cond, cond_mask = pipe.encode_prompt([case["prompt"]])
    uncond, uncond_mask = pipe.encode_prompt([case["negative_prompt"]])
    overrides = {"enable_cache": True}
    with (
        torch.inference_mode(),
        dicache.request(pipe, config=overrides),
        sdpa_kernel(SDPBackend.MATH),
        FlopCounterMode(display=False) as counter,
    ):
        pipe(
            prompt_embeds=cond, prompt_embeds_mask=cond_mask, negative_prompt_embeds=uncond,
            negative_prompt_embeds_mask=uncond_mask, height=32, width=48, num_inference_steps=10, guidance_scale=4.5,
            seed=2, num_images_per_prompt=2, output_type="latent", variant=backend.defaults.variant,
        )  # fmt: skip
    assert dicache.stats(pipe).to_dict() == response["cache_stats"]  # the same work, cached steps included
    assert delta("dicache_transformer_flops_total") == counter.get_total_flops()


def test_output_formats_and_the_openai_fields_that_are_ignored(server, client):
    """Issue 18 defect 8: quality / style / moderation / background / output_format are accepted as the OpenAI SDK
    sends them; output_format and output_compression are honoured, the rest documented as ignored."""
    from PIL import Image

    common = dict(prompt="a red fox", size="32x32", extra_body={"seed": 3, "num_inference_steps": 2})
    extras = dict(quality="high", style="vivid", moderation="low", background="opaque", user="u-1")
    results = {}
    for fmt, compression in (("png", None), ("jpeg", 95), ("jpeg", 20), ("webp", 80)):
        kwargs = dict(common, **extras, output_format=fmt, response_format="b64_json")
        if compression is not None:
            kwargs["output_compression"] = compression
        response = client.images.generate(**kwargs)
        raw = base64.b64decode(response.data[0].b64_json)
        image = Image.open(io.BytesIO(raw))
        assert image.format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt] and image.size == (32, 32)
        assert response.output_format == fmt and response.size == "32x32"
        results[(fmt, compression)] = (raw, response.data[0].model_extra["sha256"])
    assert len({sha for _, sha in results.values()}) == 1  # the same generated array, encoded four ways
    assert len(results[("jpeg", 20)][0]) < len(results[("jpeg", 95)][0])  # the compression is applied
    png = decode_png(base64.b64encode(results[("png", None)][0]).decode())
    jpeg = np.asarray(Image.open(io.BytesIO(results[("jpeg", 95)][0])).convert("RGB"))
    assert np.abs(png.astype(int) - jpeg.astype(int)).mean() < 8  # lossy, but the same picture


def test_health_generate_really_generates(backend):
    """`/health_generate` runs one tiny generation through the queue (a full queue does not refuse it), concurrent
    probes share it, and probes are not counted as served images."""
    gated = GatedBackend(backend)
    app = create_app(gated, ServerSettings(max_queue=1, workers=1))
    body = dumps(dict(prompt="a cat", size="16x16", num_inference_steps=2, seed=1))
    with BackgroundServer(app) as srv, ThreadPoolExecutor(4) as pool, gated:
        busy = pool.submit(raw_http, srv.host, srv.port, post_request(GENERATIONS, body))
        assert gated.started.acquire(timeout=20)
        waiting = pool.submit(raw_http, srv.host, srv.port, post_request(GENERATIONS, body))
        wait_until(lambda: httpx.get(srv.url + "/v1/server_info").json()["queue"]["waiting"] == 1)
        probes = [pool.submit(httpx.get, srv.url + "/health_generate", timeout=60) for _ in range(2)]
        wait_until(lambda: httpx.get(srv.url + "/v1/server_info").json()["queue"]["waiting"] == 2, what="the probe")
        assert not any(p.done() for p in probes)  # it waits for a real generation
        gated.gate.set()
        for probe in probes:
            answer = probe.result(60)
            assert answer.status_code == 200 and answer.json()["status"] == "ok" and answer.json()["generate_s"] > 0
        assert busy.result(60)[0] == 200 and waiting.result(60)[0] == 200
        assert [gated.started.acquire(timeout=5) for _ in range(2)] == [True, True]  # the 2nd request + 1 probe
        assert not gated.started.acquire(timeout=0.5)
        again = httpx.get(srv.url + "/health_generate", timeout=60)
        assert again.status_code == 200 and gated.started.acquire(timeout=5)  # a later probe generates anew
        metrics = metrics_of(srv)
    assert (
        metrics[("dicache_images_total", ())] == 2 and metrics[("dicache_generations_total", (("outcome", "ok"),))] == 2
    )


def test_generation_stops_between_blocks_and_before_the_vae(backend):
    """Issue 18 defect 4: a request abandoned mid-call frees its worker at the next transformer block (it used to run
    the whole call, or the whole VAE decode, first)."""
    from dicache.server.backend import GenerationStopped
    from dicache.server.generation import GenerationSpec

    spec = GenerationSpec(
        prompt="a fox", negative_prompt=None, n=1, width=32, height=32, num_inference_steps=4, guidance_scale=1.0,
        seed=0, cache=dicache.CacheConfig.defaults(), variant=backend.defaults.variant,
    )  # fmt: skip
    blocks = backend.pipe.transformer.transformer_blocks
    ran: list[str] = []
    stop = threading.Event()
    hooks = [
        block.register_forward_hook(lambda m, a, o, i=i: ran.append(f"block{i}")) for i, block in enumerate(blocks)
    ]
    hooks.append(blocks[1].register_forward_hook(lambda *a: stop.set()))  # the client leaves during block 1
    decoder = backend.pipe.vae.decoder
    hooks.append(decoder.register_forward_pre_hook(lambda *a: ran.append("vae")))
    try:
        with pytest.raises(GenerationStopped):
            backend.generate(spec, should_stop=stop.is_set)
        assert ran == ["block0", "block1"]  # not block 2 onwards, not another call, not the VAE
        ran.clear()
        steps = len(blocks) * spec.num_inference_steps
        stop.clear()
        hooks[-2].remove()
        last = blocks[-1]
        count = {"n": 0}

        def after_last(*args):
            count["n"] += 1
            if count["n"] == spec.num_inference_steps:
                stop.set()  # the client leaves during the last transformer call

        hooks.append(last.register_forward_hook(after_last))
        with pytest.raises(GenerationStopped):
            backend.generate(spec, should_stop=stop.is_set)
        assert len(ran) == steps and "vae" not in ran  # every block ran, the VAE decode did not
    finally:
        for hook in hooks:
            hook.remove()
    assert len(backend.generate(spec).images_b64) == 1  # the backend still serves


def test_stop_survives_enabling_the_cache_again(model_source, monkeypatch):
    """The stop checks use declared seams (module pre-hooks, `callback_on_step_end`), not a wrapped `call_scope`:
    `dicache.enable` called again on the served pipeline (it disables first) keeps them. Blocks run as if compiled
    (their stop points inactive), so only the per-call and per-step checks can stop the generation."""
    from dicache.server.backend import GenerationStopped
    from dicache.server.generation import GenerationSpec

    served = backend_with_env(model_source, ENV)
    spec = GenerationSpec(
        prompt="a fox", negative_prompt=None, n=1, width=32, height=32, num_inference_steps=4, guidance_scale=2.0,
        seed=0, cache=dicache.CacheConfig.defaults(), variant=served.defaults.variant,
    )  # fmt: skip
    pipe = served.pipe
    dicache.enable(pipe, served.cache_config)
    dicache.enable(pipe, served.cache_config)
    calls: list[int] = []
    stop = threading.Event()
    hooks = [
        pipe.transformer.register_forward_hook(lambda *a: calls.append(1)),  # after each transformer call
        pipe.vae.decoder.register_forward_pre_hook(lambda *a: calls.append(-1)),
    ]
    inside = []  # the blocks run as if compiled: their stop points are traced as no-ops, the pipeline's are not
    for block in pipe.transformer.transformer_blocks:
        hooks.append(block.register_forward_pre_hook(lambda *a: inside.append(1), prepend=True))
        hooks.append(block.register_forward_hook(lambda *a: inside.clear()))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: bool(inside))
    try:
        hooks.append(pipe.transformer.transformer_blocks[0].register_forward_hook(lambda *a: stop.set()))
        with pytest.raises(GenerationStopped):  # asked to stop during the 1st call: the 2nd (uncond) never starts
            served.generate(spec, should_stop=stop.is_set)
        assert calls == [1]
        hooks.pop().remove()
        calls.clear()
        stop.clear()

        def after_call(*args):
            if len(calls) == 2 * spec.num_inference_steps:
                stop.set()  # the client leaves during the last transformer call

        hooks.append(pipe.transformer.register_forward_hook(after_call))
        with pytest.raises(GenerationStopped):  # stopped after the last step, before the VAE decode
            served.generate(spec, should_stop=stop.is_set)
        assert calls == [1] * 8  # every call ran, the VAE decode did not
    finally:
        for hook in hooks:
            hook.remove()
        served.close()


def test_request_settings_apply_after_enabling_the_cache_again(model_source):
    """A request's validated config reaches the session the pipeline has now: `dicache.enable` called again on the
    served pipeline replaces its session, and requests still cache (or not) as their config says."""
    from dicache.server.generation import GenerationSpec

    served = backend_with_env(model_source, ENV)
    try:
        dicache.enable(served.pipe, served.cache_config)
        stats = {}
        for enabled in (False, True):
            spec = GenerationSpec(
                prompt="a fox", negative_prompt=None, n=1, width=32, height=32, num_inference_steps=8,
                guidance_scale=1.0, seed=0, cache=served.cache_config.merged({"enable_cache": enabled}),
                variant=served.defaults.variant,
            )  # fmt: skip
            stats[enabled] = served.generate(spec).stats
        assert stats[False].cached_calls == 0 and stats[False].total_calls == 8
        assert stats[True].cached_calls > 0
    finally:
        served.close()


# ---------------------------------------------------------------------------------------------- robustness
def test_full_queue_is_429_and_a_disconnect_frees_its_slot(backend):
    gated = GatedBackend(backend)
    app = create_app(gated, ServerSettings(max_queue=1, workers=1))
    body = dumps(dict(prompt="a cat", size="16x16", num_inference_steps=2, seed=1))
    with BackgroundServer(app) as srv, ThreadPoolExecutor(2) as pool, gated:
        health = lambda: httpx.get(srv.url + "/v1/server_info").json()["queue"]  # noqa: E731
        first = pool.submit(raw_http, srv.host, srv.port, post_request(GENERATIONS, body))
        assert gated.started.acquire(timeout=20)  # the worker is busy with the first request
        waiting = socket.create_connection((srv.host, srv.port))  # the second one waits in the queue...
        waiting.sendall(post_request(GENERATIONS, body))
        wait_until(lambda: health()["waiting"] == 1, what="a waiting request")
        full = httpx.post(srv.url + GENERATIONS, content=body, headers={"content-type": "application/json"})
        assert full.status_code == 429 and "queue is full" in full.json()["error"]["message"]
        waiting.close()  # its client goes away: the slot is freed at once, not when the worker gets to it
        wait_until(lambda: health()["waiting"] == 0, timeout=5, what="the slot to be freed")
        third = pool.submit(raw_http, srv.host, srv.port, post_request(GENERATIONS, body))
        wait_until(lambda: health()["waiting"] == 1, what="the next request to take the slot")
        gated.gate.set()
        assert first.result(60)[0] == 200 and third.result(60)[0] == 200
        assert gated.started.acquire(timeout=5) and not gated.started.acquire(timeout=0.5)  # the dropped one never ran
        metrics = metrics_of(srv)
    assert metrics[("dicache_http_requests_total", (("endpoint", GENERATIONS), ("status", "429")))] == 1
    assert metrics[("dicache_http_requests_total", (("endpoint", GENERATIONS), ("status", "499")))] == 1
    assert metrics[("dicache_generations_total", (("outcome", "ok"),))] == 2


def test_timeout_is_504_and_stops_the_running_generation(backend):
    app = create_app(backend, ServerSettings(workers=1, request_timeout_s=1.0, max_side=64))
    slow = dict(prompt="a rocket", size="64x64", num_inference_steps=200, guidance_scale=4.5, seed=0)  # 400 calls
    with BackgroundServer(app) as srv:
        start = time.monotonic()
        response = httpx.post(srv.url + GENERATIONS, json=slow, timeout=60)
        assert response.status_code == 504 and time.monotonic() - start < 5
        assert "timed out after 1 s (generating)" in response.json()["error"]["message"]
        wait_until(lambda: httpx.get(srv.url + "/v1/server_info").json()["queue"]["running"] == 0, timeout=5)
        metrics = metrics_of(srv)
        assert metrics[("dicache_generations_total", (("outcome", "stopped"),))] == 1
        assert metrics[("dicache_transformer_calls_total", (("kind", "computed"),))] == 0  # nothing completed
        ok = httpx.post(srv.url + GENERATIONS, json=dict(prompt="x", size="16x16", num_inference_steps=1), timeout=60)
        assert ok.status_code == 200


def test_job_queue_capacity_counts_only_requests_waiting_for_a_busy_worker():
    """Issue 18 defect 5: capacity 0 (`--max-queue 0`) used to refuse everything; it now means "no waiting"."""
    release = threading.Event()
    queue = JobQueue(lambda job: release.wait(10) and job.payload, capacity=0, workers=1)
    queue.start()
    try:
        first = queue.submit(1)  # an idle worker takes it
        wait_until(lambda: queue.running == 1)
        with pytest.raises(QueueFullError, match="capacity 0"):
            queue.submit(2)  # the worker is busy and nothing may wait
        release.set()
        assert first.future.result(10) == 1
        wait_until(lambda: queue.running == 0)
        assert queue.submit(3).future.result(10) == 3
    finally:
        release.set()
        queue.shutdown(wait=True, timeout=10)


def test_job_queue_contract():
    release = threading.Event()
    queue = JobQueue(lambda job: release.wait(10) and job.payload * 2, capacity=1, workers=1)
    queue.start()
    running = queue.submit(1)
    wait_until(lambda: queue.running == 1)
    waiting = queue.submit(2)
    with pytest.raises(QueueFullError, match="queue is full"):
        queue.submit(3)
    assert queue.cancel(waiting) and waiting.future.cancelled() and queue.waiting == 0
    assert not queue.cancel(running) and running.stop.is_set()  # running: asked to stop, not dropped
    last = queue.submit(4)
    release.set()
    queue.shutdown(wait=True, timeout=10)
    assert running.future.result() == 2 and last.future.result() == 8  # accepted jobs finish on shutdown
    with pytest.raises(ShuttingDownError):
        queue.submit(5)


# ---------------------------------------------------------------------------------------------- command line
def test_cli_refuses_a_bad_environment_variable(monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_CACHE_DIT_RDT", "-1")
    assert cli_main(["serve", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "SGLANG_CACHE_DIT_RDT='-1' is invalid" in err and "a number >= 0" in err
