"""What a prompt length the server has not met costs (issue 27): the same full-size backend `dicache serve
--load-format dummy --compile --quantization Q [--text-encoder-quantization fp8]` builds and warms up, in-process; for
prompts of new token counts, the first and the second call of each part of a request, CUDA-synchronised: the text
encoder (fixed padded shape), the text conditioning (the transformer's text path on the real tokens), and whole
generations (`backend.generate`, SGLang's default cache pattern) with their phases.

    python experiments/probe_prompt_length.py [--quantization fp8] [--text-encoder-fp8] \
        [--results benchmarks/RESULTS.md]
    python experiments/probe_prompt_length.py --tiny --device cpu --quantization none   # a logic check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # publish, bench_*

from bench_serving import add_backend_arguments, backend_spec, request_body, warmed_backend  # noqa: E402
from publish import command_line, markdown_table, publish  # noqa: E402

from dicache.quantization import QUANTIZATION_METHODS  # noqa: E402

WORDS = ("a", "quiet", "harbor", "town", "at", "dawn", "with", "fishing", "boats", "mist", "over", "the", "water")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantization", default="fp8", choices=("none", *QUANTIZATION_METHODS))
    p.add_argument(
        "--prepare-text-lengths",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as `dicache serve --prepare-text-lengths`: meet every prompt length before the timed calls",
    )
    p.add_argument("--lengths", default="4,9,15,22,30", help="words per new prompt, comma-separated")
    add_backend_arguments(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    start = time.perf_counter()
    backend, size, warm = warmed_backend(args.tiny, args.device, args.quantization, args.text_encoder_fp8)
    prepared = backend.prepare_text_lengths() if args.prepare_text_lengths else {}
    print(f"loaded and warmed up in {time.perf_counter() - start:.1f} s: {warm}, lengths: {prepared}", flush=True)
    pipe = backend.pipe

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, round(time.perf_counter() - t0, 4)

    def spec_for(prompt: str):
        return backend_spec(backend, request_body(prompt, "turbo", "sglang", size, seed=0))

    rows = []
    for count in (int(n) for n in args.lengths.split(",")):
        prompt = " ".join(WORDS[i % len(WORDS)] for i in range(count))
        tokens = pipe.text_encoder.num_valid_tokens(prompt)[0]
        row = {"words": count, "tokens": tokens}
        (embeds, mask), row["text_encoder_first_s"] = timed(lambda p=prompt: pipe.encode_prompt([p]))
        _, row["text_encoder_again_s"] = timed(lambda p=prompt: pipe.encode_prompt([p]))
        for label in ("first", "again"):
            _, row[f"text_conditioning_{label}_s"] = timed(lambda e=embeds, m=mask: pipe.text_conditioning(e, m, 1))
        spec = spec_for(prompt)
        for label in ("first", "again"):
            result, row[f"generate_{label}_s"] = timed(lambda s=spec: backend.generate(s))
            row[f"phases_{label}"] = {k: round(v, 4) for k, v in result.phases.items()}
        rows.append(row)
        print(rows[-1], flush=True)
    backend.close()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    keys = list(rows[0])
    text = [
        f"\n## A new prompt length's cost (`probe_prompt_length.py`), {datetime.datetime.now():%Y-%m-%d %H:%M}\n",
        f"Command: `{command_line('probe_prompt_length.py', argv, folder='experiments')}`  ",
        f"Machine: {device}, torch {torch.__version__}; {'tiny' if args.tiny else 'full-size'} Krea-2, random weights, "
        f"{size}², quantization {args.quantization}{', text encoder FP8' if args.text_encoder_fp8 else ''}, compiled "
        f"and warmed up as `dicache serve` does (graphs {warm.get('graphs_compiled')}); prompt lengths prepared: "
        f"{prepared or 'no'}; each prompt new to the process; generate: SGLang's default cache pattern, Turbo 8 "
        "steps\n",
        *markdown_table(rows, keys),
    ]
    publish("\n".join(text) + "\n", args.results)
    out = pathlib.Path(os.environ.get("OUT", "."))
    (out / "probe_prompt_length.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
