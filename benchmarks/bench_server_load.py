"""Load test of `dicache serve` on loopback: throughput and p50/p95/p99 latency, with and without step caching.

Starts the server in this process on 127.0.0.1 (or targets `--url`, which must be a loopback address), then fires a
bounded number of requests from `--concurrency` client threads: a mix of Turbo-style (no CFG, `--turbo-steps`) and
Raw-style (CFG `--guidance`, `--raw-steps`) requests at `--size`, once with `enable_cache=false` and once with
`enable_cache=true` (the server's SGLANG_CACHE_DIT_* settings, plus `--cache-params` if given). Same prompts and seeds
in both passes. With `--rounds R` the two passes alternate R times (no cache, cache, no cache, ...) so that drift in
the machine's load hits both alike; figures pool the rounds. Prints a table and publishes it to `--results`
(default benchmarks/RESULTS.md: an archive file and a run-log line; `--no-results`: print only).

    python benchmarks/bench_server_load.py                                   # embedded checkpoint
    python benchmarks/bench_server_load.py --model /path/to/krea2 --requests 48 --concurrency 8
    python benchmarks/bench_server_load.py --tiny-random    # a tiny random Krea-2 (tests/tiny_krea2.py), no checkpoint
    SGLANG_CACHE_DIT_RDT=0.4 python benchmarks/bench_server_load.py --no-results
    python benchmarks/bench_server_load.py --ray-replicas 1 2 --device cpu   # Ray Serve: throughput vs replica count

With `--ray-replicas N ...` the same load runs against `dicache serve --ray --replicas N` (a subprocess starting a
local Ray cluster on this machine; one CPU per replica, and one torch thread on CPU) for each N in turn, so the table
shows throughput against replica count.

Latency is measured by the client (send to last byte, queueing included); throughput = requests / wall time of the
passes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from publish import publish  # noqa: E402

MAX_REQUESTS = 1000
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
PROMPTS = ["a red fox in the snow", "a blue car", "a smiling face with a heart", "a green tree in the sun"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder or id (default: the embedded checkpoint)")
    p.add_argument(
        "--tiny-random",
        action="store_true",
        help="serve a tiny random Krea-2 built with diffusers (tests/tiny_krea2.py)",
    )
    p.add_argument("--url", default=None, help="target an already running loopback server instead of starting one")
    p.add_argument(
        "--api-key", default=os.environ.get("DICACHE_API_KEY"), help="the --url server's key (default: DICACHE_API_KEY)"
    )
    p.add_argument(
        "--ray-replicas",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="run the load against `dicache serve --ray --replicas N` for each N (e.g. 1 2): throughput vs replicas",
    )
    p.add_argument("--requests", type=int, default=24, help=f"measured requests per pass (<= {MAX_REQUESTS})")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--rounds", type=int, default=2, help="alternating (no cache, cache) pass pairs, pooled")
    p.add_argument("--workers", type=int, default=1, help="server generation workers (in-process server)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch CPU threads (in-process server)")
    p.add_argument("--device", default=None, help="cpu, cuda ... (in-process server; default: cuda if available)")
    p.add_argument("--size", default="64x64", help="WxH of every request")
    p.add_argument("--turbo-steps", type=int, default=8)
    p.add_argument("--raw-steps", type=int, default=28)
    p.add_argument("--guidance", type=float, default=4.5, help="CFG scale of Raw-style requests (standard s)")
    p.add_argument("--mix", choices=("both", "turbo", "raw"), default="both", help="request styles to alternate")
    p.add_argument("--cache-params", default=None, help="JSON cache_dit_params sent with the cached pass")
    p.add_argument("--results", default=str(pathlib.Path(__file__).with_name("RESULTS.md")))
    p.add_argument("--no-results", action="store_true", help="do not append to the results file")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= MAX_REQUESTS:
        p.error(f"--requests={args.requests} must be between 1 and {MAX_REQUESTS}")
    if not 1 <= args.rounds <= 10 or args.requests * args.rounds > MAX_REQUESTS:
        p.error(f"--rounds={args.rounds} must be between 1 and 10, with requests x rounds <= {MAX_REQUESTS}")
    if not 1 <= args.concurrency <= 64:
        p.error(f"--concurrency={args.concurrency} must be between 1 and 64")
    if args.ray_replicas is not None and (args.url is not None or not all(1 <= n <= 64 for n in args.ray_replicas)):
        p.error(f"--ray-replicas={args.ray_replicas} must be counts between 1 and 64, without --url")
    if args.url is not None and urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"--url={args.url!r}: this benchmark only targets loopback addresses ({', '.join(LOOPBACK[:3])})")
    return args


def request_bodies(args: argparse.Namespace, count: int, offset: int = 0) -> list[dict]:
    styles = {"both": ("turbo", "raw"), "turbo": ("turbo",), "raw": ("raw",)}[args.mix]
    bodies = []
    for i in range(offset, offset + count):
        style = styles[i % len(styles)]
        body = dict(prompt=PROMPTS[i % len(PROMPTS)], size=args.size, seed=i)
        if style == "turbo":
            body.update(num_inference_steps=args.turbo_steps, guidance_scale=1.0)
        else:
            body.update(num_inference_steps=args.raw_steps, guidance_scale=args.guidance, negative_prompt="")
        bodies.append(body)
    return bodies


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def run_pass(
    url: str, bodies: list[dict], concurrency: int, cache: bool, cache_params: dict | None, key: str | None = None
) -> dict:
    """Fire `bodies` from `concurrency` threads; return the raw samples of the pass."""
    local = threading.local()

    def one(body: dict) -> tuple[float, int, dict | None]:
        client = getattr(local, "client", None) or httpx.Client(timeout=600, headers=auth_headers(key))
        local.client = client
        payload = dict(body, enable_cache=cache)
        if cache and cache_params:
            payload["cache_dit_params"] = cache_params
        start = time.perf_counter()
        response = client.post(url + "/v1/images/generations", json=payload)
        seconds = time.perf_counter() - start
        return seconds, response.status_code, response.json().get("cache_stats") if response.is_success else None

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, bodies))
    return {"wall_s": time.perf_counter() - start, "results": results}


def summarise(passes: list[dict]) -> dict:
    """Pool passes: throughput over their summed wall time, latency percentiles over all successful requests."""
    results = [r for p in passes for r in p["results"]]
    wall = sum(p["wall_s"] for p in passes)
    ok = [(seconds, stats) for seconds, code, stats in results if code == 200]
    stats = [st for _, st in ok if st]
    computed = sum(st["computed_calls"] for st in stats)
    cached = sum(st["cached_calls"] for st in stats)
    latencies = np.array([s for s, _ in ok]) if ok else np.array([float("nan")])
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "throughput_rps": len(ok) / wall,
        "p50_s": float(np.percentile(latencies, 50)),
        "p95_s": float(np.percentile(latencies, 95)),
        "p99_s": float(np.percentile(latencies, 99)),
        "mean_s": float(latencies.mean()),
        "cached_ratio": cached / (cached + computed) if cached + computed else 0.0,
        "compute_fraction": float(np.mean([st["compute_fraction"] for st in stats])) if stats else 1.0,
    }


def table(rows: dict[str, dict]) -> str:
    header = ("pass", "ok/sent", "req/s", "p50 s", "p95 s", "p99 s", "cached calls", "compute frac")
    lines = [header]
    for name, r in rows.items():
        lines.append(
            (
                name,
                f"{r['ok']}/{r['requests']}",
                f"{r['throughput_rps']:.3f}",
                f"{r['p50_s']:.3f}",
                f"{r['p95_s']:.3f}",
                f"{r['p99_s']:.3f}",
                f"{r['cached_ratio']:.1%}",
                f"{r['compute_fraction']:.3f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    load = f", 1-min load average {os.getloadavg()[0]:.1f} at the end" if hasattr(os, "getloadavg") else ""
    return f"{platform.system()} {cpu}, {os.cpu_count()} CPUs{load}, {gpu}, torch {torch.__version__}"


def append_results(
    path: pathlib.Path, args: argparse.Namespace, argv: list[str], rows: dict, info: dict, summary: list[str]
) -> None:
    """The run's section, published to the results page `path` (an archive file and a run-log line)."""
    section = [
        f"## Server load (`bench_server_load.py`), {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n",
        f"- command: `python benchmarks/bench_server_load.py {' '.join(argv)}`".rstrip() + "",
        f"- machine: {machine()}",
        f"- model: {info['model']}; server: {info['server']}",
        f"- load: {args.requests} requests per pass, {args.rounds} alternating rounds per mode, from "
        f"{args.concurrency} client threads, size {args.size}, "
        f"mix {args.mix} (turbo {args.turbo_steps} steps no CFG / raw {args.raw_steps} steps CFG {args.guidance:g}), "
        "same prompts and seeds in both passes, loopback only",
        f"- cache settings: {info['cache']}",
        "",
        table(rows),
        "",
        *summary,
        "",
    ]
    publish("\n".join(section), path)


