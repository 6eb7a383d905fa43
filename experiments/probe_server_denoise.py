"""Why a Turbo request's denoise phase in `dicache serve` takes longer than `bench_krea2_speed.py`'s (issue 27): the
same full-size backend `dicache serve --load-format dummy --compile --quantization fp8 [--text-encoder-quantization
fp8]` builds and warms up, in-process, its denoising loop timed step by step (CUDA-synchronised after each step) in
several contexts: the main thread under `no_grad` or `inference_mode`, the server's denoise phase thread, and
`backend.generate` whole; per cache mode (SGLang's default pattern, the recommended Turbo setting), with the steps
computed and cached.

    python experiments/probe_server_denoise.py [--text-encoder-fp8] [--results benchmarks/RESULTS.md]   # GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # publish, bench_*

from bench_serving import add_backend_arguments, backend_spec, request_body, warmed_backend  # noqa: E402
from publish import command_line, publish  # noqa: E402

import dicache  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    add_backend_arguments(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    start = time.perf_counter()
    backend, size, warm = warmed_backend(
        args.tiny, args.device, "fp8" if cuda else None, args.text_encoder_fp8 and cuda
    )
    from torch._dynamo.utils import counters

    print(f"loaded and warmed up in {time.perf_counter() - start:.1f} s: {warm}", flush=True)
    pipe = backend.pipe
    session = dicache.session_of(pipe)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def spec_for(mode: str):
        return backend_spec(backend, request_body("a red apple on a wooden table", "turbo", mode, size, seed=0))

    def loop(spec, encoded) -> dict:
        marks = []

        def on_step(p, i, t, tensors):
            sync()
            marks.append(time.perf_counter())
            return tensors

        sync()
        t0 = time.perf_counter()
        with session.request(config=spec.cache):
            pipe.run_denoise(encoded.plan, encoded.cond, encoded.uncond, encoded.latents, callback_on_step_end=on_step)
        sync()
        st = dicache.stats(pipe)
        steps = [round(b - a, 4) for a, b in zip([t0, *marks[:-1]], marks)]
        branch = next(iter(st.branches.values()))
        return {"s": time.perf_counter() - t0, "steps": steps, "computed": list(branch.computed_steps)}

    contexts = {
        "main no_grad": lambda fn: _in(torch.no_grad, fn),
        "main inference_mode": lambda fn: _in(torch.inference_mode, fn),
        "denoise thread (server)": lambda fn: backend.stages().run("denoise", fn),
    }
    rows = []
    for mode in ("sglang", "recommended"):
        spec = spec_for(mode)
        encoded = backend.stages().run("encode", backend._encode, spec)
        for name, ctx in contexts.items():
            graphs = counters["stats"]["unique_graphs"]
            runs = [ctx(lambda s=spec, e=encoded: loop(s, e)) for _ in range(args.reps + 1)][1:]
            best = min(runs, key=lambda r: r["s"])
            rows.append(
                {
                    "cache": mode,
                    "context": name,
                    "denoise_s": round(statistics.median(r["s"] for r in runs), 4),
                    "computed_steps": best["computed"],
                    "step_s": best["steps"],
                    "new_graphs": counters["stats"]["unique_graphs"] - graphs,
                }
            )
            print(rows[-1], flush=True)
        results = [backend.generate(spec) for _ in range(args.reps + 1)][1:]
        phases = {k: round(statistics.median(r.phases[k] for r in results), 4) for k in results[0].phases}
        rows.append({"cache": mode, "context": "backend.generate", "denoise_s": phases["denoise"], "phases": phases})
        print(rows[-1], flush=True)
        encode_main = []
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                backend._encode(spec)
            sync()
            encode_main.append(time.perf_counter() - t0)
        rows.append({"cache": mode, "context": "encode, main thread", "encode_s": round(min(encode_main), 4)})
        print(rows[-1], flush=True)
    backend.close()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    text = [
        f"\n## Server denoise phase, step by step (`probe_server_denoise.py`), {datetime.datetime.now():%Y-%m-%d %H:%M}"
        "\n",
        f"Command: `{command_line('probe_server_denoise.py', argv, folder='experiments')}`  ",
        f"Machine: {device}, torch {torch.__version__}; full-size Krea-2 random weights, 1024², FP8 + compile"
        f"{', text encoder FP8' if args.text_encoder_fp8 else ''}\n",
        "| cache | context | denoise_s | computed_steps | new graphs | step_s / phases |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        text.append(
            f"| {r['cache']} | {r['context']} | {r.get('denoise_s', '')} | {r.get('computed_steps', '')} | "
            f"{r.get('new_graphs', '')} | "
            f"{r.get('step_s') or r.get('phases') or r.get('encode_s')} |"
        )
    publish("\n".join(text) + "\n", args.results)
    out = pathlib.Path(os.environ.get("OUT", "."))
    (out / "probe_server_denoise.json").write_text(json.dumps(rows, indent=1))
    return 0


def _in(mode, fn):
    with mode():
        return fn()


if __name__ == "__main__":
    sys.exit(main())
