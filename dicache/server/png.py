"""PNG files of served images, written in a few milliseconds: uint8 pixels -> PNG bytes, or the file's base64.

Why not Pillow's PNG writer: a 1024² image from the random-weights model (noise-like) took 0.18 s as the image phase
of `dicache serve` on the H200's host, a sixth of a Turbo request, and this writer 0.03 s there; on a 2-core CPU it is
2.5× (noise) to 4× (a smooth image) faster than Pillow (benchmarks/RESULTS.md, issue 27, `bench_server_cpu.py`).
Here the filter is one vectorised pass and the deflate, the checksums and the base64 run on several threads:

- every row uses PNG filter 2 ("Up": the byte minus the byte above, modulo 256; the first row's "above" is zeros);
- the deflate uses zlib's run-length strategy (matches only one byte back, i.e. runs of equal filtered bytes; Huffman
  codes do the rest): on 1024² images with any grain (noise, a smooth image with noise, the docs' sample grid
  upscaled) it wrote files up to 13 % smaller than level 1's usual string matching, 1.4-2.6× faster; a flat synthetic
  gradient, whose rows repeat patterns longer than a byte, comes out 7× larger (244 against 34 KiB) and slower
  (`bench_server_cpu.py`, benchmarks/RESULTS.md 2026-12-03): generated images have grain;
- the filtered rows are split into bands, each deflated on a thread of its own (zlib releases the GIL) with a full
  flush at its end (the last: a finish), so that the bands' raw deflate streams concatenate into one valid stream
  (each band starts with an empty dictionary: a few per cent larger than one stream, next to nothing with run-length
  matching);
- each band is its own IDAT chunk (a PNG's consecutive IDAT chunks hold one zlib stream, concatenated): the first
  starts with the 2-byte zlib header, a final 4-byte IDAT chunk holds the Adler-32 of all the filtered bytes
  (combined from the bands', `adler32_combine`), then IEND;
- each band's data starts with 0, 1 or 2 empty stored deflate blocks (`EMPTY_STORED_BLOCK`, valid wherever a deflate
  stream is byte-aligned: after the header and after a full flush), so that its length, hence its chunk's (12 bytes
  more), is a multiple of 3, as the file's 33 bytes before the first IDAT are: the base64 of the file is the
  concatenated base64 of these pieces and of the 28 bytes after them. `encode_png_base64` lets each band's thread
  encode its own chunk and decode that to a str (`binascii` holds the GIL, so that part is serial, but it overlaps
  the other bands' deflate instead of following the whole file: on a 16-core host the 3 MB file of a noise-like
  1024² image took 12.1 ms and its base64 7.2 ms more); the calling thread joins the strs;
- there are `BANDS_PER_THREAD` (4) bands per thread, so that only the last bands' base64, a quarter of the whole,
  follows the deflate: with one band per thread, the threads finish their deflate together and then all their base64
  is left, one thread at a time. On a 2-core CPU (1024² noise-like image, 2 threads, 2026-12-03, medians of 40
  interleaved runs) 4 bands per thread against 1: file 11.3 against 11.8 ms, base64 14.6 against 15.1 ms, the image
  phase with the fingerprint on a third thread 19.9 against 22.2 ms (2 and 8 bands per thread: in between). With
  run-length matching the files grew by under 0.5 % (by 4 % for the flat gradient with string matching).

The file decodes, with any PNG reader, to exactly the given pixels (lossless at every level).
"""

from __future__ import annotations

import binascii
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}
"""Channels -> PNG colour type: grey, grey + alpha, RGB, RGBA (8 bits each)."""
FILTER_UP = 2
ZLIB_HEADER = b"\x78\x01"
"""Deflate, 32 KiB window, no preset dictionary ((0x78 << 8 | 0x01) % 31 == 0)."""
EMPTY_STORED_BLOCK = b"\x00\x00\x00\xff\xff"
"""A non-final stored deflate block of no bytes (header bits 000 padded to a byte, LEN 0, NLEN 0xffff): 5 bytes
(2 modulo 3) that change no output, valid at a byte-aligned point of a deflate stream."""
MIN_BAND_BYTES = 256 * 1024
"""Smallest share of the filtered bytes worth a thread of its own."""
BANDS_PER_THREAD = 4
"""Bands per thread (module docstring: why this many)."""
ADLER_BASE = 65521

MAX_THREADS = min(8, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="dicache-png")
    return _pool


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))


def adler32_combine(adler_a: int, adler_b: int, len_b: int) -> int:
    """The Adler-32 of bytes `a + b` from `adler_a = zlib.adler32(a)`, `adler_b = zlib.adler32(b)` and `len(b)`."""
    a1, b1 = adler_a & 0xFFFF, adler_a >> 16
    a2, b2 = adler_b & 0xFFFF, adler_b >> 16
    a = (a1 + a2 - 1) % ADLER_BASE
    b = (b1 + b2 + len_b * (a1 - 1)) % ADLER_BASE
    return b << 16 | a


