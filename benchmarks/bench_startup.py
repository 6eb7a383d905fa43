"""How long a rescheduled `dicache serve` takes to serve again (issue 41), and with how much GPU memory.

It writes a full-size Krea-2 checkpoint with random weights in the diffusers layout to a local disk (transformer
shards, the text encoder of Qwen3-VL-4B's size, the Qwen-Image VAE decoder, the embedded tokenizer and scheduler;
`write_checkpoint`), measures the disk's own sequential read rate over those files with the page cache dropped, then
starts `dicache serve` on it as a fresh process the way a rescheduled pod does: empty inductor / Triton caches, empty
temporary folder and home, the page cache dropped (`echo 3 > /proc/sys/vm/drop_caches` as root, else
`posix_fadvise(DONTNEED)` per file). Runs (`--runs`, in order):

- `cold`: no compile artifact yet; the server compiles from scratch and saves its artifact after the warm-up;
- `artifact`: the same with the artifact `cold` saved (another fresh process, empty caches);
- `artifact-nolengths`: the same with `--prepare-text-lengths off` (a prompt of a new length then pays its
  attention set-up in its request);
- `artifact-before`: the same as the start-up of 2026-12-05 was (`--prepare-text-lengths before-ready
  --artifact-weights false --prefetch-weights false`: the prompt lengths before ready, the bf16 checkpoint read and
  quantised, nothing read while importing), for the side-by-side comparison with `artifact` (the defaults: the
  quantised weights from the artifact folder, which `cold` saved, read while importing, the lengths after ready);
- `generate`: `dicache generate --compile` for one image, without and then with its own artifact.

Per serve run it reports the server's own phases (`/v1/server_info` "startup": imports, weights, quantization,
compile artifact, warm-up, prompt lengths, artifact save, ready), the time from the process start to healthy, the
first request's latency against the steady state (`--requests` identical requests once the prompt lengths met in
the background after ready are done: `lengths_after_first_s` after the first answer), the time from the
process's start to the first answer (`first_answer_s`, the issue's 30-s target), the checkpoint's read
rate against the disk's (`checkpoint_GBps`: the reading alone; `load_GBps`: reading and FP8 quantisation, which
runs between the reads), and GPU memory as nvidia-smi sees it: the peak while starting and while serving (a burst of
`--burst` requests at concurrency 8), per process (compile workers included). Ends with `publish(...)`.

    python benchmarks/bench_startup.py --results benchmarks/RESULTS.md            # H200: about 8 min
    python benchmarks/bench_startup.py --tiny --device cpu --size 128 --server-args "" --runs cold artifact  # CPU check
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_serving import (  # noqa: E402
    free_port,
    one_request,
    request_body,
    stop_server,
    wait_healthy,
    wait_steady,
    where_time_goes,
    write_model_folder,
)
from publish import command_line, markdown_table, publish  # noqa: E402

FAST_PATH = "--compile --quantization fp8 --text-encoder-quantization fp8"
"""The flags of the issue's figures (bench_serving's `fp8-te` server, compiled)."""
SHARD_BYTES = 5_000_000_000
"""diffusers' and transformers' default largest shard (5 GB)."""
PROMPT = "a red apple on a wooden table"
RUNS = ("cold", "artifact", "artifact-nolengths", "artifact-before", "generate")
RUN_FLAGS = {
    "artifact-nolengths": ["--prepare-text-lengths", "off"],
    "artifact-before": [
        "--prepare-text-lengths", "before-ready", "--artifact-weights", "false", "--prefetch-weights", "false",
    ],
}  # fmt: skip
"""Server flags of a run beside `--server-args` (the others: the defaults)."""


# ----------------------------------------------------------------------------------------------------- checkpoint
def write_checkpoint(path: pathlib.Path, tiny: bool, device: str) -> dict:
    """A diffusers-layout Krea-2 folder with random weights (full size, or the embedded checkpoint's configs): the
    config folder of `bench_serving.write_model_folder` plus each component's safetensors, sharded at 5 GB with an
    index as diffusers and transformers write them. Kept (not rewritten) when `path/.complete` exists."""
    if (path / ".complete").is_file():
        return {"written_s": 0.0}
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3VLModel

    from dicache.models.krea2.transformer import Krea2Transformer
    from dicache.models.krea2.vae import QwenImageVAEDecoder

    start = time.perf_counter()
    write_model_folder(path, tiny)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    transformer = Krea2Transformer.from_pretrained(path, load_format="dummy", device=device, dtype=dtype)
    save_sharded(transformer.state_dict(), path / "transformer", "diffusion_pytorch_model")
    del transformer
    config = AutoConfig.from_pretrained(path / "text_encoder")
    with torch.device(device):
        encoder = Qwen3VLModel._from_config(config, dtype=dtype)
    save_sharded(encoder.state_dict(), path / "text_encoder", "model")
    del encoder
    vae = QwenImageVAEDecoder.from_pretrained(path, load_format="dummy", device=device, dtype=dtype)
    save_file(
        {k: v.contiguous().cpu() for k, v in vae.state_dict().items()},
        str(path / "vae" / "diffusion_pytorch_model.safetensors"),
    )
    del vae
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    (path / ".complete").touch()
    return {"written_s": round(time.perf_counter() - start, 1)}


def save_sharded(state: dict, folder: pathlib.Path, stem: str) -> None:
    """`state` as `<stem>-0000i-of-0000n.safetensors` shards of at most `SHARD_BYTES` (in key order) plus
    `<stem>.safetensors.index.json`; one file `<stem>.safetensors` when it fits in one shard."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    size = total = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
        total += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file({k: state[k].contiguous().cpu() for k in shards[0]}, str(folder / f"{stem}.safetensors"))
        return
    weight_map = {}
    for i, keys in enumerate(shards, 1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k].contiguous().cpu() for k in keys}, str(folder / name))
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=1))


def weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    return sorted(path.glob("*/*.safetensors"))


def snapshot_files(store: pathlib.Path) -> list[pathlib.Path]:
    """The quantised weights kept in an artifact store (`--artifact-weights`)."""
    return sorted(store.glob("weights-*/*.safetensors"))


# ----------------------------------------------------------------------------------------------------- the disk
def drop_page_cache(files: list[pathlib.Path]) -> str:
    """Evict `files` from the page cache: every clean page (`/proc/sys/vm/drop_caches`, root only), else each file's
    (`posix_fadvise(DONTNEED)`). Returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def read_rate(files: list[pathlib.Path], threads: int) -> dict:
    """Read `files` whole, in 16 MB sequential reads, `threads` files at a time: {GB, seconds, GBps}."""
    chunk = 16 << 20

    def read(file: pathlib.Path) -> int:
        buffer = bytearray(chunk)
        view, total = memoryview(buffer), 0
        with open(file, "rb", buffering=0) as fh:
            while got := fh.readinto(view):
                total += got
        return total

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        total = sum(pool.map(read, files))
    seconds = time.perf_counter() - start
    return {"GB": round(total / 1e9, 2), "seconds": round(seconds, 2), "GBps": round(total / 1e9 / seconds, 2)}


# ----------------------------------------------------------------------------------------------------- GPU memory
class GpuProcessMemory:
    """Peaks of GPU memory in use as nvidia-smi reports it, every 0.2 s, under a label the caller switches
    (`phase`): the whole GPU (minus what was in use before) and per process (MiB -> GB)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.base = self._total() if self.enabled else 0
        self.phase = "start"
        self.total: dict[str, float] = {}
        self.processes: dict[str, dict[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _query(self, what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", what, "--format=csv,noheader,nounits"], capture_output=True, text=True)
        return [[p.strip() for p in line.split(",")] for line in out.stdout.splitlines() if line.strip()]

    def _total(self) -> int:
        rows = self._query("--query-gpu=memory.used")
        return int(rows[0][0]) if rows else 0

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            phase = self.phase
            used = (self._total() - self.base) * 2**20 / 1e9
            self.total[phase] = round(max(self.total.get(phase, 0.0), used), 2)
            per = self.processes.setdefault(phase, {})
            for row in self._query("--query-compute-apps=pid,used_memory"):
                if len(row) == 2 and row[1].isdigit():
                    per[int(row[0])] = round(max(per.get(int(row[0]), 0.0), int(row[1]) * 2**20 / 1e9), 2)

    def __enter__(self) -> GpuProcessMemory:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------------------------------- runs
def fresh_env(root: pathlib.Path) -> dict[str, str]:
    """This process's environment with empty caches, temporary folder and home under `root` (a rescheduled pod's)."""
    env = {k: v for k, v in os.environ.items() if k != "DICACHE_COMPILE_ARTIFACT"}
    for name, sub in (("HOME", "home"), ("TMPDIR", "tmp"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        (root / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(root / sub)
    env["TRITON_CACHE_DIR"] = str(root / "triton")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["SGLANG_CACHE_DIT_ENABLED"] = "false"
    return env


def serve_run(
    args, name: str, checkpoint: pathlib.Path, store: pathlib.Path, work: pathlib.Path, budget: float
) -> dict:
    """One fresh `dicache serve` on `checkpoint` with the artifact store `store`: its start-up, first request and
    steady state, memory. `budget`: seconds it may take to become healthy."""
    import httpx

    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    env = fresh_env(root)
    port = free_port()
    flags = args.server_args.split() + ["--compile-artifact", str(store)]
    flags += RUN_FLAGS.get(name, [])
    cmd = [sys.executable, "-m", "dicache.cli", "serve", "--model", str(checkpoint), "--device", args.device]
    cmd += ["--port", str(port), "--max-queue", "64", "--timeout", "1800", "--log-level", "info", *flags]
    cmd += ["--default-size", f"{args.size}x{args.size}"]  # the warm-up's size: the one the requests below ask for
    dropped = drop_page_cache(weight_files(checkpoint) + snapshot_files(store)) if args.drop_caches else "kept"
    row: dict = {"run": name, "page_cache": dropped}
    log_path = args.out / f"serve-{name}.log"
    with GpuProcessMemory(args.device.startswith("cuda")) as memory:
        launched = time.time()
        log = open(log_path, "w")  # noqa: SIM115 - closed by stop_server
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        proc.log = log
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                row["healthy_s"] = round(wait_healthy(url, proc, budget), 1)
            except RuntimeError as exc:
                row["healthy_s"] = None
                row["error"] = f"{exc} (exit {proc.poll()}); see {log_path.name}"
                return row
            info = httpx.get(f"{url}/v1/server_info", timeout=30).json()
            startup = info.get("startup") or {}
            row["launch_to_process_s"] = round(startup.get("process_start_unix", launched) - launched, 2)
            row.update({f"{k}_s": v for k, v in (startup.get("phases_s") or {}).items()})
            row["ready_s"] = startup.get("ready_s")
            row["text_lengths"] = startup.get("text_lengths")  # in the background: how far at the first request
            memory.phase = "first"
            body = request_body(PROMPT, "turbo", "off", args.size, 0)
            first_answer = one_request(url, body)
            first, answered = first_answer.seconds, time.time()
            row["first_request_s"] = round(first, 3)
            row["first_answer_s"] = round(answered - startup.get("process_start_unix", launched), 1)
            # the steady state: once the prompt lengths met in the background after ready are all met (until then a
            # request may wait for one of their chunks)
            row["lengths_after_first_s"] = wait_steady(url, budget)
            steady_answers = [one_request(url, {**body, "seed": i}) for i in range(1, args.requests + 1)]
            steady = [a.seconds for a in steady_answers]
            row["steady_s"] = round(statistics.median(steady), 3)
            row["first_vs_steady"] = round(first / statistics.median(steady), 3)
            # where the first request's extra time went: its phases against the steady requests' means
            row["first_where"] = where_time_goes([first_answer])
            row["steady_where"] = where_time_goes(steady_answers)
            memory.phase = "serving"
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: one_request(url, {**body, "seed": 100 + i}), range(args.burst)))
            row["startup"] = startup
            reads = startup.get("reads") or {}
            read_bytes = sum(r["GB"] for r in reads.values())
            read_s = sum(r["seconds"] for r in reads.values())
            row["checkpoint_GBps"] = round(read_bytes / read_s, 2) if read_s else None
            phases = startup.get("phases_s") or {}
            load_s = phases.get("weights", 0.0) + phases.get("quantization", 0.0)
            row["load_GBps"] = round(read_bytes / load_s, 2) if read_bytes and load_s else None  # quantisation in
            row["server_memory"] = info.get("memory")
        finally:
            stop_server(proc)
    row["gpu_start_GB"] = memory.total.get("start")
    row["gpu_first_GB"] = memory.total.get("first")
    row["gpu_serving_GB"] = memory.total.get("serving")
    row["gpu_processes_start_GB"] = memory.processes.get("start")
    row["artifact_log"] = [line for line in log_path.read_text().splitlines() if "compile artifact" in line][-3:]
    return row


def generate_runs(args, checkpoint: pathlib.Path, work: pathlib.Path, budget: float) -> list[dict]:
    """`dicache generate --compile` for one image twice, each a fresh process: without an artifact (it saves one),
    then with it. Wall time of the process and of the pipeline call (its own 'wrote ... in X s')."""
    store = work / "generate-artifacts"
    rows = []
    for name in ("generate-cold", "generate-artifact"):
        root = work / name
        shutil.rmtree(root, ignore_errors=True)
        env = fresh_env(root)
        cmd = [sys.executable, "-m", "dicache.cli", "generate", PROMPT, "--model", str(checkpoint)]
        cmd += ["--device", args.device, "--variant", "turbo", "--height", str(args.size), "--width", str(args.size)]
        cmd += [*args.server_args.split(), "--compile-artifact", str(store), "--out", str(root / "image.png")]
        dropped = drop_page_cache(weight_files(checkpoint) + snapshot_files(store)) if args.drop_caches else "kept"
        start = time.perf_counter()
        try:
            result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired:
            rows.append({"run": name, "error": f"did not finish within {budget:.0f} s"})
            break
        wall = time.perf_counter() - start
        (args.out / f"{name}.log").write_text(result.stdout + result.stderr)
        found = re.search(r"wrote .* in ([\d.]+) s", result.stdout)
        rows.append(
            {
                "run": name,
                "page_cache": dropped,
                "exit": result.returncode,
                "wall_s": round(wall, 1),
                "pipeline_call_s": float(found.group(1)) if found else None,
                "artifact_log": [line for line in result.stderr.splitlines() if "compile artifact" in line][-2:],
            }
        )
        budget -= wall
        if result.returncode != 0 or budget < 60:
            break
    return rows


# ----------------------------------------------------------------------------------------------------- report
SERVE_COLUMNS = (
    "run",
    "healthy_s",
    "ready_s",
    "imports_s",
    "weights_s",
    "quantization_s",
    "speed_s",
    "compile_artifact_s",
    "warm_up_s",
    "text_lengths_s",
    "lengths_after_first_s",
    "artifact_save_s",
    "snapshot_save_s",
    "first_request_s",
    "steady_s",
    "first_vs_steady",
    "first_answer_s",
    "checkpoint_GBps",
    "load_GBps",
    "gpu_start_GB",
    "gpu_serving_GB",
)


def markdown(results: dict, args, command: str) -> str:
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        "",
        f"## Start-up of `dicache serve` from a fresh process (`bench_startup.py`), {when}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {results['machine']}; checkpoint: {results['checkpoint']}  ",
        f"Server flags: `{args.server_args}`; page cache dropped before each run by: "
        f"{', '.join(sorted({r.get('page_cache', '?') for r in results['serve']})) or 'n/a'}  ",
        f"Disk: sequential read of the checkpoint's files ({results['disk']['GB']} GB, {args.threads} at a time, "
        f"page cache dropped): **{results['disk']['GBps']} GB/s**",
        "",
    ]
    if results["serve"]:
        lines += markdown_table(results["serve"], SERVE_COLUMNS)
        lines.append("")
        disk = results["disk"]["GBps"]
        for row in results["serve"]:
            if row.get("checkpoint_GBps"):
                lines.append(
                    f"- {row['run']}: checkpoint read at {row['checkpoint_GBps']} GB/s = "
                    f"{100 * row['checkpoint_GBps'] / disk:.0f} % of the disk's (reading alone), loaded with the FP8 "
                    f"quantisation at {row.get('load_GBps')} GB/s = {100 * (row.get('load_GBps') or 0) / disk:.0f} %; "
                    f"reads {json.dumps((row.get('startup') or {}).get('reads'))}"
                )
            if row.get("error"):
                lines.append(f"- {row['run']}: {row['error']}")
            warm = (row.get("startup") or {}).get("warm_up") or {}
            if warm:
                lines.append(
                    f"- {row['run']}: warm-up compile caches {json.dumps(warm.get('compile_caches'))}; compiled frames "
                    f"{json.dumps(warm.get('compiles'))}; longest compile steps (s, nested) "
                    f"{json.dumps(warm.get('compile_time_s'))}; generations {json.dumps(warm.get('runs'))}"
                )
            startup = row.get("startup") or {}
            snapshots, prefetched = json.dumps(startup.get("weight_snapshots")), json.dumps(startup.get("prefetch"))
            lines.append(
                f"- {row['run']}: imports {json.dumps(startup.get('imports'))}; quantised weights {snapshots}; read "
                f"while importing {prefetched}; prompt lengths when ready {json.dumps(row.get('text_lengths'))}"
            )
            if row.get("first_where"):
                lines.append(
                    f"- {row['run']}: the first request's seconds {json.dumps(row['first_where'])}; the steady "
                    f"requests' means {json.dumps(row.get('steady_where'))}"
                )
            lines.append(
                f"- {row['run']}: GPU memory per process while starting (GB, nvidia-smi): "
                f"{json.dumps(row.get('gpu_processes_start_GB'))}; torch/NVML per phase "
                f"{json.dumps((row.get('startup') or {}).get('gpu_GB'))}; artifact: {row.get('artifact_log')}"
            )
        lines.append("")
    if results["generate"]:
        lines += markdown_table(results["generate"], ("run", "exit", "wall_s", "pipeline_call_s", "page_cache"))
        lines.append("")
    return "\n".join(lines) + "\n"


def filesystem(path: pathlib.Path) -> str:
    """The type and device of the file system holding `path` (`df -T`), e.g. 'ext4 /dev/nvme0n1p1'."""
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()
    parts = out[-1].split() if len(out) > 1 else []
    return f"{parts[1]} {parts[0]}" if len(parts) > 1 else "an unknown file system"


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU, torch {torch.__version__}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", default=["cold", "artifact"], choices=RUNS)
    p.add_argument(
        "--checkpoint", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()) / "dicache-startup" / "krea2"
    )
    p.add_argument("--tiny", action="store_true", help="the embedded checkpoint's configs (a logic check)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--server-args", default=FAST_PATH, help="the `dicache serve` / `generate` speed flags")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--requests", type=int, default=5, help="steady-state requests after the first")
    p.add_argument("--burst", type=int, default=16, help="requests at concurrency 8 for the serving peak")
    p.add_argument("--threads", type=int, default=8, help="files read at a time for the disk's rate")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false")
    p.add_argument(
        "--keep-artifacts",
        action="store_true",
        help="keep the compile artifacts of an earlier run of this benchmark on this machine (default: start without)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=510,
        help="seconds for the whole benchmark; runs that would not fit are skipped",
    )
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "bench-startup-out")))
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    began = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.checkpoint.parent / "runs"
    store = work / "artifacts"
    if not args.keep_artifacts:
        shutil.rmtree(work, ignore_errors=True)
    written = write_checkpoint(args.checkpoint, args.tiny, args.device)
    files = weight_files(args.checkpoint)
    drop_page_cache(files)
    disk = read_rate(files, args.threads)
    results = {
        "machine": machine(),
        "checkpoint": f"{args.checkpoint} on {filesystem(args.checkpoint)} ({disk['GB']} GB of weights, written in "
        f"{written['written_s']} s)",
        "disk": disk,
        "serve": [],
        "generate": [],
    }
    print(json.dumps({"checkpoint": written, "disk": disk}), flush=True)
    for name in args.runs:
        left = args.deadline - (time.perf_counter() - began)
        if left < 90:
            results["serve"].append({"run": name, "error": f"skipped: {left:.0f} s left of --deadline"})
            continue
        if name == "generate":
            results["generate"] = generate_runs(args, args.checkpoint, work, left - 30)
        else:
            results["serve"].append(serve_run(args, name, args.checkpoint, store, work, left - 60))
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        print(json.dumps(results["serve"][-1] if name != "generate" else results["generate"], default=str), flush=True)
    publish(markdown(results, args, command_line("bench_startup.py", argv)), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
