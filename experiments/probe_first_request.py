"""Where a request of a new prompt length spends its extra time, with a cuDNN attention plan per length or one shared
plan (`TORCH_CUDNN_SDPA_AVOID_RECOMPILE` 0 / 1, `dicache.models.krea2.attention_plans`), and what the shared plan costs
every request (issue 41: the first request after ready within 5 % of the steady state).

One child process per setting, in the order of --settings (the variable is read once per process), each building the
backend `dicache serve --load-format dummy --compile --quantization fp8 --text-encoder-quantization fp8` builds
(full-size Krea-2, random weights, 1024², Turbo), warmed up as the server warms up, with no prompt length met after it.
Each child then measures, on the server's own phase threads:

- `generate`: a request of a prompt length new to the process, then the same request again (its phases);
- `encode steps`: for another new length, the encode phase's parts synchronised one by one (the text encoder, the
  text conditioning, the starting latents), the first time and again;
- `steady`: --steady requests of one prompt, the median of each phase.

    python experiments/probe_first_request.py [--settings 0,1,0] [--steady 12] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # publish, bench_serving

ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
BASE = "a red apple on a wooden table"


def prompt_of(words: int) -> str:
    return BASE + " with" + " many small details" * words


def child(steady: int, out: pathlib.Path, tiny: bool, device: str, profile: bool = False) -> None:
    from bench_serving import backend_spec, request_body, warmed_backend

    cuda = device.startswith("cuda")
    start = time.perf_counter()
    backend, size, warm = warmed_backend(tiny, device, "fp8" if cuda else None, cuda)
    rows = [{"what": "warm-up", "seconds": round(time.perf_counter() - start, 1), "graphs": warm["graphs_compiled"]}]
    stages, pipe = backend.stages(), backend.pipe
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def spec(prompt: str):
        return backend_spec(backend, request_body(prompt, "turbo", "recommended", size, seed=0))

    def tokens(prompt: str) -> int:
        return int(pipe.text_encoder.num_valid_tokens([prompt])[0])

    for words in (3, 11, 25):
        prompt = prompt_of(words)
        for when in ("first", "again"):
            result = backend.generate(spec(prompt))
            phases = {k: round(v, 4) for k, v in (result.phases or {}).items()}
            rows.append({"what": "generate", "n": tokens(prompt), "when": when, "total_s": round(result.seconds, 4),
                         **phases})  # fmt: skip
            print(rows[-1], flush=True)

    def encode_steps(prompt: str) -> dict:
        marks = {}

        def timed(name, fn):
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            marks[name] = round(time.perf_counter() - t0, 4)
            return out

        def run():
            with torch.inference_mode():
                embeds, mask = timed("text_encoder_s", lambda: pipe.encode_prompt([prompt]))
                timed("conditioning_s", lambda: pipe.text_conditioning(embeds, mask, 1))
                plan = backend._plan(spec(prompt))
                timed("latents_s", lambda: pipe.starting_latents(plan, seed=0))
            return marks

        return stages.run("encode", run)

    for words in (5, 17, 40):
        prompt = prompt_of(words)
        for when in ("first", "again"):
            rows.append({"what": "encode steps", "n": tokens(prompt), "when": when, **encode_steps(prompt)})
            print(rows[-1], flush=True)
    if profile:  # the text conditioning at a new length and again, under torch.profiler, on the encode thread
        prompt = prompt_of(60)
        with torch.inference_mode():
            embeds, mask = stages.run("encode", lambda: pipe.encode_prompt([prompt]))
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] * cuda)
        for when in ("first", "again"):

            def conditioning():
                with torch.profiler.profile(activities=activities) as prof, torch.inference_mode():
                    pipe.text_conditioning(embeds, mask, 1)
                    sync()
                return prof

            prof = stages.run("encode", conditioning)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
            print(f"== profile of the text conditioning, n={tokens(prompt)}, {when}\n{table}", flush=True)
            (out.parent / f"{out.stem}-profile-{when}.txt").write_text(f"n={tokens(prompt)}, {when}\n{table}")

    results = [backend.generate(spec(prompt_of(3))) for _ in range(steady)]
    phases = {k: round(statistics.median(r.phases[k] for r in results), 4) for k in results[0].phases}
    rows.append({"what": "steady", "n": tokens(prompt_of(3)), "total_s": round(statistics.median(
        r.seconds for r in results), 4), **phases})  # fmt: skip
    print(rows[-1], flush=True)
    backend.close()
    out.write_text(json.dumps(rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="0,1,0", help=f"values of {ENV}, one child process each, in this order")
    p.add_argument("--steady", type=int, default=12)
    p.add_argument("--profile", action="store_true", help="print a profile of a new length's text conditioning")
    p.add_argument("--tiny", action="store_true", help="the embedded checkpoint's configs (a logic check)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--results", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.steady, pathlib.Path(args.child), args.tiny, args.device, args.profile)
        return 0
    from publish import command_line, markdown_table, publish

    table, profiles = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for index, value in enumerate(args.settings.split(",")):
            out = pathlib.Path(tmp, f"{index}.json")
            cmd = [sys.executable, __file__, "--steady", str(args.steady), "--device", args.device, "--child", str(out)]
            cmd += (["--tiny"] if args.tiny else []) + (["--profile"] if args.profile else [])
            subprocess.run(cmd, env={**os.environ, ENV: value}, check=True)
            table += [{"process": index, ENV: value, **row} for row in json.loads(out.read_text())]
            found = sorted(pathlib.Path(tmp).glob(f"{index}-profile-*"))
            profiles += [f"process {index}, {f.read_text()}" for f in found]
    keys = list(dict.fromkeys(key for row in table for key in row))
    for row in table:
        for key in keys:
            row.setdefault(key, "")
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    text = [
        f"\n## A new prompt length's first request, per-length or shared attention plans (`probe_first_request.py`), "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}\n",
        f"Command: `{command_line('probe_first_request.py', argv, folder='experiments')}`  ",
        f"Machine: {machine}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
        "full-size Krea-2, random weights, FP8 + compile, text encoder FP8, 1024², Turbo (the recommended cache); "
        "seconds; n: the prompt's real text tokens\n",
        *markdown_table(table, keys),
        *(["\nThe text conditioning's profiles (`--profile`):\n\n```", *profiles, "```"] if profiles else []),
    ]
    publish("\n".join(text) + "\n", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
