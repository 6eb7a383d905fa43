"""The server's operational contract measured on a GPU: authentication, the achieved-TFLOP/s metric, how fast a timed
out generation frees its worker, and the SIGTERM drain, all through `dicache serve` as a user starts it.

It starts `dicache serve --load-format dummy` on a full-size Krea-2 (random weights, the config-only folder of
`bench_serving.py`) with the API key in `DICACHE_API_KEY`, and measures:

1. auth: `/v1/*` without a key and with a wrong key (401, OpenAI error shape), with the key through the `openai`
   client when it is installed (else httpx); whether the key appears in the server log;
2. achieved TFLOP/s: Turbo requests with caching off and with SGLang's default pattern; per generation, the
   server's `dicache_transformer_flops_total` and `dicache_generation_achieved_tflops` (scraped from `/metrics`),
   next to the client's latency;
3. timeout: a request far longer than `--timeout` (Raw 50 steps, CFG, n images): when the 504 arrives, and how long
   after it `dicache_generations_running` drops to 0 (the worker is free), then the latency of the next request;
4. drain: requests in flight, then SIGTERM: what a new request gets (503 + Retry-After), what the accepted ones
   get, the exit status and the time to exit; then a second server with a short `--drain-timeout` and a generation
   that cannot finish in it (answered 503, exit 0 within the grace period).

    python benchmarks/bench_server_ops.py --results benchmarks/RESULTS.md      # H200, eager: ~3 min
    python benchmarks/bench_server_ops.py --tiny --device cpu                   # logic check on a CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serving import (  # noqa: E402
    CACHE_MODES,
    ROOT,
    VARIANTS,
    free_port,
    wait_healthy,
    wait_steady,
    write_model_folder,
)
from publish import command_line, markdown_table, publish  # noqa: E402

API_KEY = "bench-ops-7f3c2a9e41d0"


# ----------------------------------------------------------------------------------------------------- server
def start_server(args, model_dir: pathlib.Path, log_path: pathlib.Path, *, timeout_s: float, drain_s: float):
    """`dicache serve` with the key in the environment (not on the command line); returns (process, command)."""
    cmd = [sys.executable, "-m", "dicache.cli", "serve", "--model", str(model_dir), "--load-format", "dummy"]
    cmd += ["--port", str(args.port), "--device", args.device, "--workers", "1", "--max-queue", "8"]
    cmd += ["--timeout", str(timeout_s), "--drain-timeout", str(drain_s), "--log-level", "info"]
    if args.tiny:
        cmd += ["--torch-threads", "1"]
    env = {**os.environ, "DICACHE_API_KEY": API_KEY, "SGLANG_CACHE_DIT_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    log = open(log_path, "w")  # noqa: SIM115 - closed by finish()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc, " ".join(cmd[1:])


def finish(proc, wait_s: float = 120) -> int | None:
    """Wait for the process to exit (SIGKILL after `wait_s`); its exit status, None if it had to be killed."""
    try:
        return proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    finally:
        proc.log.close()


# ----------------------------------------------------------------------------------------------------- client
def headers(key: str | None = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def body(args, variant: str, cache: str = "off", n: int = 1, seed: int = 0, size: int | None = None) -> dict:
    steps, guidance = VARIANTS[variant]
    size = size or (128 if args.tiny else args.size)
    return {
        "prompt": "a red apple on a wooden table",
        "size": f"{size}x{size}",
        "n": n,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "seed": seed,
        **CACHE_MODES[cache],
    }


def post(url: str, payload: dict, key: str | None = API_KEY, timeout: float = 1800):
    import httpx

    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/images/generations", json=payload, headers=headers(key), timeout=timeout)
    return r, time.perf_counter() - start


def metric(url: str, name: str) -> float:
    """The sum of every sample of `name` on `/metrics` (0 when absent)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(1))
    return total


