"""Soak: thousands of mixed requests against `dicache serve`, then whether anything leaked or went missing.

A `dicache serve` process (the embedded tiny checkpoint with `--tiny`, else a full-size Krea-2 with random weights,
`--load-format dummy`, as `bench_serving.py` builds it) gets `--requests` requests from `--concurrency` clients after
`--warmup` requests of the same mixture. The mixture (seeded, so every run sends the same requests in the same order):
generations of several sizes, step counts, CFG on and off, one or two images, every output format and four cache
settings (off; on with the server's defaults; SGLang's pattern forced by an always-passing threshold; a static step
mask with TaylorSeer), clients that disconnect mid-request (during the generation, or in the middle of their body),
and bad bodies (each a 400 of another kind).

Checked, each a row of the table:
- nothing lost: the server's `dicache_http_requests_total` for the endpoint equals the requests sent, every
  generation and bad body got its expected status (200 / 400), every cancelled one 499 (or 200 when it finished
  before the client left), and no answer was a 5xx;
- nothing leaked: the server's resident memory, open file descriptors and threads (and on CUDA the allocator's
  allocated and reserved bytes) when idle after the run are within `--tolerance` (2 %) of their level when idle after
  the warm-up; every client connection is closed at both measurements;
- the latency of generations stays put: P99 of the last third of the run against the first third, at most
  `--p99-ratio` times as high.

    python benchmarks/bench_soak.py --tiny --device cpu --requests 2000      # CPU, 2 cores: ~1.5 min
    python benchmarks/bench_soak.py --requests 600 --out $OUT/soak.json      # H200, full size: ~5 min
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import pathlib
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from publish import command_line, markdown_table, publish  # noqa: E402

GENERATIONS = "/v1/images/generations"
PROMPTS = (
    "a cat",
    "a red apple on a wooden table",
    "grinning face with big eyes",
    "a rocket flying over snowy mountains at night, stars above, a long exposure photograph",
    "a small house with a green door and a tree beside it, in the style of a children's book illustration",
)
CACHE_SETTINGS = {
    "off": {"enable_cache": False},
    "default": {"enable_cache": True},
    "forced": {"enable_cache": True, "cache_dit_params": {"residual_diff_threshold": 1e9, "max_warmup_steps": 1}},
    "mask": {
        "enable_cache": True,
        "cache_dit_params": {
            "scm_compute_bins": [3, 1, 1],  # 8 steps covered: every step count of the mixture
            "scm_cache_bins": [1, 1, 1],
            "scm_policy": "static",
            "Fn_compute_blocks": 0,
            "max_warmup_steps": 0,
            "enable_taylorseer": True,
        },
    },
}
BAD_BODIES = (  # (body, content type): each a 400 of another kind
    (b'{"prompt": "a cat", "size": "17x17"}', "application/json"),
    (b'{"prompt": "a cat", "n": "2"}', "application/json"),
    (b'{"prompt": "a cat", "no_such_field": 1}', "application/json"),
    (b'{"prompt": "a cat", "size": ', "application/json"),
    (b"", "application/json"),
    (b"[1, 2, 3]", "application/json"),
    (b'{"prompt": "a cat", "cache_dit_params": {"no_such_key": 1}}', "application/json"),
    (b'{"prompt": "a cat", "num_inference_steps": 100000}', "application/json"),
    (b'{"prompt": "a cat"}', "text/plain"),
    (b'{"prompt": "a cat", "guidance_scale": 0.5}', "application/json"),
    (b'{"prompt": "a cat", "enable_cache": "yes"}', "application/json"),
)
MODES = {  # sizes, steps, cancel delays (s): the tiny model on a CPU, the full-size one on a GPU
    "tiny": {"sizes": (16, 32), "steps": (1, 2), "cancel_s": (0.0, 0.1)},
    "full": {"sizes": (256, 384, 512), "steps": (4, 8), "cancel_s": (0.0, 0.6)},
}
MIX = {"generate": 0.7, "cancelled": 0.15, "bad": 0.15}


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    kind: str  # generate | cancelled | bad
    body: bytes
    content_type: str = "application/json"
    images: int = 1
    cancel_after_s: float = 0.0
    cut_body: bool = False  # a cancelled client that leaves in the middle of its body


def plan_requests(count: int, mode: str, seed: int, start: int = 0) -> list[Request]:
    """`count` requests of the mixture (`MIX`), numbered from `start`; the same `seed` gives the same requests."""
    rng = random.Random(seed * 1_000_003 + start)
    shape = MODES[mode]
    requests = []
    for index in range(start, start + count):
        kind = rng.choices(tuple(MIX), weights=tuple(MIX.values()))[0]
        if kind == "bad":
            body, content_type = BAD_BODIES[rng.randrange(len(BAD_BODIES))]
            requests.append(Request(index, kind, body, content_type))
            continue
        side = rng.choice(shape["sizes"])
        n = 2 if rng.random() < 0.1 else 1
        body = {
            "prompt": rng.choice(PROMPTS),
            "size": f"{side}x{side}",
            "n": n,
            "num_inference_steps": rng.choice(shape["steps"]),
            "guidance_scale": 4.5 if rng.random() < 0.1 else 1.0,
            "seed": rng.randrange(1 << 31),
            "output_format": rng.choices(("png", "jpeg", "webp"), weights=(0.8, 0.1, 0.1))[0],
            **CACHE_SETTINGS[rng.choice(tuple(CACHE_SETTINGS))],
        }
        delay = rng.uniform(*shape["cancel_s"]) if kind == "cancelled" else 0.0
        cut = kind == "cancelled" and rng.random() < 0.3
        requests.append(Request(index, kind, json.dumps(body).encode(), images=n, cancel_after_s=delay, cut_body=cut))
    return requests


# ----------------------------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log_path: pathlib.Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dicache.cli", "serve", "--port", str(port), "--device", args.device]
    cmd += ["--max-queue", "64", "--log-level", "warning", "--prepare-text-lengths", "false"]
    if args.tiny:
        cmd += ["--default-size", "32x32", "--torch-threads", str(args.torch_threads)]
    else:
        from bench_serving import write_model_folder

        folder = write_model_folder(pathlib.Path(tempfile.mkdtemp()) / "krea2-config", tiny=False)
        cmd += ["--model", str(folder), "--load-format", "dummy", "--variant", "turbo"]
    if args.workers is not None:
        cmd += ["--workers", str(args.workers)]
    cmd += args.server_args.split()
    env = {**os.environ, "SGLANG_CACHE_DIT_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    log = open(log_path, "w")  # noqa: SIM115 - closed by stop_server
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    proc.command = " ".join(cmd[2:])
    return proc


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout_s} s")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (drain, then exit 0); the exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()
    return proc.returncode


# ----------------------------------------------------------------------------------------------------- client
@dataclasses.dataclass
class Answer:
    index: int
    kind: str
    status: int | None  # None: the client left without reading (cancelled)
    seconds: float
    ok: bool
    problem: str = ""


class Client:
    """One client thread's kept-alive connection (`http.client`: a few times less of the client's own CPU per request
    than httpx, which matters when client and server share two cores)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self.connection: http.client.HTTPConnection | None = None

    def post(self, request: Request) -> tuple[int, bytes]:
        if self.connection is None:
            self.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            self.connection.request(
                "POST", GENERATIONS, body=request.body, headers={"Content-Type": request.content_type}
            )
            response = self.connection.getresponse()
            content = response.read()
        except Exception:
            self.close()
            raise
        if response.will_close:
            self.close()
        return response.status, content

    def cancelled(self, request: Request) -> None:
        """Send `request` (only the first half of its body with `cut_body`) on a connection of its own and close it
        `cancel_after_s` later, unread."""
        head = (
            f"POST {GENERATIONS} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: {request.content_type}\r\n"
            f"Content-Length: {len(request.body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with socket.create_connection((self.host, self.port), timeout=self.timeout_s) as sock:
            sock.sendall(head + (request.body[: len(request.body) // 2] if request.cut_body else request.body))
            time.sleep(request.cancel_after_s)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def send(client: Client, request: Request) -> Answer:
    """One request and whether its answer is the one expected (a cancelled one: sent, then the client left)."""
    start = time.perf_counter()
    if request.kind == "cancelled":
        client.cancelled(request)
        return Answer(request.index, request.kind, None, time.perf_counter() - start, True)
    try:
        status, content = client.post(request)
    except Exception as exc:  # a lost request: counted, never raised
        return Answer(request.index, request.kind, None, time.perf_counter() - start, False, repr(exc)[:200])
    seconds = time.perf_counter() - start
    expected = 200 if request.kind == "generate" else 400
    problem = "" if status == expected else f"HTTP {status} (expected {expected}): {content[:200]!r}"
    if not problem and status == 200 and content.count(b'"b64_json":"') != request.images:
        problem = f"{request.images} image(s) expected, got {content.count(b'b64_json')}"
    if not problem and status == 400 and b'"error":{"message":' not in content:
        problem = f"a 400 not in OpenAI's error shape: {content[:200]!r}"
    return Answer(request.index, request.kind, status, seconds, not problem, problem)


def run_requests(url: str, requests: list[Request], concurrency: int, timeout_s: float) -> list[Answer]:
    """Send `requests` in order from `concurrency` client threads, each with its own kept-alive connection, closed
    when all are answered."""
    answers: list[Answer] = []
    lock = threading.Lock()
    pending = iter(requests)

    def client_thread() -> None:
        client = Client(url, timeout_s)
        try:
            while True:
                with lock:
                    request = next(pending, None)
                if request is None:
                    return
                answer = send(client, request)
                with lock:
                    answers.append(answer)
        finally:
            client.close()

    threads = [threading.Thread(target=client_thread, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(answers, key=lambda a: a.index)


# ----------------------------------------------------------------------------------------------------- measures
def endpoint_counts(url: str) -> dict[str, int]:
    """The server's answers to the generation endpoint so far, by status (`/metrics`)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "dicache_http_requests_total" and sample.labels.get("endpoint") == GENERATIONS:
                counts[sample.labels["status"]] = counts.get(sample.labels["status"], 0) + int(sample.value)
    return counts


def wait_answered(url: str, sent: int, timeout_s: float) -> dict[str, int]:
    """Wait until the server has answered `sent` generation requests and its queue is idle; its counts by status."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        counts = endpoint_counts(url)
        queue = httpx.get(url + "/v1/server_info", timeout=30).json()["queue"]
        if sum(counts.values()) >= sent and queue["waiting"] == 0 and queue["running"] == 0:
            return counts
        if time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def process_figures(pid: int) -> dict[str, int]:
    """The server process's resident memory (bytes), threads and open file descriptors (Linux `/proc`)."""
    status = dict(
        line.split(":", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return {
        "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
        "threads": int(status["Threads"]),
        "open_fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def idle_figures(url: str, pid: int, device: str) -> dict[str, int]:
    """The server's figures once idle with no client connection open: the descriptors read until three reads agree
    (the server closes the last connections asynchronously), GPU memory from `/v1/server_info` on CUDA."""
    import httpx

    figures = None
    for _ in range(50):
        time.sleep(0.2)
        reads = [process_figures(pid)]
        for _ in range(2):
            time.sleep(0.1)
            reads.append(process_figures(pid))
        if len({r["open_fds"] for r in reads}) == 1 and len({r["threads"] for r in reads}) == 1:
            figures = reads[-1]
            break
    figures = figures or process_figures(pid)
    if device.startswith("cuda"):
        memory = httpx.get(url + "/v1/server_info", timeout=30).json()["memory"]
        figures["gpu_allocated_bytes"] = round(memory["allocated_GB"] * 1e9)
        figures["gpu_reserved_bytes"] = round(memory["reserved_GB"] * 1e9)
    return figures


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] if ordered else float("nan")


# ----------------------------------------------------------------------------------------------------- the soak
def soak(args) -> dict:
    """Start the server, warm it up, run the soak, measure; returns everything the table shows, with `passed`."""
    mode = "tiny" if args.tiny else "full"
    out_dir = pathlib.Path(args.out).parent if args.out else pathlib.Path(tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = pathlib.Path(args.server_log) if args.server_log else out_dir / "soak-server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, log_path)
    try:
        ready_s = wait_healthy(url, proc, args.start_timeout)
        warmup = plan_requests(args.warmup, mode, args.seed)
        measured = plan_requests(args.requests, mode, args.seed, start=args.warmup)
        start = time.perf_counter()
        answers = run_requests(url, warmup, args.concurrency, args.request_timeout)
        wait_answered(url, len(warmup), args.request_timeout)
        before = idle_figures(url, proc.pid, args.device)
        warmup_s = time.perf_counter() - start
        start = time.perf_counter()
        answers += run_requests(url, measured, args.concurrency, args.request_timeout)
        run_s = time.perf_counter() - start
        sent = len(warmup) + len(measured)
        counts = wait_answered(url, sent, args.request_timeout)
        after = idle_figures(url, proc.pid, args.device)
    finally:
        exit_status = stop_server(proc)
    return summarise(args, answers, counts, before, after, warmup, measured, ready_s, warmup_s, run_s, exit_status)


def summarise(args, answers, counts, before, after, warmup, measured, ready_s, warmup_s, run_s, exit_status) -> dict:
    requests = warmup + measured
    kinds = {kind: sum(1 for r in requests if r.kind == kind) for kind in MIX}
    server_total = sum(counts.values())
    server_5xx = sum(n for status, n in counts.items() if status.startswith("5"))
    lost = [a for a in answers if not a.ok]
    answered = len(answers) - kinds["cancelled"]
    cancelled = counts.get("499", 0) + counts.get("200", 0) - kinds["generate"]
    checks = [
        ("requests sent = answered by the server", len(requests), server_total, server_total == len(requests)),
        ("client answers as expected (200 / 400)", answered, answered - len(lost), not lost),
        ("bad bodies answered 400", kinds["bad"], counts.get("400", 0), counts.get("400", 0) == kinds["bad"]),
        ("cancelled answered 499 or 200", kinds["cancelled"], cancelled, cancelled == kinds["cancelled"]),
        ("answers 5xx", 0, server_5xx, server_5xx == 0),
        ("server exit status after SIGTERM", 0, exit_status, exit_status == 0),
    ]
    leaks = []
    for name in before:
        b, a = before[name], after[name]
        change = (a - b) / b if b else 0.0
        leaks.append((name, b, a, round(100 * change, 2), abs(change) <= args.tolerance))
    third = len(measured) // 3
    index_of = {r.index: i for i, r in enumerate(measured)}
    generated = [a for a in answers if a.kind == "generate" and a.ok and a.index in index_of]
    first = [a.seconds for a in generated if index_of[a.index] < third]
    last = [a.seconds for a in generated if index_of[a.index] >= len(measured) - third]
    ratio = p99(last) / p99(first) if first and last else float("nan")
    latency = {
        "p99_first_third_s": round(p99(first), 4),
        "p99_last_third_s": round(p99(last), 4),
        "ratio": round(ratio, 3),
        "median_s": round(statistics.median(a.seconds for a in generated), 4) if generated else None,
        "ok": ratio <= args.p99_ratio,
    }
    passed = all(c[-1] for c in checks) and all(row[-1] for row in leaks) and latency["ok"]
    return {
        "passed": passed,
        "mode": "tiny" if args.tiny else "full",
        "device": args.device,
        "requests": len(requests),
        "warmup": len(warmup),
        "concurrency": args.concurrency,
        "kinds": kinds,
        "server_counts": counts,
        "checks": [dict(zip(("check", "expected", "got", "ok"), c)) for c in checks],
        "leaks": [dict(zip(("figure", "after_warmup", "after_run", "change_pct", "ok"), row)) for row in leaks],
        "latency": latency,
        "problems": [dataclasses.asdict(a) for a in lost[:20]],
        "ready_s": round(ready_s, 1),
        "warmup_s": round(warmup_s, 1),
        "run_s": round(run_s, 1),
        "throughput_req_s": round(len(measured) / run_s, 2) if run_s else None,
    }


def markdown(result: dict, args, command: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M")
    machine = "CPU" if args.device == "cpu" else f"GPU ({args.device})"
    model = "the embedded tiny checkpoint" if args.tiny else "full-size Krea-2, random weights (`--load-format dummy`)"
    lines = [
        f"\n## Soak (`bench_soak.py`), {stamp}\n",
        f"Command: `{command}`  ",
        f"Machine: {machine}, {os.cpu_count()} cores; model: {model}; {result['requests']} requests "
        f"({result['warmup']} of warm-up) at concurrency {result['concurrency']}: {result['kinds']}; server ready in "
        f"{result['ready_s']} s, run {result['run_s']} s ({result['throughput_req_s']} req/s); "
        f"**{'passed' if result['passed'] else 'FAILED'}**\n",
        *markdown_table(result["checks"]),
        "",
        f"Idle after the warm-up against idle after the run (tolerance {100 * args.tolerance:g} %):\n",
        *markdown_table(result["leaks"]),
        "",
        f"Generation latency, P99 of the first third against the last third (at most x{args.p99_ratio:g}):\n",
        *markdown_table([result["latency"]]),
        "",
    ]
    if result["problems"]:
        lines += ["Problems (first 20):\n", *markdown_table(result["problems"]), ""]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the embedded tiny checkpoint (else full size, random weights)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--requests", type=int, default=2000, help="requests after the warm-up")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests (default: a fifth of --requests)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workers", type=int, default=None, help="the server's --workers (default: the server's)")
    p.add_argument("--torch-threads", type=int, default=1, help="the tiny server's --torch-threads")
    p.add_argument("--server-args", default="", help="more `dicache serve` flags, one string")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mixture")
    p.add_argument("--tolerance", type=float, default=0.02, help="largest relative change of a leak figure")
    p.add_argument("--p99-ratio", type=float, default=1.5, help="largest P99 last third / first third")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--server-log", default=None, help="the server's log (default: beside --out, or a temp folder)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--results", default=None, help="append the table to this Markdown file")
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.warmup is None:
        args.warmup = max(50, args.requests // 5)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = soak(args)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    publish(markdown(result, args, command_line("bench_soak.py", argv)), args.results)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
