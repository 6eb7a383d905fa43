"""Faults inside a generation (issue 45, part 2), injected into the real pipeline through module hooks
(`fault_injection`): a CUDA out-of-memory error in each phase is a 503 with `Retry-After` in OpenAI's error shape,
counted per phase in `/metrics`, with nothing of the request left referenced and the next requests served; NaN or inf
in the latents or the decoded image is a 500 saying so, never an image; `dicache generate` writes only the finite
images. The same on a GPU, with real out-of-memory errors: `test_server_faults_gpu.py`."""

from __future__ import annotations

import gc
import weakref

import httpx
import pytest
import torch
from fault_injection import TensorWatch, non_finite_output, out_of_memory_in, phase_modules
from server_helpers import backend_with_env, metrics_text_to_dict, pipeline_source, wait_until

from dicache.cli import main as cli_main
from dicache.models.krea2 import Krea2Transformer
from dicache.server import ServerSettings, create_app
from dicache.server.background import BackgroundServer
from dicache.server.jobs import JobQueue

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

GENERATIONS = "/v1/images/generations"
SMALL = dict(prompt="a red fox", size="32x32", num_inference_steps=3, seed=1, enable_cache=False)
OOM_AT = {  # (extra request fields, calls of the phase's module that pass before the error)
    "encode": ({"guidance_scale": 4.5}, 1),  # the negative prompt's encoding fails; the prompt's is done
    "denoise": ({}, 1),  # the second transformer call fails
    "decode": ({}, 0),
}
PHASES_REACHED = {"encode": {"encode"}, "denoise": {"encode", "denoise"}, "decode": {"encode", "denoise", "decode"}}


@pytest.fixture(scope="module")
def model_source(tmp_path_factory):
    return pipeline_source(tmp_path_factory.mktemp("krea2"))


@pytest.fixture(scope="module", params=["staged", "inline"])
def served(request, model_source):
    """(server, backend): the phases on threads of their own (the default), or in the worker's thread (the mode of
    offloaded and multi-process pipelines)."""
    backend = backend_with_env(model_source, {})
    backend.staged = request.param == "staged"
    with BackgroundServer(create_app(backend, ServerSettings())) as srv:
        yield srv, backend
    backend.close()


def metrics(url: str) -> dict:
    return metrics_text_to_dict(httpx.get(url + "/metrics").text)


def count(figures: dict, name: str, **labels: str) -> float:
    return figures.get((name, tuple(sorted(labels.items()))), 0.0)


def generate(url: str, **fields) -> httpx.Response:
    return httpx.post(url + GENERATIONS, json={**SMALL, **fields}, timeout=120)


def test_a_served_request_leaves_no_tensor_referenced(served):
    """The control of the tests below: `TensorWatch` sees every phase, and a request that succeeded keeps nothing."""
    srv, backend = served
    with TensorWatch(backend.pipe) as watch:
        assert generate(srv.url).status_code == 200
    assert watch.phases() == {"encode", "denoise", "decode"} and watch.alive() == []


@pytest.mark.parametrize("phase", ["encode", "denoise", "decode"])
def test_out_of_memory_in_a_phase_is_a_503_that_frees_the_request(served, phase):
    srv, backend = served
    fields, passing = OOM_AT[phase]
    module = phase_modules(backend.pipe)[phase]
    before = metrics(srv.url)
    with TensorWatch(backend.pipe) as watch, out_of_memory_in(module, after=passing) as raised:
        answer = generate(srv.url, **fields)
    assert raised == [1]
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    error = answer.json()["error"]
    assert error["type"] == "server_unavailable" and error["code"] == "out_of_memory" and error["param"] is None
    assert f"out of GPU memory in the {phase} phase" in error["message"]
    assert "Tried to allocate 20.00 GiB" in error["message"] and "retry later" in error["message"]
    assert watch.phases() == PHASES_REACHED[phase]  # the request made tensors in every phase it reached ...
    assert watch.alive() == []  # ... and none is referenced once it is answered (no gc.collect() here)
    after = metrics(srv.url)
    assert count(after, "dicache_out_of_memory_errors_total", phase=phase) == (
        count(before, "dicache_out_of_memory_errors_total", phase=phase) + 1
    )
    for outcome, added in (("out_of_memory", 1), ("failed", 0), ("ok", 0)):
        name = "dicache_generations_total"
        assert count(after, name, outcome=outcome) == count(before, name, outcome=outcome) + added
    assert [generate(srv.url, seed=seed).status_code for seed in (2, 3)] == [200, 200]


