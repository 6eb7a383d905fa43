"""End to end through the product, like SGLang's `bench_serving`: start `dicache serve` on a full-size Krea-2 with
random weights and time what an HTTP client sees.

The model is a diffusers-layout folder of config files only (DiT 12.8 B as released, a text encoder of
Qwen3-VL-4B's size, the Qwen-Image VAE, the scheduler, the embedded checkpoint's word-level tokenizer), served with
`--load-format dummy` (random weights drawn on the GPU). For each server (bf16, FP8; both `--compile`, which warms up
at start-up for the default size 1024²) it sends Turbo (8 steps, no CFG) and Raw (50 steps, CFG 4.5) requests with
caching off and with SGLang's default settings (F1 B0 W4 MC3 RDT 0.24), at concurrency 1 and 20, and reports
latency mean / median / P99, throughput and the GPU memory the server held at its peak (nvidia-smi, the whole
process as a user sees it). Random weights never pass a real threshold, so "default" caches nothing there; the
`sglang` rows force the default settings' pattern (every step the settings allow is cached: an always-passing
threshold), which is what a trained model with easy steps gets at most. Before its runs each server answers every
prompt of `PROMPTS` once, untimed, so the runs meet known prompt lengths; `--fresh-prompts` gives every timed request a
length the server has not met instead (a new length costs its first-call work: RESULTS.md 2026-12-03). Before
that, each server's start-up work after ready is waited for (`wait_steady`: the prompt lengths met in the
background, whose chunks would otherwise delay requests arriving while one runs).
`--profile PATH` adds a cache mode per settings profile (`dicache calibrate`'s JSON, named by its file name): its
requests carry the profile's settings (a fitted predictor's file named by its absolute path), as a server started with
`--profile PATH` runs them. `--fitted-mask 0,1,3,6` adds a timing stand-in of the fitted output predictor on that
Turbo mask (`cached_step_method=fitted`; its weights reuse the newest computed output, so its images say nothing about
quality, but a cached step costs what any fitted predictor costs: no forward). A mode fitted for one step count runs
only with the variant of that count. Each row says the steps the requests computed and their compute fraction (the
answers' `cache_stats`).

    python benchmarks/bench_serving.py --results benchmarks/RESULTS.md            # H200: ~6 min
    python benchmarks/bench_serving.py --tiny --device cpu --servers none          # logic check on a CPU (minutes)
    python benchmarks/bench_serving.py --servers fp8-te --variants turbo --caches recommended --profile turbo-fp8.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import inspect
import itertools
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import typing

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from publish import command_line, markdown_table, publish  # noqa: E402

from dicache.engine.cached_step import FittedWeights, feature_width, load_weights  # noqa: E402
from dicache.errors import ConfigError  # noqa: E402
from dicache.models.krea2.pipeline import EMBEDDED_CHECKPOINT  # noqa: E402
from dicache.server.memory import COMPONENTS  # noqa: E402
from dicache.settings.profiles import check_profile  # noqa: E402
from dicache.tuning.predictor import predictor_overrides  # noqa: E402

SGLANG_PUBLISHED = {"turbo_c1_latency_s": 1.56, "turbo_c20_req_per_s": 0.64, "peak_GB": 37.5}
"""SGLang's Krea-2 Turbo serving figures from the seed docs (H200, 1024², default cache)."""