# ----------------------------------------------------------------------------------------------------- phases
def auth_phase(args, url: str) -> list[dict]:
    rows = []
    for label, key in (("no key", None), ("wrong key", "not-the-key")):
        r, _ = post(url, body(args, "turbo"), key=key)
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        rows.append({"check": f"/v1/images/generations, {label}", "result": f"{r.status_code} {err.get('type')}"})
    try:
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
        start = time.perf_counter()
        size = 128 if args.tiny else args.size
        steps = {
            "num_inference_steps": VARIANTS["turbo"][0],
            "guidance_scale": VARIANTS["turbo"][1],
            "enable_cache": False,
        }
        out = client.images.generate(model="krea-2", prompt="a cat", size=f"{size}x{size}", extra_body=steps)
        seconds = time.perf_counter() - start
        rows.append({"check": "openai client with the key", "result": f"{len(out.data)} image in {seconds:.2f} s"})
    except ImportError:
        r, seconds = post(url, body(args, "turbo"))
        rows.append({"check": "httpx with the key (openai not installed)", "result": f"{r.status_code} {seconds:.2f}s"})
    return rows


def tflops_phase(args, url: str) -> list[dict]:
    rows = []
    for cache in ("off", "sglang"):
        post(url, body(args, "turbo", cache))  # warm-up (kernels, allocator) outside the figures
        flops0 = metric(url, "dicache_transformer_flops_total")
        sum0 = metric(url, "dicache_generation_achieved_tflops_sum")
        count0 = metric(url, "dicache_generation_achieved_tflops_count")
        latencies = []
        for i in range(args.requests):
            r, seconds = post(url, body(args, "turbo", cache, seed=i))
            assert r.status_code == 200, r.text[:300]
            latencies.append(seconds)
        count = metric(url, "dicache_generation_achieved_tflops_count") - count0
        rows.append(
            {
                "cache": cache,
                "generations": int(count),
                "client latency mean (s)": round(sum(latencies) / len(latencies), 3),
                "TFLOP per generation": round(
                    (metric(url, "dicache_transformer_flops_total") - flops0) / count / 1e12, 3
                ),
                "achieved TFLOP/s (server metric, mean)": round(
                    (metric(url, "dicache_generation_achieved_tflops_sum") - sum0) / count, 3
                ),
            }
        )
    return rows


def timeout_phase(args, url: str, timeout_s: float) -> dict:
    running0 = metric(url, "dicache_generations_running")
    r, answered_s = post(url, body(args, "raw", n=args.long_n, size=args.long_side))
    start = time.perf_counter()
    while metric(url, "dicache_generations_running") > running0 and time.perf_counter() - start < 600:
        time.sleep(0.02)
    freed_s = time.perf_counter() - start
    nxt, next_s = post(url, body(args, "turbo"))
    return {
        "request": f"raw 50 steps CFG, n={args.long_n}, {args.long_side or 'same size'}, --timeout {timeout_s:g}",
        "status": r.status_code,
        "answered after (s)": round(answered_s, 2),
        "worker busy after the answer (s)": round(freed_s, 3),
        "next turbo request": f"{nxt.status_code} in {next_s:.2f} s",
    }


def drain_phase(args, url: str, proc, *, variant: str, in_flight: int, drain_s: float) -> dict:
    """`in_flight` requests of `variant`, SIGTERM once the first runs, then one new request; what each got."""
    pool = concurrent.futures.ThreadPoolExecutor(in_flight + 1)
    futures = [pool.submit(post, url, body(args, variant, seed=i)) for i in range(in_flight)]
    start = time.perf_counter()
    while metric(url, "dicache_generations_running") < 1 and time.perf_counter() - start < 120:
        time.sleep(0.02)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    sigterm = time.perf_counter()
    time.sleep(0.3)
    late, _ = post(url, body(args, "turbo"), timeout=30)
    code = finish(proc, wait_s=drain_s + 60)
    exit_s = time.perf_counter() - sigterm
    answers = [f.result()[0] for f in futures]
    pool.shutdown()
    return {
        "in flight at SIGTERM": f"{in_flight} x {variant}",
        "--drain-timeout (s)": drain_s,
        "new request during drain": f"{late.status_code}, Retry-After {late.headers.get('retry-after')}",
        "accepted requests got": ", ".join(str(a.status_code) for a in answers),
        "exit status": code,
        "SIGTERM to exit (s)": round(exit_s, 2),
    }