@pytest.mark.parametrize(
    ("message", "status"),
    [
        ("CUDA error: out of memory", 503),  # the CUDA runtime's, from a library's own allocation
        ("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", 503),
        ("mat1 and mat2 shapes cannot be multiplied", 500),  # any other error stays a 500
    ],
)
def test_allocation_failures_outside_the_caching_allocator_are_503_too(served, message, status):
    srv, backend = served
    with out_of_memory_in(phase_modules(backend.pipe)["denoise"], error=RuntimeError(message)):
        answer = generate(srv.url)
    assert answer.status_code == status and message in answer.json()["error"]["message"]
    assert generate(srv.url).status_code == 200


def test_out_of_memory_in_the_generation_probe_is_a_503_and_counted(served):
    srv, backend = served
    before = metrics(srv.url)
    with out_of_memory_in(phase_modules(backend.pipe)["denoise"]):
        probe = httpx.get(srv.url + "/health_generate", timeout=120)
    assert probe.status_code == 503 and probe.headers["retry-after"] == "5"
    assert "out of device memory in the denoise phase" in probe.json()["error"]["message"]
    after = metrics(srv.url)
    name = "dicache_out_of_memory_errors_total"
    assert count(after, name, phase="denoise") == count(before, name, phase="denoise") + 1
    name = "dicache_generations_total"  # probes are not generations
    assert count(after, name, outcome="out_of_memory") == count(before, name, outcome="out_of_memory")
    assert httpx.get(srv.url + "/health_generate", timeout=120).status_code == 200


@pytest.mark.parametrize(
    ("where", "value", "items", "n", "expected"),
    [
        ("transformer", float("nan"), None, 1, "image 1 of 1: latents after denoising"),
        ("transformer", float("inf"), (1,), 2, "image 2 of 2: latents after denoising"),
        ("vae", float("inf"), None, 1, "image 1 of 1: decoded image"),  # the VAE's clamp no longer hides it
        ("vae", float("nan"), (0,), 2, "image 1 of 2: decoded image"),
    ],
)
def test_non_finite_latents_or_pixels_are_a_500_never_an_image(served, where, value, items, n, expected):
    srv, backend = served
    module = backend.pipe.transformer if where == "transformer" else backend.pipe.vae.decoder
    before = metrics(srv.url)
    with non_finite_output(module, value, items):
        answer = generate(srv.url, n=n)
    assert answer.status_code == 500, answer.text[:300]
    error = answer.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "non_finite_output"
    assert "non-finite values (NaN or inf)" in error["message"] and expected in error["message"]
    assert error["message"].count("image ") == 1  # only the spoiled image is named
    name = "dicache_generations_total"
    assert count(metrics(srv.url), name, outcome="non_finite") == count(before, name, outcome="non_finite") + 1
    assert generate(srv.url, n=n).status_code == 200


def test_an_idle_worker_keeps_nothing_of_its_last_job():
    """The worker thread's loop held its last job (its result, or its exception with the generation's frames and
    tensors) until the next job came: a failed request's memory stayed referenced while the server was idle."""

    class Payload:
        pass

    refs = []

    def handler(job):
        made = Payload()
        refs.append(weakref.ref(made))
        if job.payload == "fail":
            raise RuntimeError(made)
        return made

    queue = JobQueue(handler, capacity=4, workers=1)
    queue.start()
    try:
        for payload in ("ok", "fail"):
            job = queue.submit(payload)
            job.future.exception(timeout=30)
            del job
        wait_until(lambda: queue.idle, what="the worker to finish")
        gc.collect()
        wait_until(lambda: all(ref() is None for ref in refs), timeout=5, what="the last job to be released")
    finally:
        queue.shutdown(wait=True, timeout=30)


def test_generate_writes_only_the_finite_images(tmp_path, model_source, capsys):
    """`dicache generate` with two prompts, the second one's latents NaN (injected into every `Krea2Transformer`'s
    output through torch's global forward hook): the first image is written, the second is not (and an older file
    at its path is removed), the message names it, and the command exits 1."""
    stale = tmp_path / "img-1.png"
    stale.write_bytes(b"an image from an earlier run")

    def spoil(module, args, output):
        if isinstance(module, Krea2Transformer):
            output = output.clone()
            output[1] = float("nan")
            return output
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(spoil)
    try:
        argv = ["generate", "a red apple", "a blue car", "--steps", "2", "--height", "32", "--width", "32"]
        argv += ["--out", str(tmp_path / "img.png"), "--device", "cpu", "--cache", "off"]
        if model_source is not None:
            argv += ["--model", model_source]
        assert cli_main(argv) == 1
    finally:
        handle.remove()
    captured = capsys.readouterr()
    assert (tmp_path / "img-0.png").is_file() and not stale.exists()
    assert f"wrote {tmp_path / 'img-0.png'} in" in captured.out
    assert "non-finite values (NaN or inf)" in captured.err and "image 2 of 2: latents after denoising" in captured.err
    assert f"not written: {stale}" in captured.err
