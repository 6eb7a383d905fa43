"""GPU health through NVML (nvidia-ml-py, module `pynvml`, in the serve extra): temperature, SM clock, power draw and
limit, clock throttle reasons, memory used, and the memory one process holds (what `nvidia-smi` shows for it).

`GpuHealth.open(devices)` returns None where NVML cannot answer (no `pynvml`, no driver, a CPU machine), and every
reading skips what the GPU does not report, so a server without NVML exports nothing here and nothing fails.
`GpuHealthCollector` puts the readings in a Prometheus registry, read at each scrape (`/metrics`):

- `dicache_gpu_temperature_celsius{gpu,name}`: the die temperature (operators drain GPUs above 75-78 °C);
- `dicache_gpu_sm_clock_hertz{gpu,name}`: the SM clock now (compute slows with it, whatever the utilisation says);
- `dicache_gpu_power_watts{gpu,name}` / `dicache_gpu_power_limit_watts{gpu,name}`: power draw and its enforced cap;
- `dicache_gpu_clock_throttled{gpu,name,reason}`: 1 while NVML reports that reason for holding the clocks down
  (`THROTTLE_REASONS`: power cap, thermal slowdowns, power brake...), else 0;
- `dicache_gpu_memory_used_bytes{gpu,name}`: device memory in use, all processes.

Beside `dicache_generation_achieved_tflops` (the tensor-core work the requests got) these tell a slow GPU (hot,
power-capped, clocked down) from a busy one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dicache.server")

THROTTLE_REASONS: dict[str, str] = {
    "gpu_idle": "nvmlClocksThrottleReasonGpuIdle",
    "applications_clocks": "nvmlClocksThrottleReasonApplicationsClocksSetting",
    "sw_power_cap": "nvmlClocksThrottleReasonSwPowerCap",
    "hw_slowdown": "nvmlClocksThrottleReasonHwSlowdown",
    "sync_boost": "nvmlClocksThrottleReasonSyncBoost",
    "sw_thermal": "nvmlClocksThrottleReasonSwThermalSlowdown",
    "hw_thermal": "nvmlClocksThrottleReasonHwThermalSlowdown",
    "hw_power_brake": "nvmlClocksThrottleReasonHwPowerBrakeSlowdown",
    "display_clocks": "nvmlClocksThrottleReasonDisplayClockSetting",
}
"""The `reason` label of `dicache_gpu_clock_throttled` -> the pynvml bit constant it reads."""


@dataclass
class GpuReading:
    """One GPU's state at one moment; None where NVML did not answer. Units: °C, Hz, W, bytes."""

    gpu: str
    name: str
    temperature_c: float | None = None
    sm_clock_hz: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    memory_used_bytes: float | None = None
    throttled: dict[str, bool] = field(default_factory=dict)


