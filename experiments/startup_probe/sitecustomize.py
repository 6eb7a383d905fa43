"""Where a `dicache serve` start-up spends its seconds, and why a compile-cache lookup missed: a GPU probe, loaded by
Python at start-up (`sitecustomize`) when this folder leads PYTHONPATH and `DICACHE_PROBE_OUT` names a folder.

    PYTHONPATH=experiments/startup_probe:$PYTHONPATH DICACHE_PROBE_OUT=/tmp/probe bash benchmarks/gpu/startup.sh ...
    python experiments/startup_probe/summarise.py /tmp/probe

Only in processes whose command line has the word `serve` or runs `tests/artifact_worker.py` (not the benchmark
driving them). In each:
- a sampler thread takes every thread's stack each `DICACHE_PROBE_PERIOD_S` (default 0.05 s) for the first
  `DICACHE_PROBE_SECONDS` (default 150 s), and rewrites `probe-<pid>.json` (stacks and samples) each second, so a
  killed process leaves what it had;
- the hash details of inductor's FX graph cache and AOT autograd's cache (what each key is made of, logged at DEBUG)
  are appended to `hash-<pid>.log`, to tell a cold process's keys from a process with the artifact.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

OUT = os.environ.get("DICACHE_PROBE_OUT")
CACHE_LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")
IDLE = ("wait", "_wait_for_tstate_lock", "select", "poll", "get", "sleep", "accept", "run_forever", "_worker")


def _frame_name(frame) -> str:
    code = frame.f_code
    parts = code.co_filename.replace("\\", "/").split("/")
    for anchor in ("dicache", "torch", "torchao", "transformers", "triton", "safetensors", "uvicorn"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) :]) + f":{code.co_name}:{frame.f_lineno}"
    return f"{parts[-1]}:{code.co_name}:{frame.f_lineno}"


def _start(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    pid, started = os.getpid(), time.time()
    period = float(os.environ.get("DICACHE_PROBE_PERIOD_S", "0.05"))
    seconds = float(os.environ.get("DICACHE_PROBE_SECONDS", "150"))
    stacks: dict[tuple, int] = {}
    samples: list[tuple[float, str, int]] = []

    def dump() -> None:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        record = {
            "argv": sys.argv,
            "started": started,
            "period_s": period,
            "stacks": [list(stack) for stack, _ in sorted(stacks.items(), key=lambda item: item[1])],
            "samples": samples,
            "threads": {str(k): v for k, v in names.items()},
        }
        path = os.path.join(out, f"probe-{pid}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(path + ".tmp", path)

    def hash_details() -> None:
        handler = logging.FileHandler(os.path.join(out, f"hash-{pid}.log"))
        handler.addFilter(lambda record: "hash details" in record.getMessage())
        for name in CACHE_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(handler)

    def sample() -> None:
        me, last_dump, hooked = threading.get_ident(), time.time(), False
        while time.time() - started < seconds:
            time.sleep(period)
            now = time.time()
            if not hooked and "torch._functorch._aot_autograd.autograd_cache" in sys.modules:
                hash_details()
                hooked = True
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None and len(stack) < 60:
                    stack.append(_frame_name(frame))
                    frame = frame.f_back
                if stack and stack[0].split(":")[1] in IDLE:
                    continue
                key = tuple(reversed(stack))
                index = stacks.setdefault(key, len(stacks))
                samples.append((round(now - started, 3), names.get(ident, str(ident)), index))
            if now - last_dump > 1.0:
                dump()
                last_dump = now
        dump()

    threading.Thread(target=sample, name="dicache-probe", daemon=True).start()


if OUT and ("serve" in sys.argv or any(arg.endswith("artifact_worker.py") for arg in sys.argv)):
    _start(OUT)