def _band_chunk(
    band: memoryview, level: int, strategy: int, first: bool, last: bool, to_base64: bool
) -> tuple[bytes | str, int]:
    """One band of filtered rows -> (its IDAT chunk, or that chunk's base64 str when `to_base64`; the band's Adler-32).

    The chunk's data: the zlib header if `first`, 0-2 empty stored blocks, the band's raw deflate ending with a full
    flush (a finish if `last`); its length is a multiple of 3, so the whole chunk's is too.
    """
    compressor = zlib.compressobj(level, zlib.DEFLATED, -15, 8, strategy)  # raw deflate: no header, no checksum
    deflated = compressor.compress(band) + compressor.flush(zlib.Z_FINISH if last else zlib.Z_FULL_FLUSH)
    head = ZLIB_HEADER if first else b""
    head += EMPTY_STORED_BLOCK * ((len(head) + len(deflated)) % 3)  # each block adds 2 modulo 3
    chunk = _chunk(b"IDAT", head + deflated)
    return binascii.b2a_base64(chunk, newline=False).decode("ascii") if to_base64 else chunk, zlib.adler32(band)


def _encode(pixels: np.ndarray, level: int, threads: int | None, run_length: bool, to_base64: bool) -> list:
    """`encode_png`'s file as pieces: bytes whose concatenation is the file, or, when `to_base64`, strs whose
    concatenation is its base64 (every piece but the last the base64 of a multiple of 3 bytes)."""
    pixels = np.asarray(pixels)
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] not in COLOR_TYPES or 0 in pixels.shape:
        raise ValueError(
            f"PNG pixels: got dtype {pixels.dtype}, shape {pixels.shape}; expected uint8 (H, W) or (H, W, C), C in 1..4"
        )
    if not 0 <= level <= 9:
        raise ValueError(f"PNG level={level!r} is invalid: must be 0..9")
    height, width, channels = pixels.shape
    rows = np.ascontiguousarray(pixels).reshape(height, width * channels)
    filtered = np.empty((height, 1 + width * channels), dtype=np.uint8)
    filtered[:, 0] = FILTER_UP
    filtered[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])  # uint8 arithmetic wraps modulo 256, as PNG's does
    flat = memoryview(filtered).cast("B")  # the filtered bytes, not copied

    if threads is None:
        threads = min(MAX_THREADS, max(1, filtered.size // MIN_BAND_BYTES))
    threads = max(1, int(threads))
    bands = min(height, threads if threads == 1 else threads * BANDS_PER_THREAD)
    edges = [filtered.shape[1] * (height * i // bands) for i in range(bands + 1)]
    args = [
        (flat[a:b], level, zlib.Z_RLE if run_length else zlib.Z_DEFAULT_STRATEGY, i == 0, i == bands - 1, to_base64)
        for i, (a, b) in enumerate(zip(edges[:-1], edges[1:]))
    ]
    if bands == 1:
        done = [_band_chunk(*args[0])]
    else:
        done = [future.result() for future in [_threads().submit(_band_chunk, *band) for band in args]]
    adler = done[0][1]
    for (_, band_adler), a, b in zip(done[1:], edges[1:-1], edges[2:]):
        adler = adler32_combine(adler, band_adler, b - a)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, COLOR_TYPES[channels], 0, 0, 0)
    head = PNG_SIGNATURE + _chunk(b"IHDR", ihdr)  # 33 bytes
    tail = _chunk(b"IDAT", struct.pack(">I", adler)) + _chunk(b"IEND", b"")
    pieces = [head, *(chunk for chunk, _ in done), tail]
    if to_base64:
        pieces[0], pieces[-1] = (binascii.b2a_base64(p, newline=False).decode("ascii") for p in (head, tail))
    return pieces


def encode_png(pixels: np.ndarray, level: int = 1, threads: int | None = None, run_length: bool = True) -> bytes:
    """uint8 pixels `(H, W)` or `(H, W, C)` with C in 1..4 -> PNG file bytes (8 bits per channel, not interlaced).

    level: zlib level 0..9. threads: deflates at once (default: up to `MAX_THREADS`, one per 256 KiB of pixels), with
    `BANDS_PER_THREAD` bands each (at most one per row) on a pool of `MAX_THREADS` threads; 1: one band, deflated by
    the calling thread. run_length: zlib's run-length strategy (module docstring),
    else its default string matching. Raises ValueError for other pixels or levels.
    """
    return b"".join(_encode(pixels, level, threads, run_length, to_base64=False))


def encode_png_base64(pixels: np.ndarray, level: int = 1, threads: int | None = None, run_length: bool = True) -> str:
    """`base64.b64encode(encode_png(...)).decode("ascii")` for the same arguments, with the base64 done band by band
    on the deflating threads (module docstring)."""
    return "".join(_encode(pixels, level, threads, run_length, to_base64=True))