QWEN3_VL_4B_TEXT = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=262144,
)
QWEN3_VL_4B_VISION = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    out_hidden_size=2560,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[5, 11, 17],
)
TURBO_RECOMMENDED = {
    "Fn_compute_blocks": 0,
    "max_warmup_steps": 0,
    "scm_compute_bins": [3, 1, 1],
    "scm_cache_bins": [1, 1, 1],
    "scm_policy": "static",
    "enable_taylorseer": True,
    "taylorseer_distance": "sigma",
    "taylorseer_damping": 0.5,
    "forecaster": "input_corrected",
}
"""README "Recommended settings", Turbo: the mask `dicache calibrate --variant turbo` picks (steps 0, 1, 2, 4, 6 of 8
computed, a skipped step runs no block) with the input-corrected forecaster. Override with --recommended-params when
the recommendation changes."""
CACHE_MODES = {
    "off": {"enable_cache": False},
    "default": {"enable_cache": True, "cache_dit_params": {}},
    "sglang": {"enable_cache": True, "cache_dit_params": {"residual_diff_threshold": 1e9}},
    "recommended": {"enable_cache": True, "cache_dit_params": TURBO_RECOMMENDED},
}
VARIANTS = {"turbo": (8, 1.0), "raw": (50, 4.5)}
MODE_STEPS: dict[str, int] = {}
"""The step count a cache mode's fitted predictor is for (`--profile`, `--fitted-mask`): other variants skip it."""
SERVERS = {
    "none": [],
    "fp8": ["--quantization", "fp8"],
    "fp8-attn-bf16": ["--quantization", "fp8", "--quantization-exclude", "attn_qkv", "attn_out"],
    "fp8-te": ["--quantization", "fp8", "--text-encoder-quantization", "fp8"],
    "fp8-te-dynamic": ["--quantization", "fp8", "--text-encoder-quantization", "fp8-dynamic"],
    "fp8-te-w1": ["--quantization", "fp8", "--text-encoder-quantization", "fp8", "--workers", "1"],
    "int8": ["--quantization", "int8"],
    "int8-te": ["--quantization", "int8", "--text-encoder-quantization", "fp8"],
}
"""Server kinds: their `dicache serve` flags. fp8-attn-bf16 is the FP8 default of 2026-12-01 (attention
projections in bf16), still reachable with --quantization-exclude; fp8-te adds the text encoder's weights in FP8
(computed in bf16), fp8-te-dynamic its FP8 GEMMs (the meaning of `--text-encoder-quantization fp8` until
2026-12-03); fp8-te-w1 is fp8-te with one worker (beside fp8-te in one run: workers 2 against 1); int8 / int8-te:
every block linear in INT8 (and the text encoder's weights in FP8)."""


# ----------------------------------------------------------------------------------------------------- model folder
def write_model_folder(path: pathlib.Path, tiny: bool) -> pathlib.Path:
    """A config-only diffusers-layout Krea-2 folder: full size, or the embedded checkpoint's configs (tiny)."""
    if path.exists():
        shutil.rmtree(path)
    for name in ("scheduler", "tokenizer"):
        shutil.copytree(EMBEDDED_CHECKPOINT / name, path / name)
    index = json.loads((EMBEDDED_CHECKPOINT / "model_index.json").read_text())
    for name in ("transformer", "vae", "text_encoder"):
        (path / name).mkdir(parents=True)
    if tiny:
        for name in ("transformer", "vae", "text_encoder"):
            shutil.copy(EMBEDDED_CHECKPOINT / name / "config.json", path / name / "config.json")
        size = json.loads((EMBEDDED_CHECKPOINT / "dicache.json").read_text())["default_size"]
    else:
        from dicache.models.krea2.text import KREA2_SELECT_LAYERS
        from dicache.models.krea2.transformer import Krea2Transformer
        from dicache.models.krea2.vae import QwenImageVAEConfig

        defaults = {
            k: (list(p.default) if isinstance(p.default, tuple) else p.default)
            for k, p in inspect.signature(Krea2Transformer.__init__).parameters.items()
            if k != "self"
        }
        (path / "transformer/config.json").write_text(
            json.dumps({"_class_name": "Krea2Transformer2DModel", **defaults})
        )
        vae = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(QwenImageVAEConfig()).items()}
        (path / "vae/config.json").write_text(json.dumps({"_class_name": "AutoencoderKLQwenImage", **vae}))
        text = json.loads((EMBEDDED_CHECKPOINT / "text_encoder/config.json").read_text())
        text["dtype"] = text["torch_dtype"] = "bfloat16"
        text["text_config"].update(QWEN3_VL_4B_TEXT)
        for key in ("rope_parameters", "rope_scaling"):
            text["text_config"][key]["mrope_section"] = [24, 20, 20]
        text["vision_config"].update(QWEN3_VL_4B_VISION)
        (path / "text_encoder/config.json").write_text(json.dumps(text, indent=1))
        index["text_encoder_select_layers"] = list(KREA2_SELECT_LAYERS)
        size = [1024, 1024]
    (path / "model_index.json").write_text(json.dumps(index, indent=1))
    (path / "dicache.json").write_text(json.dumps({"default_size": size}))
    return path


