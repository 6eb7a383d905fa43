"""GPU faults for real (issue 45, part 2): out-of-memory errors on a CUDA device, in each phase of a generation.

Real ones: the process's memory is capped (`torch.cuda.set_per_process_memory_fraction`) and a request that does
not fit under the cap is sent. For the first phase the cap is what the process holds before the request; for a
later phase it is set as the phase begins (a forward pre-hook of its first module): what is allocated then plus half
of what the phase was measured to need beyond that on the same request without a cap. A cap set before the request
at a level between two phases' peaks is not reliable: the allocator's pools of the phases' streams hold freed blocks,
and a phase's need beyond the one before it can be smaller than that slack (on the H200 at full size, decode needs
0.43 GB more than denoise, and denoise then failed first); injected ones: `torch.OutOfMemoryError` raised
from a module of the phase (as on the CPU, `test_server_faults.py`). Each must be answered 503 in OpenAI's shape
with `Retry-After`, counted per phase in `/metrics`; GPU memory, allocated and reserved after the allocator's cache
is emptied, must come back within 1 % of its level before the fault, and the next requests must succeed.

    python -m pytest -m gpu tests/test_server_faults_gpu.py                                # tiny model, ~1 min
    DICACHE_FAULTS_FULL_SIZE=1 python -m pytest -m gpu tests/test_server_faults_gpu.py     # + full size, ~4 min

The full-size mode builds Krea-2 as released (12.8 B transformer, Qwen3-VL-4B-sized text encoder, the Qwen-Image
VAE) with random weights (`--load-format dummy`, as `benchmarks/bench_serving.py`). With `$OUT` set, each measured
case is appended as one JSON line to `$OUT/faults_gpu.jsonl`.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import sys
import tempfile
from dataclasses import dataclass

import httpx
import pytest
import torch
from fault_injection import out_of_memory_in, phase_modules
from server_helpers import metrics_text_to_dict

from dicache.server import ServerSettings, create_app, load_backend
from dicache.server.background import BackgroundServer
from dicache.server.memory import release_cached_memory
from dicache.server.stages import GenerationStages

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

GENERATIONS = "/v1/images/generations"
PHASES = ("encode", "denoise", "decode")
TOLERANCE = 0.01
MIN_NEED = 64 * 2**20  # a phase capped at half its need must need at least this much (bytes)
MODELS = ["tiny", "full"] if os.environ.get("DICACHE_FAULTS_FULL_SIZE") == "1" else ["tiny"]
NORMAL = {"tiny": dict(size="128x128", num_inference_steps=2), "full": dict(size="512x512", num_inference_steps=2)}
LARGE = {  # requests too large for a capped process, largest last: the first that separates a phase is used
    "tiny": [dict(size="1024x1024", n=4), dict(size="2048x2048", n=4)],
    "full": [dict(size="1024x1024", n=2), dict(size="2048x2048", n=4)],
}


def record(case: dict) -> None:
    """Append `case` to `$OUT/faults_gpu.jsonl` (when `$OUT` is set) and print it."""
    print(json.dumps(case))
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        with open(pathlib.Path(out) / "faults_gpu.jsonl", "a") as fh:
            fh.write(json.dumps(case) + "\n")


@dataclass
class Served:
    kind: str
    url: str
    backend: object

    def post(self, **fields) -> httpx.Response:
        body = {"prompt": "a red fox in the snow", "seed": 1, "guidance_scale": 1.0, **NORMAL[self.kind], **fields}
        return httpx.post(self.url + GENERATIONS, json=body, timeout=600)

    def metrics(self) -> dict:
        return metrics_text_to_dict(httpx.get(self.url + "/metrics").text)


@pytest.fixture(scope="module", params=MODELS)
def served(request):
    if request.param == "tiny":
        backend = load_backend(None, device="cuda", default_size=(128, 128))
    else:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
        from bench_serving import write_model_folder  # the full-size config folder of the serving benchmark

        folder = write_model_folder(pathlib.Path(tempfile.mkdtemp()) / "krea2-config", tiny=False)
        backend = load_backend(str(folder), "turbo", device="cuda", load_format="dummy")
    settings = ServerSettings(max_side=2048, max_n=4, request_timeout_s=600)
    with BackgroundServer(create_app(backend, settings)) as srv:
        served = Served(request.param, srv.url, backend)
        for fields in ({}, {"guidance_scale": 4.5}):  # every phase's thread, stream and kernels met once
            assert served.post(**fields).status_code == 200
        yield served
    backend.close()
    del backend, served
    gc.collect()
    torch.cuda.empty_cache()


def memory() -> tuple[int, int]:
    """(allocated, reserved) bytes once the device is idle, after the allocator's cache is emptied."""
    torch.cuda.synchronize()
    gc.collect()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    return allocated, torch.cuda.memory_reserved()


def within(now: int, before: int) -> bool:
    return abs(now - before) <= TOLERANCE * before


def count(figures: dict, name: str, **labels: str) -> float:
    return figures.get((name, tuple(sorted(labels.items()))), 0.0)


def check_503(served: Served, answer: httpx.Response, phase: str, before_metrics: dict) -> None:
    assert answer.status_code == 503, answer.text[:300]
    assert answer.headers["retry-after"] == "5"
    error = answer.json()["error"]
    assert error["code"] == "out_of_memory" and f"out of GPU memory in the {phase} phase" in error["message"]
    name = "dicache_out_of_memory_errors_total"
    assert count(served.metrics(), name, phase=phase) == count(before_metrics, name, phase=phase) + 1