class GpuHealth:
    """NVML handles of the GPUs a server uses (`open`), read on demand (`readings`, `process_memory`)."""

    def __init__(self, nvml: Any, handles: dict[str, Any]) -> None:
        self.nvml, self.handles = nvml, handles
        self.names = {gpu: _text(self._ask(nvml.nvmlDeviceGetName, handle)) for gpu, handle in handles.items()}

    @classmethod
    def open(cls, devices: Sequence[Any] = (), nvml: Any = None) -> GpuHealth | None:
        """NVML for `devices` (torch CUDA devices or their indices, as this process numbers them; empty: every GPU
        NVML sees), each labelled by its torch index; None when NVML is unavailable. `nvml`: the binding (default:
        `import pynvml`)."""
        if nvml is None:
            try:
                import pynvml as nvml  # the serve extra (nvidia-ml-py): absent, no GPU metrics
            except ImportError:
                return None
        try:
            nvml.nvmlInit()
            handles = _handles(nvml, devices)
        except Exception as exc:  # pynvml raises NVMLError subclasses; a broken driver may raise others
            log.info("GPU health metrics off: NVML unavailable (%s: %s)", type(exc).__name__, exc)
            return None
        return cls(nvml, handles) if handles else None

    def _ask(self, function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except Exception:  # an NVMLError_NotSupported / NoPermission reading, or a lost GPU: that value is absent
            return None

    def readings(self) -> list[GpuReading]:
        nvml = self.nvml
        found = []
        for gpu, handle in self.handles.items():
            reading = GpuReading(gpu, self.names.get(gpu) or "unknown")
            reading.temperature_c = self._ask(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            clock = self._ask(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
            reading.sm_clock_hz = None if clock is None else clock * 1e6
            power = self._ask(nvml.nvmlDeviceGetPowerUsage, handle)
            reading.power_w = None if power is None else power / 1000
            limit = self._ask(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            reading.power_limit_w = None if limit is None else limit / 1000
            memory = self._ask(nvml.nvmlDeviceGetMemoryInfo, handle)
            reading.memory_used_bytes = None if memory is None else float(memory.used)
            mask = self._ask(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
            if mask is not None:
                reading.throttled = {
                    reason: bool(mask & getattr(nvml, constant))
                    for reason, constant in THROTTLE_REASONS.items()
                    if hasattr(nvml, constant)
                }
            found.append(reading)
        return found

    def process_memory(self, pid: int | None = None) -> int | None:
        """Bytes process `pid` (default: this one) holds on these GPUs, as nvidia-smi lists them (the CUDA context
        included); None when NVML does not say (no such process listed, or no permission to see it)."""
        pid = os.getpid() if pid is None else pid
        total, seen = 0, False
        for handle in self.handles.values():
            for process in self._ask(self.nvml.nvmlDeviceGetComputeRunningProcesses, handle) or ():
                used = getattr(process, "usedGpuMemory", None)
                if getattr(process, "pid", None) == pid and used is not None:
                    total, seen = total + int(used), True
        return total if seen else None

    def close(self) -> None:
        self._ask(self.nvml.nvmlShutdown)


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _handles(nvml: Any, devices: Sequence[Any]) -> dict[str, Any]:
    """NVML handles by torch device index: matched by UUID when torch reports it (CUDA_VISIBLE_DEVICES may reorder
    and hide GPUs), else by index."""
    if not devices:
        return {str(i): nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())}
    handles = {}
    for device in devices:
        index = device if isinstance(device, int) else getattr(device, "index", None)
        index = _current_index() if index is None else index
        uuid = _torch_uuid(index)
        if uuid is not None and hasattr(nvml, "nvmlDeviceGetHandleByUUID"):
            handles[str(index)] = nvml.nvmlDeviceGetHandleByUUID(uuid)
        else:
            handles[str(index)] = nvml.nvmlDeviceGetHandleByIndex(index)
    return handles


def _current_index() -> int:
    import torch  # the server has it loaded already; the metrics module alone does not need it

    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _torch_uuid(index: int) -> str | None:
    """NVML's UUID text of torch's CUDA device `index` ("GPU-..."), or None where torch cannot tell."""
    import torch  # the server has it loaded already; the metrics module alone does not need it

    if not torch.cuda.is_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else f"GPU-{uuid}"


class GpuHealthCollector:
    """A Prometheus collector of `GpuHealth.readings()` (the module docstring lists the series)."""

    def __init__(self, health: GpuHealth) -> None:
        self.health = health

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily  # the serve extra, as the rest of the metrics

        gauges = {
            "temperature_c": GaugeMetricFamily(
                "dicache_gpu_temperature_celsius", "GPU die temperature", labels=["gpu", "name"]
            ),
            "sm_clock_hz": GaugeMetricFamily("dicache_gpu_sm_clock_hertz", "GPU SM clock", labels=["gpu", "name"]),
            "power_w": GaugeMetricFamily("dicache_gpu_power_watts", "GPU power draw", labels=["gpu", "name"]),
            "power_limit_w": GaugeMetricFamily(
                "dicache_gpu_power_limit_watts", "GPU enforced power limit", labels=["gpu", "name"]
            ),
            "memory_used_bytes": GaugeMetricFamily(
                "dicache_gpu_memory_used_bytes", "GPU memory in use, all processes", labels=["gpu", "name"]
            ),
        }
        throttled = GaugeMetricFamily(
            "dicache_gpu_clock_throttled",
            "1 while NVML reports this reason for holding the GPU's clocks down",
            labels=["gpu", "name", "reason"],
        )
        for reading in self.health.readings():
            for attribute, gauge in gauges.items():
                value = getattr(reading, attribute)
                if value is not None:
                    gauge.add_metric([reading.gpu, reading.name], float(value))
            for reason, on in reading.throttled.items():
                throttled.add_metric([reading.gpu, reading.name, reason], 1.0 if on else 0.0)
        yield from (gauge for gauge in gauges.values() if gauge.samples)
        if throttled.samples:
            yield throttled

    def describe(self) -> list:
        return []  # read at each scrape: nothing to check at registration