# ----------------------------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GpuMemoryPoller:
    """Max GPU memory in use (MiB, nvidia-smi `memory.used` minus what was in use before the server started)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.base = self._read() if self.enabled else 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> int:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
        ).stdout
        return int(out.split()[0]) if out.strip() else 0

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.peak = max(self.peak, self._read() - self.base)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def reset(self) -> None:
        self.peak = 0

    @property
    def peak_gb(self) -> float | None:
        return round(self.peak * 2**20 / 1e9, 2) if self.enabled else None


def start_server(args, model_dir: pathlib.Path, server: str, port: int, log_path: pathlib.Path):
    cmd = [sys.executable, "-m", "dicache.cli", "serve", "--model", str(model_dir), "--load-format", "dummy"]
    cmd += ["--port", str(port), "--device", args.device, "--max-queue", "256", "--timeout", "1800"]
    cmd += ["--log-level", "warning"]
    if args.workers is not None:  # else the server's default
        cmd += ["--workers", str(args.workers)]
    if args.compile:
        cmd.append("--compile")
    cmd += SERVERS[server] + args.server_args.split()
    env = {**os.environ, "SGLANG_CACHE_DIT_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    log = open(log_path, "w")  # noqa: SIM115 - closed by stop_server
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc, " ".join(cmd[1:])


def wait_healthy(url: str, proc, timeout_s: float) -> float:
    """Seconds until `url`'s /health answers 200 (polled every 0.25 s); raises RuntimeError when `proc` exits first
    or `timeout_s` runs out."""
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not healthy after {timeout_s} s")


def wait_steady(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> float | None:
    """Seconds from now until the server's start-up work after ready is finished: the prompt lengths it meets
    between requests (`--prepare-text-lengths background`, the default; `/v1/server_info` "startup"
    "text_lengths"). Until then each idle moment runs a chunk of it (about 0.15 s on an H200) that the next request
    waits for, so the timed runs start after it. None when the server runs none (a CPU server, `before-ready`,
    `off`). A preparation that failed is steady too: the lengths are then met on demand, as with `off`."""
    import httpx

    start = time.perf_counter()
    while True:
        answer = httpx.get(f"{url}/v1/server_info", headers=headers, timeout=30)
        answer.raise_for_status()  # e.g. a keyed server asked without its key: not "nothing to wait for"
        info = answer.json()
        progress = (info.get("startup") or {}).get("text_lengths") or {}
        if "state" not in progress:
            return None
        if progress["state"] != "running":
            return round(time.perf_counter() - start, 1)
        if time.perf_counter() - start > timeout_s:
            raise RuntimeError(f"the server's prompt lengths were still being met after {timeout_s} s: {progress}")
        time.sleep(0.5)


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()


# ----------------------------------------------------------------------------------------------------- client
PROMPTS = [
    "a red apple on a wooden table",
    "grinning face with big eyes",
    "a rocket flying over snowy mountains at night",
    "a cat",
    "a small house with a green door and a tree beside it",
]


class Answer(typing.NamedTuple):
    """One generation as the client saw it: `seconds` end to end, the image's `sha256` fingerprint, the answer's
    `timings` and its `cache_stats` (None when caching was off)."""

    seconds: float
    sha256: str
    timings: dict
    cache_stats: dict | None = None


def one_request(url: str, body: dict, client=None) -> Answer:
    """One generation, sent with `client` (an `httpx.Client`; None: a new one for this request alone)."""
    import httpx

    post = client.post if client is not None else httpx.post
    start = time.perf_counter()
    r = post(f"{url}/v1/images/generations", json=body, timeout=1800)
    seconds = time.perf_counter() - start
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    answer = r.json()
    image = answer["data"][0]
    if not image.get("b64_json"):
        raise RuntimeError("response without an image")
    return Answer(seconds, image["sha256"], answer.get("timings") or {}, answer.get("cache_stats"))


def where_time_goes(answers: list[Answer]) -> dict:
    """Mean seconds per request: each phase (the answer's `timings.phases`), the wait for a worker, the wait for a
    phase busy with another request (`generate_s` minus the phases), and the rest: HTTP, the event loop, the client."""
    timings = [a.timings for a in answers]
    phases = [t.get("phases") or {} for t in timings]
    names = list(dict.fromkeys(name for p in phases for name in p))
    mean = {f"{name}_s": round(statistics.mean(p.get(name, 0.0) for p in phases), 4) for name in names}
    mean["queued_s"] = round(statistics.mean(t.get("queued_s", 0.0) for t in timings), 4)
    mean["phase_wait_s"] = round(
        statistics.mean(t.get("generate_s", 0.0) - sum((t.get("phases") or {}).values()) for t in timings), 4
    )
    mean["outside_s"] = round(
        statistics.mean(a.seconds - a.timings.get("queued_s", 0.0) - a.timings.get("generate_s", 0.0) for a in answers),
        4,
    )
    return mean


def computed_work(answers: list[Answer]) -> dict:
    """The steps the requests computed (their cond branch's `computed_steps`, e.g. `0,1,3,6`; `all` with caching
    off; the distinct patterns joined by ` / ` when they differ) and their mean compute fraction (blocks run / an
    uncached run's; 1.0 with caching off)."""
    patterns, fractions = [], []
    for a in answers:
        stats = a.cache_stats
        if not stats or not stats.get("enabled", True):
            patterns.append("all")
            fractions.append(1.0)
            continue
        computed = (stats.get("branches") or {}).get("cond", {}).get("computed_steps", [])
        patterns.append(",".join(str(s) for s in computed))
        fractions.append(stats["compute_fraction"])
    return {"computed_steps": " / ".join(dict.fromkeys(patterns)), "compute": round(statistics.mean(fractions), 3)}


def profile_summary(path: str) -> str:
    """`path` and what its calibration record says it was measured on: model, size, quantization, steps, the target
    and what the chosen settings achieved there (the parts the record holds)."""
    record = json.loads(pathlib.Path(path).read_text()).get("calibration") or {}
    source = record.get("model_source") or record.get("model")
    quantization = (record.get("quantization") or {}).get("method") or record.get("dtype")
    achieved = record.get("achieved") or {}
    shown = {"psnr_mean_db": "PSNR mean", "psnr_min_db": "worst", "compute_fraction": "compute"}
    parts = [
        source and f"calibrated on {pathlib.PurePath(source).name}",
        record.get("width") and f"{record['width']}x{record.get('height')} px",
        quantization,
        record.get("steps") and f"{record['steps']} steps",
        record.get("target_psnr_db") and f"target {record.get('criterion', '')} PSNR >= {record['target_psnr_db']} dB",
        ", ".join(f"{label} {achieved[k]}" for k, label in shown.items() if k in achieved),
    ]
    said = "; ".join(str(part) for part in parts if part)
    return f"{path} ({said or 'no calibration record'})"


def profile_mode(path: str) -> tuple[str, dict, int | None]:
    """The cache mode of a settings profile: its name (the file name without `.json`), the request fields that run
    its settings (`cache_dit_params`: every setting of the profile, a predictor file's path made absolute) and the
    step count its predictor is for (None without one)."""
    settings = check_profile(path)
    name = pathlib.Path(path).stem
    if name in CACHE_MODES or not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"--profile {path!r}: its name {name!r} is taken or not a plain name; rename the file")
    params = {k: v for k, v in settings.items() if k != "enable_cache"}
    predictor = params.get("fitted_predictor")
    steps = load_weights(predictor).num_steps if predictor else None
    return name, {"enable_cache": True, "cache_dit_params": params}, steps


def parse_fitted_mask(text: str, num_steps: int = VARIANTS["turbo"][0]) -> tuple[int, ...]:
    """`--fitted-mask`: the computed steps, e.g. `0,1,3,6`, as `num_steps` flags (1 = computed); ValueError unless
    they are distinct steps in [0, num_steps), step 0 among them, and at least one step is left to predict."""
    try:
        steps = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        steps = []
    if not steps or steps[0] != 0 or steps[-1] >= num_steps or len(steps) == num_steps:
        raise ValueError(
            f"--fitted-mask {text!r} is invalid: expected the computed steps of the {num_steps}-step Turbo schedule, "
            "comma-separated, step 0 among them and at least one step cached (e.g. 0,1,3,6)"
        )
    return tuple(int(i in steps) for i in range(num_steps))


def stand_in_mode(mask: tuple[int, ...], folder: pathlib.Path, channels: int) -> tuple[str, dict]:
    """The timing stand-in of the fitted predictor on `mask`: its name (`fitted-stand-in <steps>`) and request fields;
    its predictor file (in `folder`) maps each cached step to the newest computed output of `channels` channels."""
    cached = [i for i, flag in enumerate(mask) if not flag]
    reuse = {}
    for step in cached:
        weight = torch.zeros(feature_width(channels), channels)
        weight[:channels] = torch.eye(channels)
        reuse[(step, "cond")] = weight
    path = FittedWeights(len(mask), mask, reuse).save(folder / f"stand-in-{''.join(map(str, mask))}.safetensors")
    name = "fitted-stand-in " + ",".join(str(i) for i, flag in enumerate(mask) if flag)
    return name, {"enable_cache": True, "cache_dit_params": predictor_overrides(mask, str(path))}


def fresh_prompt(base: str, count: int) -> str:
    """`base` lengthened by `count` words: a prompt whose token count the server has not met (count 0: `base`)."""
    return base if count == 0 else f"{base}, {' '.join(['detailed'] * count)}"


def request_body(prompt: str, variant: str, cache: str, size: int, seed: int) -> dict:
    """The JSON body of one `/v1/images/generations` request: `variant`'s steps and guidance, `CACHE_MODES[cache]`."""
    steps, guidance = VARIANTS[variant]
    return {
        "prompt": prompt,
        "size": f"{size}x{size}",
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "seed": seed,
        **CACHE_MODES[cache],
    }


def add_backend_arguments(parser) -> None:
    """The flags of an in-process probe of `warmed_backend`: --text-encoder-fp8, --tiny, --device, --results."""
    parser.add_argument("--text-encoder-fp8", action="store_true")
    parser.add_argument(
        "--tiny", action="store_true", help="the embedded checkpoint's configs (a logic check, any device)"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--results", default=None)


def warmed_backend(tiny: bool, device: str, quantization: str | None, text_encoder_fp8: bool):
    """In-process, the backend `dicache serve --load-format dummy --compile [--quantization Q]
    [--text-encoder-quantization fp8]` builds on a config-only folder (`write_model_folder`), quantised, compiled and
    warmed up as the server does before serving. Returns `(backend, size, warm-up summary)`; size 1024 (128 tiny)."""
    from dicache.quantization import parse_quantization
    from dicache.server.backend import load_backend

    folder = write_model_folder(pathlib.Path(tempfile.mkdtemp()) / "krea2-config", tiny)
    backend = load_backend(str(folder), "turbo", device=device, load_format="dummy")
    spec = parse_quantization(quantization, None)
    if spec is not None:
        backend.pipe.quantize(spec)
    if text_encoder_fp8:
        backend.pipe.quantize_text_encoder("fp8")
    backend.pipe.compile()
    return backend, 128 if tiny else 1024, backend.warm_up()


def backend_spec(backend, body: dict):
    """The `GenerationSpec` the server would run for `body` on `backend` (`dicache.server.generation.resolve` with
    the default server settings): for in-process probes of the server's backend."""
    from dicache.server.generation import resolve
    from dicache.server.schemas import ImageGenerationRequest
    from dicache.server.settings import ServerSettings

    request = ImageGenerationRequest(**body)
    return resolve(request, ServerSettings(), backend.defaults, backend.cache_config, backend.num_blocks)


class KeptAliveClients:
    """One `httpx.Client` per client thread, each keeping its connection alive across its requests, as load
    generators do (SGLang's `bench_serving` reuses aiohttp sessions; `requests.Session`). Until 2026-12-03 every
    request was a bare `httpx.post`, which builds a client, its TLS context and a connection each time: about 24 ms
    of the client's own work counted in every latency (`bench_server_cpu.py --sections client`)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._opened: list = []
        self._lock = threading.Lock()

    def of_this_thread(self):
        import httpx

        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(timeout=1800)
            with self._lock:
                self._opened.append(client)
        return client

    def __enter__(self) -> KeptAliveClients:
        return self

    def __exit__(self, *exc) -> None:
        for client in self._opened:
            client.close()


def load(
    url: str, variant: str, cache: str, concurrency: int, requests: int, size: int, seen: dict, fresh=None
) -> dict:
    """Latency and throughput of `requests` generations from `concurrency` clients. `seen`: (variant, cache, seed)
    -> fingerprint of earlier runs; `same_bytes` says whether every repeated (variant, cache, seed) gave the bytes
    it gave before (the same-seed guarantee across concurrency), None when nothing repeated; `time_goes`: where a
    request's time went on average (`where_time_goes`). `fresh`: an iterator of word counts (`fresh_prompt`) giving
    every request a prompt length the server has not met, instead of the five `PROMPTS` every run repeats."""
    bodies = [
        request_body(
            fresh_prompt(PROMPTS[0], next(fresh)) if fresh is not None else PROMPTS[i % len(PROMPTS)],
            variant,
            cache,
            size,
            seed=i,
        )
        for i in range(requests)
    ]
    gc_before = server_gc(url)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool, KeptAliveClients() as clients:
        answers = list(pool.map(lambda b: one_request(url, b, clients.of_this_thread()), bodies))
    wall = time.perf_counter() - start
    gc_after = server_gc(url)
    latencies = sorted(a.seconds for a in answers)
    same = None
    for body, (_, digest, _, _) in zip(bodies, answers):
        key = (variant, cache, body["seed"], body["prompt"])
        if key in seen:
            same = (same is not False) and seen[key] == digest
        seen.setdefault(key, digest)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return {
        "requests": requests,
        "latency_mean_s": round(statistics.mean(latencies), 3),
        "latency_median_s": round(statistics.median(latencies), 3),
        "latency_p99_s": round(p99, 3),
        "throughput_req_s": round(requests / wall, 3),
        **computed_work(answers),
        "same_bytes": same,
        "time_goes": {
            **where_time_goes(answers),
            **(
                {"gc_pause_s": round((gc_after - gc_before) / requests, 4)} if None not in (gc_before, gc_after) else {}
            ),
        },
    }


def server_gc(url: str) -> float | None:
    """Seconds the server's garbage collector has paused so far (`/v1/server_info` "gc"), None if not reported."""
    import httpx

    pauses = httpx.get(f"{url}/v1/server_info", timeout=30).json().get("gc", {}).get("pause_s")
    return None if pauses is None else sum(pauses)


# ----------------------------------------------------------------------------------------------------- main
def plan(args) -> list[tuple[str, str, int, int]]:
    """(variant, cache, concurrency, requests) for one server."""
    runs = []
    for variant in args.variants:
        for cache in args.caches:
            if MODE_STEPS.get(cache, VARIANTS[variant][0]) != VARIANTS[variant][0]:
                continue  # a predictor for another step count
            runs.append((variant, cache, 1, args.requests_c1 if variant == "turbo" else args.raw_requests))
            if variant == "turbo" and args.requests_c20:
                runs.append((variant, cache, 20, args.requests_c20))
    return runs


def server_memory(url: str) -> dict | None:
    """The server's GPU memory breakdown (`/v1/server_info` "memory": `dicache.server.memory.memory_breakdown`)."""
    import httpx

    return httpx.get(f"{url}/v1/server_info", timeout=30).json().get("memory")


def memory_columns(breakdown: dict | None, smi_peak_gb: float | None) -> dict:
    """A run's memory columns: weights, peak activations, allocator peak, and the CUDA context (nvidia-smi's peak for
    the process minus the allocator's peak reserve)."""
    if not breakdown:
        return {}
    context = None if smi_peak_gb is None else round(smi_peak_gb - breakdown["peak_reserved_GB"], 2)
    return {
        "weights_GB": round(sum(breakdown["weights_GB"].values()), 2),
        "activations_peak_GB": breakdown["activations_peak_GB"],
        "allocator_peak_GB": breakdown["peak_reserved_GB"],
        "context_GB": context,
    }


def run(args) -> dict:
    results = {"runs": [], "servers": {}}
    work = pathlib.Path(tempfile.mkdtemp(prefix="dicache-serving-"))
    model_dir = write_model_folder(work / "krea2-config", args.tiny)
    size = 1024 if not args.tiny else 128
    channels = json.loads((model_dir / "transformer" / "config.json").read_text())["in_channels"]
    for mask in args.fitted_mask:
        name, mode = stand_in_mode(mask, work, channels)
        CACHE_MODES[name], MODE_STEPS[name] = mode, len(mask)
        args.caches = [*args.caches, name]
        results.setdefault("stand_ins", []).append(name)
    out_dir = pathlib.Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    with GpuMemoryPoller(args.device.startswith("cuda")) as memory:
        for server in args.servers:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            memory.reset()
            proc, command = start_server(args, model_dir, server, port, out_dir / f"serve_{server}.log")
            try:
                ready_s = wait_healthy(url, proc, args.start_timeout)
                results["servers"][server] = {
                    "command": command,
                    "ready_s": round(ready_s, 1),
                    "lengths_after_ready_s": wait_steady(url, args.start_timeout),
                    "peak_GB_after_warmup": memory.peak_gb,
                    "memory_after_warmup": server_memory(url),
                }
                print(f"server {server}: ready in {ready_s:.1f} s: {command}", flush=True)
                memory.reset()  # from here on: the serving-time peak (loading and warm-up reported above)
                warmed, seen = set(), {}
                fresh = itertools.count(1) if args.fresh_prompts else None
                for variant, cache, concurrency, requests in plan(args):
                    if variant not in warmed:  # untimed: each of PROMPTS once (the runs then meet known lengths)
                        load(url, variant, cache, 1, len(PROMPTS), size, seen)
                        warmed.add(variant)
                    row = {"server": server, "variant": variant}
                    row.update(cache=cache, concurrency=concurrency)
                    row.update(load(url, variant, cache, concurrency, requests, size, seen, fresh))
                    row["server_peak_GB"] = memory.peak_gb
                    row.update(memory_columns(server_memory(url), memory.peak_gb))
                    results["runs"].append(row)
                    print(f"run: {row}", flush=True)
                results["servers"][server]["memory_at_end"] = server_memory(url)
            finally:
                stop_server(proc)
                (out_dir / "bench_serving.json").write_text(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return results


def markdown(results: dict, args, command: str) -> str:
    import platform

    device = platform.machine()
    if args.device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name()
    lines = [
        f"\n## End to end through `dicache serve` ({datetime.datetime.now():%Y-%m-%d %H:%M})\n",
        f"Command: `{command}`  ",
        f"Machine: {device}; model: {'tiny (embedded configs)' if args.tiny else 'full-size Krea-2'} with random "
        f"weights (`--load-format dummy`), {'128' if args.tiny else '1024'}², workers {args.workers or 'default'}, "
        f"{'compiled' if args.compile else 'eager'}"
        f"{', every request a new prompt length (--fresh-prompts)' if args.fresh_prompts else ''}"
        + (
            f", PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}"
            if "PYTORCH_CUDA_ALLOC_CONF" in os.environ
            else ""
        )
        + "  ",
        "Server commands: "
        + "; ".join(
            f"`{s['command']}` (ready in {s['ready_s']} s"
            + (
                f", its prompt lengths met {s['lengths_after_ready_s']} s later, before the timed runs"
                if s.get("lengths_after_ready_s") is not None
                else ""
            )
            + f", {s['peak_GB_after_warmup']} GB after warm-up)"
            for s in results["servers"].values()
        )
        + "  ",
        f"SGLang published (seed docs, Turbo, default cache): {json.dumps(SGLANG_PUBLISHED)}"
        + ("  " if results.get("profiles") else "\n"),
    ]
    if results.get("profiles"):
        lines.append(
            "Profiles (cache modes whose requests carry a profile's settings): "
            + "; ".join(f"`{name}`: {summary}" for name, summary in results["profiles"].items())
            + (
                ". On random weights the time is what counts: a profile's quality is measured where it was "
                "calibrated (`benchmarks/sweep_substep.py --profile`)\n"
                if not args.tiny
                else "\n"
            )
        )
    if results.get("stand_ins"):
        lines.append(
            f"Timing stand-ins ({', '.join(f'`{n}`' for n in results['stand_ins'])}): the fitted output predictor "
            "on that mask with weights that reuse the newest computed output; a cached step costs what any fitted "
            "predictor costs (no forward), the images say nothing about quality.\n"
        )
    rows = [{k: v for k, v in r.items() if k != "time_goes"} for r in results["runs"]]
    if rows:
        lines += markdown_table(rows)
    goes = [r for r in results["runs"] if r.get("time_goes")]
    if goes:
        keys = list(dict.fromkeys(k for r in goes for k in r["time_goes"]))
        lines += ["", "Where a request's time goes (mean seconds; phases from the answers' `timings.phases`, "
                  "`phase_wait`: waiting for a phase busy with another request, `gc_pause`: the server's garbage "
                  "collections (any thread, per request), `outside`: latency minus the "
                  "worker's time and the queue: HTTP, the event loop, the client):", ""]  # fmt: skip
        where = [
            {"server": r["server"], "cache": r["cache"], "concurrency": r["concurrency"], **r["time_goes"]}
            for r in goes
        ]
        lines += markdown_table(where, ["server", "cache", "concurrency", *keys])
    breakdowns = {name: s.get("memory_at_end") for name, s in results["servers"].items() if s.get("memory_at_end")}
    if breakdowns:
        lines += ["", "GPU memory at the end of each server's runs (GB; `/v1/server_info`, torch's allocator):", ""]
        memory = [
            {
                "server": name,
                **{f"weights {c}": m["weights_GB"].get(c) for c in COMPONENTS},
                "peak allocated": m["peak_allocated_GB"],
                "peak activations": m["activations_peak_GB"],
                "peak reserved": m["peak_reserved_GB"],
                "reserve now": m["reserve_GB"],
            }
            for name, m in breakdowns.items()
        ]
        lines += markdown_table(memory)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the embedded checkpoint's configs (a logic check)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--servers", nargs="+", default=["none", "fp8"], choices=tuple(SERVERS), help="server kinds")
    p.add_argument("--server-args", default="", help="more `dicache serve` flags for every server, one string")
    p.add_argument("--variants", nargs="+", default=["turbo", "raw"], choices=tuple(VARIANTS))
    p.add_argument("--caches", nargs="+", default=["off", "sglang"], choices=tuple(CACHE_MODES))
    p.add_argument(
        "--recommended-params", type=json.loads, default=None, help="JSON cache_dit_params of the 'recommended' mode"
    )
    p.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="PATH",
        help="a settings profile (dicache calibrate's JSON): one more cache mode, named by the file name, whose "
        "requests carry the profile's settings (repeatable)",
    )
    p.add_argument(
        "--fitted-mask",
        action="append",
        default=[],
        metavar="STEPS",
        help="the computed steps of a Turbo mask, e.g. 0,1,3,6: one more cache mode, a timing stand-in of the fitted "
        "output predictor on it (its images say nothing about quality; repeatable)",
    )
    p.add_argument("--requests-c1", type=int, default=3)
    p.add_argument("--requests-c20", type=int, default=20)
    p.add_argument("--raw-requests", type=int, default=1)
    p.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="every timed request a prompt of a token count the server has not met yet (the first prompt lengthened "
        "word by word; no same-seed repeats then) instead of the five prompts every run repeats: the cost of new "
        "prompt lengths",
    )
    p.add_argument("--workers", type=int, default=None, help="the server's --workers (default: the server's)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    if args.recommended_params is not None:
        CACHE_MODES["recommended"]["cache_dit_params"] = args.recommended_params
    profiles = {}
    for path in args.profile:
        try:
            name, mode, steps = profile_mode(path)
        except (ValueError, ConfigError) as exc:
            p.error(str(exc))
        CACHE_MODES[name], profiles[name] = mode, profile_summary(path)
        if steps is not None:
            MODE_STEPS[name] = steps
        args.caches = [*args.caches, name]
    try:
        args.fitted_mask = [parse_fitted_mask(text) for text in args.fitted_mask]
    except ValueError as exc:
        p.error(str(exc))
    results = run(args)
    results["profiles"] = profiles
    command = command_line("bench_serving.py", argv)
    publish(markdown(results, args, command), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
