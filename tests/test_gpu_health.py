"""GPU health in /metrics (`dicache.server.gpu_health`): temperature, SM clock, power, throttle reasons and memory
through NVML, read at each scrape; absent without NVML, and nothing fails. A fake NVML module with the real binding's
names (nvidia-ml-py's `pynvml`) stands in on the CPU; a gpu-marked test reads the real one."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("prometheus_client")

from dicache.server.gpu_health import THROTTLE_REASONS, GpuHealth  # noqa: E402
from dicache.server.metrics import ServerMetrics  # noqa: E402


class FakeNVMLError(Exception):
    pass


def fake_nvml(*, temperature=71, clock_mhz=1470, power_mw=690_000, limit_mw=700_000, reasons=0x4, fail_init=False):
    """A module with the names the code calls on `pynvml`, answering for one GPU at index 0."""
    real = pytest.importorskip("pynvml")
    module = types.SimpleNamespace(NVMLError=FakeNVMLError, calls=[])
    for name in ("NVML_TEMPERATURE_GPU", "NVML_CLOCK_SM", *THROTTLE_REASONS.values()):
        setattr(module, name, getattr(real, name))  # the real binding's constants

    def init():
        if fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")

    module.nvmlInit = init
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda index: f"handle{index}"
    module.nvmlDeviceGetName = lambda handle: b"NVIDIA H200"
    module.nvmlDeviceGetTemperature = lambda handle, sensor: temperature
    module.nvmlDeviceGetClockInfo = lambda handle, clock: clock_mhz
    module.nvmlDeviceGetPowerUsage = lambda handle: power_mw
    module.nvmlDeviceGetEnforcedPowerLimit = lambda handle: limit_mw
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=26_100_000_000, total=143_000_000_000)
    module.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: reasons
    module.nvmlDeviceGetComputeRunningProcesses = lambda handle: [
        types.SimpleNamespace(pid=1, usedGpuMemory=10),
        types.SimpleNamespace(pid=4242, usedGpuMemory=26_000_000_000),
    ]
    for name in dir(real):  # every function the fake does not answer is one the code must not need
        if name.startswith("nvml") and callable(getattr(real, name)) and not hasattr(module, name):
            setattr(module, name, _unexpected(name))
    return module


def _unexpected(name):
    def call(*args):
        raise AssertionError(f"unexpected NVML call {name}")

    return call


def _samples(metrics: ServerMetrics) -> dict[tuple, float]:
    text = metrics.render()[0].decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("dicache_gpu_"):
            name_labels, value = line.rsplit(" ", 1)
            found[name_labels] = float(value)
    return found


def test_metrics_carry_the_gpus_health_read_at_each_scrape():
    nvml = fake_nvml()
    metrics = ServerMetrics()
    assert metrics.watch_gpus([0], nvml) is True
    samples = _samples(metrics)
    labels = 'gpu="0",name="NVIDIA H200"'
    assert samples[f"dicache_gpu_temperature_celsius{{{labels}}}"] == 71
    assert samples[f"dicache_gpu_sm_clock_hertz{{{labels}}}"] == 1.47e9
    assert samples[f"dicache_gpu_power_watts{{{labels}}}"] == 690
    assert samples[f"dicache_gpu_power_limit_watts{{{labels}}}"] == 700
    assert samples[f"dicache_gpu_memory_used_bytes{{{labels}}}"] == 26.1e9
    assert samples[f'dicache_gpu_clock_throttled{{{labels},reason="sw_power_cap"}}'] == 1  # 0x4
    assert samples[f'dicache_gpu_clock_throttled{{{labels},reason="hw_thermal"}}'] == 0
    assert len([k for k in samples if k.startswith("dicache_gpu_clock_throttled")]) == len(THROTTLE_REASONS)

    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: 79  # read again at the next scrape
    assert _samples(metrics)[f"dicache_gpu_temperature_celsius{{{labels}}}"] == 79


def test_a_reading_nvml_refuses_is_left_out_and_the_rest_stays():
    nvml = fake_nvml()

    def not_supported(handle):
        raise FakeNVMLError("Not Supported")

    nvml.nvmlDeviceGetPowerUsage = not_supported
    metrics = ServerMetrics()
    metrics.watch_gpus([0], nvml)
    samples = _samples(metrics)
    assert not any(k.startswith("dicache_gpu_power_watts") for k in samples)
    assert any(k.startswith("dicache_gpu_temperature_celsius") for k in samples)


def test_without_nvml_there_are_no_gpu_metrics_and_nothing_fails(monkeypatch):
    metrics = ServerMetrics()
    assert metrics.watch_gpus([0], fake_nvml(fail_init=True)) is False
    assert not _samples(metrics)
    assert b"dicache_http_requests" in metrics.render()[0]  # the rest of the metrics as before
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # the binding not installed
    assert GpuHealth.open([0]) is None


def test_process_memory_is_what_nvml_lists_for_the_process():
    health = GpuHealth.open([0], fake_nvml())
    assert health.process_memory(4242) == 26_000_000_000
    assert health.process_memory(7) is None


def test_the_app_watches_the_served_gpu_only_on_cuda(monkeypatch):
    import torch
    from server_helpers import backend_with_env

    from dicache.server import app as app_module

    watched = []
    monkeypatch.setattr(ServerMetrics, "watch_gpus", lambda self, devices, nvml=None: watched.append(devices))

    class Seen:
        """`real` as the app sees it, with `overrides` in place of its attributes."""

        def __init__(self, real, **overrides):
            self._real, self.__dict__["_overrides"] = real, overrides

        def __getattr__(self, name):
            return self._overrides[name] if name in self._overrides else getattr(self._real, name)

    backend = backend_with_env(None, {})
    try:
        for device, expected in ((torch.device("cpu"), []), (torch.device("cuda", 0), [[torch.device("cuda", 0)]])):
            watched.clear()
            app_module.create_app(Seen(backend, pipe=Seen(backend.pipe, device=device)))
            assert watched == expected
    finally:
        backend.close()


@pytest.mark.gpu
def test_the_real_gpu_reports_its_health():
    import torch

    metrics = ServerMetrics()
    assert metrics.watch_gpus([torch.device("cuda", 0)]), (
        "NVML unavailable on a CUDA machine (pip install nvidia-ml-py)"
    )
    samples = _samples(metrics)
    temperature = next(v for k, v in samples.items() if k.startswith("dicache_gpu_temperature_celsius"))
    clock = next(v for k, v in samples.items() if k.startswith("dicache_gpu_sm_clock_hertz"))
    power = next(v for k, v in samples.items() if k.startswith("dicache_gpu_power_watts"))
    assert 10 < temperature < 110 and 1e8 < clock < 4e9 and 10 < power < 2000, samples
    torch.ones(1, device="cuda")
    assert metrics.gpu_health.process_memory() > 0  # this process's CUDA context, as nvidia-smi lists it
    print(samples)