def run_load(url: str, args: argparse.Namespace, cache_params: dict | None, key: str | None = None) -> dict[str, dict]:
    """Warm up, then alternate uncached and cached passes `args.rounds` times; the pooled rows."""
    warm = request_bodies(args, 2, offset=10_000)
    run_pass(url, warm, 2, True, cache_params, key)  # warm-up (not measured)
    bodies = request_bodies(args, args.requests)
    passes: dict[str, list[dict]] = {"no cache": [], "cache": []}
    for _ in range(args.rounds):
        passes["no cache"].append(run_pass(url, bodies, args.concurrency, False, None, key))
        passes["cache"].append(run_pass(url, bodies, args.concurrency, True, cache_params, key))
    return {name: summarise(p) for name, p in passes.items()}


def cache_description(url: str, cache_params: dict | None, key: str | None = None) -> str:
    """The server's cache settings (from `/v1/server_info`, behind the API key) and what the cached pass adds."""
    cache = httpx.get(url + "/v1/server_info", headers=auth_headers(key)).json().get("cache") or {}
    settings, sources = cache.get("settings") or {}, cache.get("sources") or {}
    base = {k: v for k, v in settings.items() if sources.get(k, "default") != "default"}
    server_cache = f"SGLANG_CACHE_DIT_* / profile values {base}" if base else "SGLang defaults (F1 B0 W4 MC3 RDT 0.24)"
    return f"{server_cache}; the cached pass adds cache_dit_params {cache_params or '{}'}"