PHASE_START = {"denoise": lambda pipe: pipe.transformer, "decode": lambda pipe: pipe.vae.decoder}


def phase_needs(served: Served, fields: dict) -> tuple[dict[str, int], dict[str, int]]:
    """For one generation of `fields` (no cap): the peak bytes allocated during each phase, and the bytes allocated
    as each later phase begins (read at a forward pre-hook of the phase's first module, where the peak counters are
    also reset)."""
    peaks: dict[str, int] = {}
    entry: dict[str, int] = {}
    handles = []
    for phase, start in PHASE_START.items():
        previous = PHASES[PHASES.index(phase) - 1]

        def enter(mod, args, phase=phase, previous=previous):
            if phase not in entry:
                peaks[previous] = torch.cuda.max_memory_allocated()
                entry[phase] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        handles.append(start(served.backend.pipe).register_forward_pre_hook(enter))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        assert served.post(**fields).status_code == 200
    finally:
        for handle in handles:
            handle.remove()
    torch.cuda.synchronize()
    peaks["decode"] = torch.cuda.max_memory_allocated()
    return peaks, entry


class CapAtPhaseStart:
    """Caps the process's memory as `phase` begins, at what is allocated then plus `extra` bytes (once per
    generation); the cap is lifted on exit."""

    def __init__(self, served: Served, phase: str, extra: int):
        self.module = PHASE_START[phase](served.backend.pipe)
        self.extra = extra
        self.caps: list[int] = []

    def __enter__(self):
        total = torch.cuda.get_device_properties(0).total_memory

        def cap(mod, args):
            if not self.caps:
                self.caps.append(torch.cuda.memory_allocated() + self.extra)
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.caps[0] / total))

        self.handle = self.module.register_forward_pre_hook(cap)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.parametrize("phase", PHASES)
def test_a_real_out_of_memory_in_each_phase(served, phase):
    """The process capped below what a request needs in this phase (the encode phase: at what the process holds
    before the request; a later phase: as it begins, at what is allocated then plus half the phase's measured need):
    the request is a 503 naming the phase; memory comes back within 1 %; the next requests succeed."""
    total = torch.cuda.get_device_properties(0).total_memory
    allocated, reserved = memory()
    peaks = None
    if phase == "encode":
        fields = LARGE[served.kind][-1]
        cap = reserved
        before_metrics = served.metrics()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        try:
            answer = served.post(**fields)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
    else:
        for fields in LARGE[served.kind]:
            peaks, entry = phase_needs(served, fields)
            need = peaks[phase] - entry[phase]
            if need >= MIN_NEED:
                break
        else:
            record({"model": served.kind, "phase": phase, "kind": "real", "reachable": False, "peaks": peaks})
            pytest.skip(f"no request of {LARGE[served.kind]} needs {MIN_NEED} bytes in {phase}: {peaks}")
        allocated, reserved = memory()
        before_metrics = served.metrics()
        with CapAtPhaseStart(served, phase, need // 2) as capped:
            answer = served.post(**fields)
        assert len(capped.caps) == 1
        cap = capped.caps[0]
    check_503(served, answer, phase, before_metrics)
    allocated_after, reserved_after = memory()
    record(
        {
            "model": served.kind,
            "phase": phase,
            "kind": "real",
            "request": fields,
            "cap_GB": round(cap / 1e9, 3),
            "peaks_GB": {p: round(v / 1e9, 3) for p, v in peaks.items()} if peaks else None,
            "allocated_GB": [round(allocated / 1e9, 4), round(allocated_after / 1e9, 4)],
            "reserved_GB": [round(reserved / 1e9, 4), round(reserved_after / 1e9, 4)],
            "message": answer.json()["error"]["message"],
        }
    )
    assert within(allocated_after, allocated) and within(reserved_after, reserved)
    assert [served.post(seed=seed).status_code for seed in (2, 3)] == [200, 200]
    assert served.post(**fields).status_code == 200  # uncapped, the same request fits


@pytest.mark.parametrize("phase", PHASES)
def test_an_injected_out_of_memory_in_each_phase(served, phase):
    allocated, reserved = memory()
    before_metrics = served.metrics()
    with out_of_memory_in(phase_modules(served.backend.pipe)[phase], after=1 if phase != "decode" else 0) as raised:
        answer = served.post(guidance_scale=4.5)  # CFG: the encode phase encodes twice
    assert raised == [1]
    check_503(served, answer, phase, before_metrics)
    allocated_after, reserved_after = memory()
    record(
        {
            "model": served.kind,
            "phase": phase,
            "kind": "injected",
            "allocated_GB": [round(allocated / 1e9, 4), round(allocated_after / 1e9, 4)],
            "reserved_GB": [round(reserved / 1e9, 4), round(reserved_after / 1e9, 4)],
        }
    )
    assert within(allocated_after, allocated) and within(reserved_after, reserved)
    assert [served.post(seed=seed).status_code for seed in (4, 5)] == [200, 200]


def test_a_failed_phase_returns_once_its_stream_is_done():
    """`GenerationStages.run` raises a phase's error only when the phase's queued GPU work is finished: until then
    its kernels may still read the inputs the caller is about to drop."""
    stages = GenerationStages("cuda")
    streams = []

    def queue_then_fail():
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(500_000_000)  # a quarter of a second or more of GPU work, queued
        raise ValueError("the phase failed")

    try:
        with pytest.raises(ValueError, match="the phase failed"):
            stages.run("decode", queue_then_fail)
        assert streams[0].query()  # nothing left queued on the phase's stream
    finally:
        stages.close()
    release_cached_memory(torch.device("cuda"))
