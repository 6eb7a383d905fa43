"""Why a new prompt length costs time on the first call (issue 27): scaled_dot_product_attention's first call at a new
shape, per backend, at Krea-2's full-size attention shapes; whether a call on one thread warms another.

Shapes, for a text of n real tokens at 1024²: the blocks' joint attention `q (1, 48, 4096+n, 128)`, `k/v (1, 12, ...)`
(GQA); the text path's layerwise blocks `(n, 20, 12, 128)` (attention over the 12 tapped layers of each token) and
refiner blocks `(1, 20, n, 128)`. Each row: CUDA-synchronised seconds of the first call at that n and of the second.

    python experiments/probe_sdpa_plans.py [--lengths 9,14,20] [--results benchmarks/RESULTS.md]    # GPU
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # publish, bench_*

from publish import command_line, markdown_table, publish  # noqa: E402

BACKENDS = {
    "default": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
}


def shapes(n: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {
        "blocks": ((1, 48, 4096 + n, 128), (1, 12, 4096 + n, 128)),
        "text layerwise": ((n, 20, 12, 128), (n, 20, 12, 128)),
        "text refiner": ((1, 20, n, 128), (1, 20, n, 128)),
    }


def call(q, k, v, backend):
    gqa = q.shape[1] != k.shape[1]
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 4)


def in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()))
    thread.start()
    thread.join()
    return box["out"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="9,14,20")
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    dev, dt = "cuda", torch.bfloat16
    call(*(torch.randn(1, 4, 64, 64, device=dev, dtype=dt) for _ in range(3)), None)  # context, handles
    rows = []
    for offset, (backend_name, backend) in enumerate(BACKENDS.items()):
        for n in lengths:
            n = n + offset * 100  # every backend meets lengths new to the process
            for what, (qs, ks) in shapes(n).items():
                q = torch.randn(qs, device=dev, dtype=dt)
                k, v = torch.randn(ks, device=dev, dtype=dt), torch.randn(ks, device=dev, dtype=dt)
                run = lambda q=q, k=k, v=v, b=backend: call(q, k, v, b)  # noqa: E731
                try:
                    first, again = timed(run), timed(run)
                    other_thread = in_thread(lambda run=run: timed(run))
                except RuntimeError as exc:
                    first = again = other_thread = f"unsupported ({str(exc).splitlines()[0][:60]})"
                rows.append(
                    {"backend": backend_name, "shape": what, "n": n, "first_s": first, "again_s": again,
                     "other_thread_s": other_thread}
                )  # fmt: skip
                print(rows[-1], flush=True)
    keys = list(rows[0])
    text = [
        f"\n## SDPA's first call at a new shape (`probe_sdpa_plans.py`), {datetime.datetime.now():%Y-%m-%d %H:%M}\n",
        f"Command: `{command_line('probe_sdpa_plans.py', argv, folder='experiments')}`  ",
        f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
        "bf16; first_s / again_s: the first and second call at that shape on the main thread; other_thread_s: the "
        "same shape next, on a new thread\n",
        *markdown_table(rows, keys),
    ]
    publish("\n".join(text) + "\n", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
