"""Prompt lengths met in the background, between requests (`dicache.server.text_lengths`, `--prepare-text-lengths
background`): each length once, longest first, a chunk at a time and only while no generation is in flight, on the
denoise thread, without changing a request's bytes; stopped by the server's shutdown; a failure is reported and
serving goes on."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.attention_plans import ENV
from dicache.server.backend import PipelineBackend, ready_to_serve, variant_defaults
from dicache.server.generation import GenerationSpec
from dicache.server.text_lengths import TextLengthPreparation
from dicache.settings.cache_config import CacheConfig

pytestmark = pytest.mark.timeout(120)


def test_every_length_is_met_once_longest_first_in_chunks():
    chunks = []
    preparation = TextLengthPreparation(chunks.append, [5, 9, 3, 9, 7, 4], busy=lambda: False, chunk=2).start()
    assert preparation.wait(10)
    assert chunks == [[9, 7], [5, 4], [3]]
    assert preparation.progress() == {
        "lengths": 5,
        "of": 5,
        "ahead_of_requests": 0,
        "seconds": pytest.approx(0, abs=0.5),
        "state": "done",
    }


def test_lengths_claimed_ahead_of_a_request_are_skipped_by_the_thread():
    """A request's lengths are claimed once (the backend meets them ahead of its denoising); the thread meets only
    the rest, and a length already met or claimed, or not a prompt length, is not claimed again."""
    in_flight, chunks = threading.Event(), []
    in_flight.set()
    preparation = TextLengthPreparation(chunks.append, range(3, 9), busy=in_flight.is_set, idle_poll_s=0.01)
    preparation.start()
    assert preparation.claim([5, 7, 5, 40]) == [5, 7]
    assert preparation.claim([7, 5]) == []
    in_flight.clear()
    assert preparation.wait(10)
    assert chunks == [[8], [6], [4], [3]]  # one length a chunk by default
    assert preparation.claim([4]) == []  # ended: nothing left to claim
    report = preparation.progress()
    assert (report["lengths"], report["of"], report["ahead_of_requests"]) == (6, 6, 2)


def test_no_chunk_starts_while_a_generation_is_in_flight():
    in_flight, started = threading.Event(), []
    in_flight.set()
    preparation = TextLengthPreparation(
        lambda part: started.append((part, in_flight.is_set())),
        range(3, 9),
        busy=in_flight.is_set,
        chunk=3,
        idle_poll_s=0.01,
    ).start()
    time.sleep(0.3)
    assert started == [] and preparation.progress()["state"] == "running"  # held back the whole time
    in_flight.clear()
    assert preparation.wait(10)
    assert started == [([8, 7, 6], False), ([5, 4, 3], False)]


def test_a_chunk_waits_for_a_lull_of_idle_s_after_ready_and_after_each_generation():
    """No chunk in the first `idle_s` after start (requests follow a server's ready at once), nor within `idle_s`
    of the last generation; then the chunks follow one another while the server stays idle."""
    in_flight, started = threading.Event(), []
    preparation = TextLengthPreparation(
        lambda part: started.append((part, time.monotonic())), [4, 3], in_flight.is_set, idle_s=0.6, idle_poll_s=0.01
    )
    begun = time.monotonic()
    preparation.start()
    time.sleep(0.3)
    in_flight.set()  # a generation from 0.3 s to 0.5 s
    time.sleep(0.2)
    ended = time.monotonic()
    in_flight.clear()
    assert preparation.wait(10)
    assert [part for part, _ in started] == [[4], [3]]
    assert started[0][1] - ended >= 0.6 and started[0][1] - begun >= 1.1
    assert started[1][1] - started[0][1] < 0.3  # no second lull between chunks


def test_close_stops_after_the_chunk_in_flight():
    release, running, chunks = threading.Event(), threading.Event(), []

    def prepare(part):
        chunks.append(part)
        running.set()
        release.wait(10)

    preparation = TextLengthPreparation(prepare, range(10), busy=lambda: False, chunk=2).start()
    assert running.wait(10)
    closing = threading.Thread(target=preparation.close)
    closing.start()
    time.sleep(0.1)
    release.set()  # the chunk in flight ends; no other starts
    closing.join(10)
    assert chunks == [[9, 8]]
    assert preparation.progress() == {
        "lengths": 2,
        "of": 10,
        "ahead_of_requests": 0,
        "seconds": pytest.approx(0.1, abs=5),
        "state": "stopped",
    }


def test_a_failing_chunk_is_logged_once_and_reported(caplog):
    def prepare(part):
        if part[0] < 6:
            raise RuntimeError("cuDNN: no plan")

    finished = []
    preparation = TextLengthPreparation(prepare, range(8), busy=lambda: False, chunk=2, on_done=finished.append)
    with caplog.at_level(logging.ERROR, logger="dicache.server"):
        preparation.start().wait(10)
    report = preparation.progress()
    assert report["state"] == "failed" and report["lengths"] == 2 and "cuDNN: no plan" in report["error"]
    assert finished == [report]
    assert len([r for r in caplog.records if "background failed" in r.getMessage()]) == 1


def test_a_chunk_size_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk=0 must be >= 1"):
        TextLengthPreparation(print, [1], busy=lambda: False, chunk=0)


# ---------------------------------------------------------------------------------------------- on the tiny model
@pytest.fixture(scope="module")
def pipe():
    return Krea2Pipeline.from_pretrained()


def _spec(prompt: str, seed: int) -> GenerationSpec:
    return GenerationSpec(
        prompt=prompt,
        negative_prompt=None,
        n=1,
        width=32,
        height=32,
        num_inference_steps=3,
        guidance_scale=4.0,
        seed=seed,
        cache=CacheConfig.defaults(),
        variant="raw",
    )


def test_background_lengths_run_on_the_denoise_thread_between_requests_and_change_no_bytes(pipe, one_torch_thread):
    """The backend's own preparation (as `prepare_text_lengths(background=True)` builds it, run here on the CPU, where
    the server skips it), with requests served meanwhile: every length met, on the denoise thread, and the requests
    give the bytes of a backend that met none."""
    backend = PipelineBackend(pipe, CacheConfig.defaults(), variant_defaults(pipe, "raw", (32, 32)), staged=True)
    try:
        request = _spec("a lighthouse at dusk", 5)
        before = backend.generate(request)
        stages = backend.stages()
        threads = []
        hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
            lambda *_: threads.append(threading.current_thread())
        )

        def prepare(lengths):
            return stages.run("denoise", lambda: pipe.prepare_text_lengths(32, 32, lengths=lengths))

        try:
            lengths = pipe.text_lengths()[::8]  # a spread of them: every one would take seconds on the CPU
            preparation = TextLengthPreparation(prepare, lengths, backend.busy, chunk=3).start()
            during = [backend.generate(_spec("a lighthouse at dusk", 5)) for _ in range(2)]
            assert preparation.wait(60)
        finally:
            hook.remove()
        assert preparation.progress()["state"] == "done"
        assert preparation.progress()["lengths"] == len(lengths)
        assert set(threads) == {stages.thread_of("denoise")}
        assert all(r.images_b64 == before.images_b64 for r in during)
        assert backend.generate(request).images_b64 == before.images_b64
    finally:
        backend.close()


def test_a_request_has_its_own_lengths_met_on_the_denoise_thread_ahead_of_its_denoising(pipe, one_torch_thread):
    """While the background preparation runs, a request of the default size whose prompt lengths (prompt and
    negative prompt, Raw's CFG) are not met has them met on the denoise thread before its own denoising, once;
    the next request of those lengths meets none, and the bytes are those of a backend that met none."""
    backend = PipelineBackend(pipe, CacheConfig.defaults(), variant_defaults(pipe, "raw", (32, 32)), staged=True)
    try:
        request = _spec("a lighthouse at dusk", 5)
        before = backend.generate(request)
        stages, order = backend.stages(), []
        original = pipe.prepare_text_lengths

        def recorded(*size, lengths=None):
            order.append(("prepare", sorted(lengths), threading.current_thread()))
            return original(*size, lengths=lengths)

        hook = pipe.transformer.register_forward_pre_hook(
            lambda *_: order.append(("denoise", None, threading.current_thread()))
        )
        held = threading.Event()  # the background thread waits: only the request meets lengths here
        held.set()
        backend.text_lengths = TextLengthPreparation(print, pipe.text_lengths(), held.is_set).start()
        try:
            pipe.prepare_text_lengths = recorded
            answers = [backend.generate(request) for _ in range(2)]
        finally:
            del pipe.prepare_text_lengths
            hook.remove()
            backend.text_lengths.close(0)
        tokens = sorted(pipe.text_encoder.num_valid_tokens(["a lighthouse at dusk", ""]))
        denoise = stages.thread_of("denoise")
        assert order[0] == ("prepare", tokens, denoise)  # before the first request's first transformer call
        assert [entry[0] for entry in order].count("prepare") == 1  # the second request's lengths were met
        assert {thread for _, _, thread in order} == {denoise}
        assert backend.text_lengths.progress()["ahead_of_requests"] == 2
        assert all(a.images_b64 == before.images_b64 for a in answers)
    finally:
        backend.close()


def test_the_warm_up_meets_its_prompts_plans_and_the_preparation_one_length_per_plan_left(pipe, monkeypatch):
    """After the warm-up, the lengths to meet are one stand-in per attention plan the warm-up did not meet: with
    shared plans a handful (the pipeline's `attention_plan_lengths`), with a plan per length every length but the
    warm-up prompts'."""
    backend = PipelineBackend(pipe, CacheConfig.defaults(), variant_defaults(pipe, "raw", (32, 32)))
    try:
        backend.warm_up()
    finally:
        backend.close()
    warmed = set(pipe.text_encoder.num_valid_tokens(list(PipelineBackend.WARM_UP_PROMPTS)))
    assert backend.lengths_met == warmed and len(warmed) == 2
    monkeypatch.setenv(ENV, "1")
    lengths, stand_ins, counts = backend.text_lengths_to_meet()
    assert stand_ins == pipe.attention_plan_lengths(32, 32)
    met = {stand_ins[n] for n in warmed}
    assert lengths == sorted(set(stand_ins.values()) - met, reverse=True) and lengths
    assert counts == {"lengths": len(lengths), "prompt_lengths": len(pipe.text_lengths()), "plans_met": len(met)}
    monkeypatch.setenv(ENV, "0")
    lengths, stand_ins, counts = backend.text_lengths_to_meet()
    assert lengths == sorted(set(pipe.text_lengths()) - warmed, reverse=True)
    assert counts["plans_met"] == 2 and stand_ins == {n: n for n in pipe.text_lengths()}


def test_a_request_meets_the_stand_in_length_of_its_plan_ahead(pipe, one_torch_thread, monkeypatch):
    """With shared plans the preparation holds one stand-in length per plan, and a request has its plans' stand-ins
    met ahead of its denoising (not its own lengths, which share their plans)."""
    monkeypatch.setenv(ENV, "1")
    backend = PipelineBackend(pipe, CacheConfig.defaults(), variant_defaults(pipe, "raw", (32, 32)), staged=True)
    try:
        lengths, stand_ins, _ = backend.text_lengths_to_meet()
        held = threading.Event()  # the background thread waits: only the request meets lengths here
        held.set()
        backend._plan_stand_ins = stand_ins  # as prepare_text_lengths(background=True) sets them on a GPU
        backend.text_lengths = TextLengthPreparation(print, lengths, held.is_set).start()
        met = []
        original = pipe.prepare_text_lengths

        def recorded(*size, lengths=None):
            met.append(sorted(lengths))
            return original(*size, lengths=lengths)

        try:
            pipe.prepare_text_lengths = recorded
            backend.generate(_spec("a lighthouse at dusk", 5))
        finally:
            del pipe.prepare_text_lengths
            backend.text_lengths.close(0)
        tokens = pipe.text_encoder.num_valid_tokens(["a lighthouse at dusk", ""])
        assert met == [sorted({stand_ins[n] for n in tokens})]
        assert met[0] != sorted(tokens)
    finally:
        backend.close()


def test_lengths_outside_the_prompt_lengths_are_refused(pipe):
    lengths = pipe.text_lengths()
    with pytest.raises(ValueError, match=rf"lengths \[{lengths.stop}\] are not prompt lengths"):
        pipe.prepare_text_lengths(32, 32, lengths=[lengths.stop])


def test_ready_to_serve_starts_the_background_preparation_after_ready_and_close_stops_it(monkeypatch):
    """The order `dicache serve` and each Ray Serve replica follow: ready is reported, then the lengths begin;
    /v1/server_info's "startup" shows their progress; the backend's close stops them."""
    lines = []

    class Backend(PipelineBackend):  # only what ready_to_serve and the report use
        def __init__(self):
            self.pipe = type("Pipe", (), {"device": torch.device("cpu")})()
            self.text_lengths, self.startup = None, None

        def prepare_text_lengths(self, background=False, **preparation):
            assert background and "ready in" in lines[-1]  # after the start-up's report line
            self.text_lengths = TextLengthPreparation(lambda part: None, [3, 4, 5], lambda: False, **preparation)
            self.text_lengths.start().wait(10)
            self._plan_counts = {"prompt_lengths": 3, "plans_met": 0}
            return {"lengths": 3, "prompt_lengths": 3, "plans_met": 0, "background": True}

    backend = Backend()
    ready_to_serve(backend, warm_up=False, prepare_text_lengths="background", report=lines.append)
    assert lines[-2:] == [
        "prompt lengths prepared in the background: "
        "{'lengths': 3, 'of': 3, 'ahead_of_requests': 0, 'seconds': 0.0, 'state': 'done'}",
        "preparing prompt lengths in the background, between requests: "
        "{'lengths': 3, 'prompt_lengths': 3, 'plans_met': 0, 'background': True}",
    ]
    assert backend.startup_report()["text_lengths"]["state"] == "done"
    assert "text_lengths" not in backend.startup["phases_s"]  # not a start-up phase: ready came first


def test_ready_to_serve_says_when_the_warm_up_met_every_attention_plan():
    """With one shared plan the warm-up meets it: no background preparation starts, the start-up's report says so,
    and /v1/server_info shows the counts as done."""
    lines = []

    class Backend(PipelineBackend):  # only what ready_to_serve and the report use
        def __init__(self):
            self.pipe = type("Pipe", (), {"device": torch.device("cpu")})()
            self.text_lengths, self.startup, self._plan_counts = None, None, None

        def prepare_text_lengths(self, background=False, **preparation):
            self._plan_counts = {"prompt_lengths": 508, "plans_met": 1}
            return {"lengths": 0, "prompt_lengths": 508, "plans_met": 1, "background": False}

    backend = Backend()
    ready_to_serve(backend, warm_up=False, prepare_text_lengths="background", report=lines.append)
    assert lines[-1] == (
        "prompt lengths: every attention plan met by the warm-up: "
        "{'lengths': 0, 'prompt_lengths': 508, 'plans_met': 1, 'background': False}"
    )
    shown = backend.startup_report()["text_lengths"]
    assert shown == {"lengths": 0, "of": 0, "prompt_lengths": 508, "plans_met": 1, "state": "done"}
    assert backend.text_lengths is None


@pytest.mark.gpu
def test_on_cuda_the_backend_meets_every_length_in_the_background_while_it_serves():
    """What `dicache serve` does by default on a GPU: ready first, then every prompt length met on the denoise thread
    between requests; the requests served meanwhile give the bytes of a backend that met none."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pipe = Krea2Pipeline.from_pretrained(device="cuda")
    backend = PipelineBackend(pipe, CacheConfig.defaults(), variant_defaults(pipe, "raw", (32, 32)), staged=True)
    try:
        request = _spec("a lighthouse at dusk", 5)
        before = backend.generate(request)
        started = backend.prepare_text_lengths(background=True)
        stand_ins = set(pipe.attention_plan_lengths(32, 32).values())  # no warm-up: none met
        expected = {"lengths": len(stand_ins), "prompt_lengths": len(pipe.text_lengths()), "plans_met": 0}
        assert started == {**expected, "background": True}
        during = [backend.generate(request) for _ in range(3)]
        assert backend.text_lengths.wait(120)
        assert backend.text_lengths.progress()["state"] == "done"
        assert backend.text_lengths.progress()["lengths"] == len(stand_ins)
        assert all(r.images_b64 == before.images_b64 for r in during)
    finally:
        backend.close()