# ----------------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    work = pathlib.Path(tempfile.mkdtemp(prefix="dicache-ops-"))
    model_dir = write_model_folder(work / "krea2-config", args.tiny)
    out_dir = pathlib.Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    results: dict = {"commands": []}

    log1 = out_dir / "serve_ops_1.log"
    proc, command = start_server(args, model_dir, log1, timeout_s=args.timeout, drain_s=args.drain_timeout)
    results["commands"].append(command)
    try:
        results["ready_s"] = round(wait_healthy(url, proc, args.start_timeout), 1)
        results["lengths_after_ready_s"] = wait_steady(url, args.start_timeout, headers())  # the timed phases: steady
        print(f"ready in {results['ready_s']} s: {command}", flush=True)
        results["auth"] = auth_phase(args, url)
        print(results["auth"], flush=True)
        results["tflops"] = tflops_phase(args, url)
        print(results["tflops"], flush=True)
        results["timeout"] = timeout_phase(args, url, args.timeout)
        print(results["timeout"], flush=True)
        results["drain"] = [drain_phase(args, url, proc, variant="turbo", in_flight=3, drain_s=args.drain_timeout)]
    finally:
        if proc.poll() is None:
            proc.kill()
            finish(proc)
    results["key_in_log"] = API_KEY in log1.read_text()

    args.port = free_port()
    url = f"http://127.0.0.1:{args.port}"
    proc, command = start_server(args, model_dir, out_dir / "serve_ops_2.log", timeout_s=600, drain_s=args.short_drain)
    results["commands"].append(command)
    try:
        wait_healthy(url, proc, args.start_timeout)
        results["drain"].append(drain_phase(args, url, proc, variant="raw", in_flight=1, drain_s=args.short_drain))
    finally:
        if proc.poll() is None:
            proc.kill()
            finish(proc)
    print(results["drain"], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return results


def table(rows: list[dict]) -> list[str]:
    return markdown_table(rows, list(rows[0]))


def markdown(results: dict, args, command: str) -> str:
    import platform

    import torch

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine() + " CPU"
    size = 128 if args.tiny else args.size
    lines = [
        "\n## Server operations on a GPU: auth, achieved TFLOP/s, timeout, drain "
        f"({datetime.datetime.now():%Y-%m-%d %H:%M})\n",
        f"- command: `{command}`",
        f"- machine: {device}; torch {torch.__version__}",
        f"- model: {'tiny (embedded configs)' if args.tiny else 'full-size Krea-2'} with random weights "
        f"(`--load-format dummy`), {size}², eager, 1 worker; ready in {results['ready_s']} s",
        "- servers: " + "; ".join(f"`{c}`" for c in results["commands"]) + " (key in `DICACHE_API_KEY`)",
        f"- API key found in the server log: {'yes' if results['key_in_log'] else 'no'}\n",
        *table(results["auth"]),
        "",
        *table(results["tflops"]),
        "",
        *table([results["timeout"]]),
        "",
        *table(results["drain"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the embedded checkpoint's configs (a logic check)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=int, default=1024, help="image side of the full-size runs")
    p.add_argument("--requests", type=int, default=3, help="timed Turbo requests per cache mode")
    p.add_argument("--timeout", type=float, default=8.0, help="the first server's --timeout (s)")
    p.add_argument("--long-n", type=int, default=2, help="images of the request that outlives --timeout")
    p.add_argument("--long-side", type=int, default=None, help="image side of that request (default: --size)")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="the first server's --drain-timeout (s)")
    p.add_argument("--short-drain", type=float, default=3.0, help="the second server's --drain-timeout (s)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--port", type=int, default=0, help="first server's port (default: a free one)")
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    args.port = args.port or free_port()
    results = run(args)
    command = command_line("bench_server_ops.py", argv)
    publish(markdown(results, args, command), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
