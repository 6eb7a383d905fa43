"""The server's CPU-side costs around a generation (issue 27), on this machine's CPU:

- `png`: writing a 1024² RGB image as PNG at `PNG_COMPRESS_LEVEL`, with Pillow and with `dicache.server.png` (one
  thread with zlib's default strategy and with its run-length one, and its default threads), on a noise-like image
  (what a random-weights model makes), a smooth one, that one with noise, and the docs' sample grid upscaled;
- `image`: the image phase's host work as the server runs it (`backend.image_answers`) and each of its parts alone
  (the fingerprint, the PNG file, the file in base64 band by band on the PNG threads (`encode_png_base64`, the
  server's path since 2026-12-03) and, for comparison, the file then its base64 (the path before, base64 serial after
  the file) and that base64 alone): on the GPU host, which part bounds the phase;
- `json`: the answer's image list as JSON bytes (`handling.images_json`, run by the worker for every answer) for a
  1024² noise-like PNG in base64, against the regular-expression check and f-string it replaced on 2026-12-03;
- `client`: what the benchmark client itself adds to a latency: a 4.2 MB answer (one 1024² image in base64) from a
  local uvicorn app, fetched with a new `httpx.post` per request (`bench_serving.py` until 2026-12-03) and with one
  kept-alive `httpx.Client` (its `KeptAliveClients`, as load generators do);
- `gc`: the Python objects a loaded, compiled server backend leaves (the embedded checkpoint) and the time of one full
  garbage collection, before and after `freeze_start_up_objects()`.

    python benchmarks/bench_server_cpu.py [--results benchmarks/RESULTS.md]

Prints a table and appends it to --results.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from publish import command_line, publish  # noqa: E402

from dicache.server.backend import PNG_COMPRESS_LEVEL  # noqa: E402
from dicache.server.png import MAX_THREADS, encode_png  # noqa: E402


def _ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 1)


def _pillow(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def section_png(reps: int) -> list[str]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:1024, 0:1024]
    smooth = np.stack([x // 4, y // 4, (x + y) // 8], axis=-1).astype(np.uint8)
    grid = Image.open(pathlib.Path(__file__).parents[1] / "docs" / "krea2-tiny-grid.png").convert("RGB")
    images = {
        "noise": rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8),
        "smooth": smooth,
        "smooth + noise (σ 3)": np.clip(smooth + rng.normal(0, 3, smooth.shape), 0, 255).astype(np.uint8),
        "docs/krea2-tiny-grid.png, bicubic to 1024²": np.asarray(grid.resize((1024, 1024), Image.BICUBIC)),
    }
    rows = ["| image | writer | ms (median) | KiB |", "|---|---|---|---|"]
    for name, pixels in images.items():
        writers = {
            "Pillow": lambda p=pixels: _pillow(p),
            "dicache.server.png, 1 thread, zlib's default strategy": lambda p=pixels: encode_png(
                p, PNG_COMPRESS_LEVEL, 1, run_length=False
            ),
            "dicache.server.png, 1 thread": lambda p=pixels: encode_png(p, PNG_COMPRESS_LEVEL, 1),
            f"dicache.server.png, default (up to {MAX_THREADS} threads)": lambda p=pixels: encode_png(
                p, PNG_COMPRESS_LEVEL
            ),
        }
        for writer, fn in writers.items():
            rows.append(f"| {name} | {writer} | {_ms(fn, reps)} | {len(fn()) // 1024} |")
    return rows


def section_image(reps: int) -> list[str]:
    """The image phase's host work for one 1024² noise-like image, as the server runs it (`image_answers`: the
    fingerprint on a thread while the PNG is written in base64, `encode_png_base64`) and each part alone: which one
    bounds it; and the path before (the PNG file, then its base64 on the calling thread)."""
    import base64
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from dicache.server.backend import image_answers
    from dicache.server.png import encode_png_base64

    rng = np.random.default_rng(0)
    floats = rng.random((1, 1024, 1024, 3), dtype=np.float32)
    pixels = (floats * 255).round().astype(np.uint8)
    png_bytes = encode_png(pixels[0], PNG_COMPRESS_LEVEL)
    assert encode_png_base64(pixels[0], PNG_COMPRESS_LEVEL) == base64.b64encode(png_bytes).decode("ascii")
    rows = ["| part | ms (median) |", "|---|---|"]
    with ThreadPoolExecutor(1) as digests:
        for name, fn in {
            "image_answers (the phase: the fingerprint on its own thread, the PNG file in base64)": lambda: (
                image_answers(floats, pixels, "png", 100, digests)
            ),
            "SHA-256 fingerprint of the float32 image (12.6 MB)": lambda: hashlib.sha256(floats[0]).hexdigest(),
            f"PNG file (dicache.server.png, up to {MAX_THREADS} threads)": lambda: encode_png(
                pixels[0], PNG_COMPRESS_LEVEL
            ),
            "PNG file in base64, band by band on the PNG threads (encode_png_base64, the phase's path)": lambda: (
                encode_png_base64(pixels[0], PNG_COMPRESS_LEVEL)
            ),
            "PNG file, then base64.b64encode of it (the path before 2026-12-03)": lambda: base64.b64encode(
                encode_png(pixels[0], PNG_COMPRESS_LEVEL)
            ).decode("ascii"),
            "base64.b64encode of the PNG file alone (serial: binascii holds the GIL)": lambda: base64.b64encode(
                png_bytes
            ).decode("ascii"),
        }.items():
            rows.append(f"| {name} | {_ms(fn, reps)} |")
    return rows


def section_json(reps: int) -> list[str]:
    import base64
    import re

    from dicache.server.handling import images_json

    rng = np.random.default_rng(0)
    b64 = base64.b64encode(encode_png(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8))).decode("ascii")
    digest = "ab" * 32
    safe = re.compile(r"[A-Za-z0-9+/=]*")

    def regex_and_fstring() -> bytes:  # the way before 2026-12-03
        for text in (b64, digest):
            if not safe.fullmatch(text):
                raise ValueError("unsafe")
        return f'[{{"b64_json":"{b64}","sha256":"{digest}"}}]'.encode("ascii")

    assert regex_and_fstring() == images_json([b64], [digest])
    rows = ["| builder | ms (median) | MB |", "|---|---|---|"]
    for name, fn in {
        "regular expression + f-string (before)": regex_and_fstring,
        "images_json": lambda: images_json([b64], [digest]),
    }.items():
        rows.append(f"| {name} | {_ms(fn, reps)} | {len(fn()) / 1e6:.2f} |")
    return rows


def section_client(reps: int) -> list[str]:
    import base64
    import socket
    import threading

    import httpx
    import uvicorn
    from fastapi import FastAPI, Response

    answer = b'{"data":[{"b64_json":"' + base64.b64encode(np.random.default_rng(0).bytes(3_200_000)) + b'"}]}'
    app = FastAPI()

    @app.post("/v1/images/generations")
    async def generate() -> Response:
        return Response(answer, media_type="application/json")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/images/generations"
    rows = ["| client | ms per request (median) | MB |", "|---|---|---|"]
    with httpx.Client(timeout=60) as kept:
        for name, post in {
            "a new httpx.post per request (before)": lambda: httpx.post(url, json={"prompt": "x"}, timeout=60),
            "one kept-alive httpx.Client (KeptAliveClients)": lambda: kept.post(url, json={"prompt": "x"}),
        }.items():
            rows.append(f"| {name} | {_ms(post, reps)} | {len(post().content) / 1e6:.2f} |")
    server.should_exit = True
    thread.join(timeout=10)
    return rows


def section_gc() -> list[str]:
    from dicache.server.backend import load_backend
    from dicache.server.gc_pauses import freeze_start_up_objects

    backend = load_backend(None, "turbo", device="cpu", compile=True)
    backend.warm_up()
    objects = len(gc.get_objects())
    before = _ms(gc.collect, 3)
    frozen = freeze_start_up_objects()
    after = _ms(gc.collect, 3)
    gc.unfreeze()
    backend.close()
    return [
        "| objects tracked | full collection (ms) | objects frozen | full collection after the freeze (ms) |",
        "|---|---|---|---|",
        f"| {objects} | {before} | {frozen} | {after} |",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="png,image,json,client,gc")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    text = [
        f"\n## Server CPU costs (`bench_server_cpu.py`), {datetime.datetime.now():%Y-%m-%d %H:%M}\n",
        f"Command: `{command_line('bench_server_cpu.py', argv)}`  ",
        f"Machine: {platform.machine()} CPU ({os.cpu_count()} cores), Python {platform.python_version()}\n",
    ]
    sections = args.sections.split(",")
    if "png" in sections:
        text += [f"PNG of a 1024² RGB image at zlib level {PNG_COMPRESS_LEVEL}:", "", *section_png(args.reps), ""]
    if "image" in sections:
        text += ["The image phase's host work (one 1024² noise-like image):", "", *section_image(args.reps), ""]
    if "json" in sections:
        title = "The answer's image list as JSON bytes (one 1024² noise-like PNG in base64):"
        text += [title, "", *section_json(args.reps), ""]
    if "client" in sections:
        title = "The benchmark client's own time for a 4.2 MB answer from a local uvicorn app:"
        text += [title, "", *section_client(args.reps), ""]
    if "gc" in sections:
        text += ["Garbage collection with a loaded, compiled backend (embedded checkpoint):", "", *section_gc(), ""]
    publish("\n".join(text), args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
