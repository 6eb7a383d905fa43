"""Where a full-size random-weight Krea-2 (`--load-format dummy`) first gives NaN or inf: text embeddings, each
transformer module, each step's latents; eager, then compiled as `dicache serve --compile` runs it. A GPU probe:

    python experiments/probe_nonfinite.py [--quantization fp8] [--text-encoder-quantization fp8] [--steps 4 8]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_serving import write_model_folder  # noqa: E402

from dicache.models.krea2.pipeline import Krea2Pipeline  # noqa: E402


def first_bad(value):
    """The first floating tensor of `value` (a tensor or a tuple of them) holding NaN or inf, else None."""
    tensors = [value] if torch.is_tensor(value) else [v for v in (value or ()) if torch.is_tensor(v)]
    for t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return t
    return None


def watch(pipe, log):
    """Forward hooks on the transformer's modules down to four name levels (a block's linears): `log["first"]` gets
    the first module whose output holds NaN or inf, with its input's and output's magnitudes."""
    handles = []
    for name, module in pipe.transformer.named_modules():
        if name.count(".") > 3:
            continue

        def hook(mod, args, out, name=name):
            if log["first"] is None and first_bad(out) is not None:
                bad_in = first_bad(args)
                ins = [a for a in args if torch.is_tensor(a) and a.is_floating_point()]
                outs = [out] if torch.is_tensor(out) else [o for o in out if torch.is_tensor(o)]
                log["first"] = (
                    f"{name or 'transformer'} ({type(mod).__name__}; input non-finite: {bad_in is not None}; "
                    f"input absmax {[round(float(a.float().abs().max()), 3) for a in ins]} shape "
                    f"{[tuple(a.shape) for a in ins]}; output absmax finite part "
                    f"{[float(o.float().nan_to_num(0, 0, 0).abs().max()) for o in outs]}; "
                    f"non-finite {[int((~torch.isfinite(o)).sum()) for o in outs]} of {[o.numel() for o in outs]}; "
                    f"module {mod!r:.300})"
                )

        handles.append(module.register_forward_hook(hook))
    return handles


def run(pipe, steps, label):
    stats = []

    def on_step(p, i, t, kw):
        lat = kw["latents"]
        stats.append((i, bool(torch.isfinite(lat).all()), float(lat.float().abs().nan_to_num(0, 0, 0).max())))
        return {}

    for prompt in ("warm-up", "a longer warm-up prompt, so that the text length differs from the first one"):
        emb, mask = pipe.text_encoder.encode(prompt)
        start = time.perf_counter()
        try:
            pipe(
                prompt,
                num_inference_steps=steps,
                seed=0,
                output_type="latent",
                variant="turbo",
                callback_on_step_end=on_step,
            )
            error = None
        except Exception as err:  # noqa: BLE001 - a probe reports every failure
            error = f"{type(err).__name__}: {err}"
        print(
            f"{label} steps={steps} prompt={prompt[:12]!r}: text finite {bool(torch.isfinite(emb).all())} "
            f"absmax {emb.float().abs().max().item():.3g}; per step {stats}; error {error}; "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
        stats.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--text-encoder-quantization", default=None)
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="the embedded configs (a logic check)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    folder = write_model_folder(pathlib.Path("/var/tmp/nonfinite-probe"), tiny=args.tiny)
    start = time.perf_counter()
    pipe = Krea2Pipeline.from_pretrained(
        folder,
        device=args.device,
        load_format="dummy",
        quantization=args.quantization,
        text_encoder_quantization=args.text_encoder_quantization,
    )
    label = f"q={args.quantization} te={args.text_encoder_quantization}"
    print(f"{label}: loaded in {time.perf_counter() - start:.1f} s", flush=True)
    log = {"first": None}
    handles = watch(pipe, log)
    for steps in args.steps:
        run(pipe, steps, label + " eager")
    print(f"{label} eager: first non-finite module output: {log['first']}", flush=True)
    for h in handles:
        h.remove()
    if args.compile:
        pipe.compile()
        for steps in args.steps:
            run(pipe, steps, label + " compiled")


if __name__ == "__main__":
    main()