class RayCommand:
    """`dicache serve --ray --replicas N` in a subprocess on a free loopback port; `stop()` sends SIGTERM."""

    START_TIMEOUT_S = 600

    def __init__(self, replicas: int, args: argparse.Namespace, model: str | None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        side = max(int(v) for v in args.size.lower().split("x"))
        cmd = [sys.executable, "-m", "dicache.cli", "serve", "--ray", "--replicas", str(replicas)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--cpus-per-replica", "1"]
        cmd += [
            "--max-queue",
            str(max(16, args.concurrency)),
            "--max-side",
            str(max(side, 2048)),
            "--max-steps",
            "1000",
        ]
        device = args.device or "cpu"
        cmd += ["--device", device] + (["--torch-threads", "1"] if device == "cpu" else [])
        cmd += ["--model", model] if model else []
        root = pathlib.Path(__file__).resolve().parents[1]
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
        self.log = pathlib.Path(tempfile.mkstemp(prefix="dicache-ray-", suffix=".log")[1])
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not re.search(r"dicache on Ray Serve: .* at http", self.log.read_text(errors="replace")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dicache serve --ray did not start; see {self.log}")
            time.sleep(0.5)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def main_ray(args: argparse.Namespace, argv: list[str], cache_params: dict | None) -> int:
    """Throughput against replica count: the load once per `--ray-replicas` value."""
    model = args.model
    if args.tiny_random:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
        from tiny_krea2 import build_tiny_pipeline

        model = tempfile.mkdtemp(prefix="dicache-tiny-krea2-")
        build_tiny_pipeline(pathlib.Path(model), distilled=True, seed=0)
    rows: dict[str, dict] = {}
    for replicas in args.ray_replicas:
        server = RayCommand(replicas, args, model)
        try:
            cache = cache_description(server.url, cache_params)
            for name, row in run_load(server.url, args, cache_params).items():
                rows[f"{replicas} replica(s), {name}"] = row
        finally:
            server.stop()
    print(table(rows))
    first = args.ray_replicas[0]

    def rate(n: int, mode: str) -> float:
        return rows[f"{n} replica(s), {mode}"]["throughput_rps"]

    summary = [
        f"Throughput against replicas ({mode}): "
        + ", ".join(
            f"{n}: {rate(n, mode):.3f} req/s (x{rate(n, mode) / rate(first, mode):.2f})" for n in args.ray_replicas
        )
        + "."
        for mode in ("no cache", "cache")
    ]
    print("\n".join(summary))
    if not args.no_results:
        device = args.device or "cpu"
        per_replica = "1 CPU and 1 torch thread" if device == "cpu" else "1 GPU"
        info = {
            "model": "tiny random Krea-2 (tests/tiny_krea2.py, 6 blocks, seed 0)"
            if args.tiny_random
            else args.model or "embedded checkpoint",
            "server": f"`dicache serve --ray --replicas N` for N in {args.ray_replicas} (local Ray cluster, "
            f"{per_replica} per replica, 1 worker each, device {device})",
            "cache": cache,
        }
        append_results(pathlib.Path(args.results), args, argv, rows, info, summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cache_params = json.loads(args.cache_params) if args.cache_params else None
    if args.ray_replicas is not None:
        return main_ray(args, argv, cache_params)
    server = None
    if args.url is None:
        import torch

        from dicache.server import ServerSettings, create_app, load_backend
        from dicache.server.background import BackgroundServer

        if args.torch_threads is not None:
            torch.set_num_threads(args.torch_threads)
        model = args.model
        if args.tiny_random:
            sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
            from tiny_krea2 import build_tiny_pipeline

            model = tempfile.mkdtemp(prefix="dicache-tiny-krea2-")
            build_tiny_pipeline(pathlib.Path(model), distilled=True, seed=0)
        backend = load_backend(model, device=args.device)
        side = max(int(v) for v in args.size.lower().split("x"))
        settings = ServerSettings(
            workers=args.workers, max_queue=max(16, args.concurrency), max_side=max(side, 2048), max_steps=1000
        )
        server = BackgroundServer(create_app(backend, settings)).start()
        url = server.url
        info = {
            "model": "tiny random Krea-2 (tests/tiny_krea2.py, 6 blocks, seed 0)"
            if args.tiny_random
            else args.model or "embedded checkpoint",
            "server": f"in-process, {args.workers} worker(s), torch threads {torch.get_num_threads()}, "
            f"device {backend.pipe.device}",
        }
    else:
        url = args.url.rstrip("/")
        models = httpx.get(url + "/v1/models", headers=auth_headers(args.api_key)).json()
        info = {"model": models["data"][0]["id"], "server": f"external {url}"}
    key = args.api_key if args.url is not None else None
    info["cache"] = cache_description(url, cache_params, key)
    try:
        rows = run_load(url, args, cache_params, key)
    finally:
        if server is not None:
            server.stop()
    speedup = rows["cache"]["throughput_rps"] / rows["no cache"]["throughput_rps"]
    print(table(rows))
    print(f"throughput with caching: x{speedup:.2f}")
    if not args.no_results:
        summary = [f"Throughput with caching: x{speedup:.2f}."]
        append_results(pathlib.Path(args.results), args, argv, rows, info, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
