"""`dicache.server.png`: the PNG files `dicache serve` answers with decode, with Pillow, to exactly the pixels given."""

from __future__ import annotations

import base64
import hashlib
import io
import random
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from dicache.server.backend import encode_pixels, image_answers, quantize_pixels
from dicache.server.png import BANDS_PER_THREAD, adler32_combine, encode_png, encode_png_base64


def _decode(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    image.load()
    return np.asarray(image)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """The file's chunks as (type, data), after checking the signature and each chunk's length and CRC."""
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    chunks, at = [], 8
    while at < len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        assert int.from_bytes(data[at + 8 + length : at + 12 + length], "big") == zlib.crc32(kind + body)
        chunks.append((kind, body))
        at += 12 + length
    assert at == len(data)
    return chunks


def _filtered(pixels: np.ndarray) -> bytes:
    """The PNG's filtered rows: filter byte 2 (Up), then the row minus the row above (zeros above the first)."""
    rows = pixels.reshape(pixels.shape[0], -1)
    return b"".join(
        bytes([2]) + (row - prev).tobytes() for prev, row in zip([np.zeros_like(rows[0])] + list(rows[:-1]), rows)
    )


@pytest.mark.parametrize("shape", [(64, 48, 3), (5, 7), (9, 3, 1), (17, 33, 2), (40, 40, 4), (1, 1, 3), (300, 2, 3)])
@pytest.mark.parametrize("threads", [1, 2, 3, None])
def test_png_decodes_to_the_same_pixels(shape, threads):
    pixels = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    for level in (0, 1, 9):
        for run_length in (True, False):
            data = encode_png(pixels, level, threads, run_length)
            got = _decode(data)
            assert got.dtype == np.uint8 and np.array_equal(got.reshape(pixels.shape), pixels)
            assert base64.b64decode(encode_png_base64(pixels, level, threads, run_length)) == data


def test_png_bands_join_into_one_valid_zlib_stream_and_smooth_images_shrink():
    y, x = np.mgrid[0:256, 0:256]
    smooth = np.stack([x, y, (x + y) // 2], axis=-1).astype(np.uint8)
    data = encode_png(smooth, 1, threads=4)
    chunks = _chunks(data)
    assert [kind for kind, _ in chunks[:1] + chunks[-1:]] == [b"IHDR", b"IEND"]
    stream = b"".join(body for kind, body in chunks if kind == b"IDAT")
    assert zlib.decompress(stream) == _filtered(smooth)  # zlib checks the Adler-32 too
    assert len(data) < smooth.nbytes / 3
    assert len(encode_png(smooth, 1, threads=4, run_length=False)) < smooth.nbytes / 10  # string matching
    assert np.array_equal(_decode(encode_pixels(smooth, "png")), smooth)


@pytest.mark.parametrize("shape", [(64, 48, 3), (33, 5, 1), (40, 40, 4), (300, 2, 3), (7, 1, 2)])
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_png_band_chunks_are_multiples_of_3_bytes_and_base64_matches_the_file(shape, threads):
    pixels = np.random.default_rng(sum(shape) + threads).integers(0, 256, shape, dtype=np.uint8)
    for level in (0, 1, 6):
        data = encode_png(pixels, level, threads)
        chunks = _chunks(data)
        kinds = [kind for kind, _ in chunks]
        bands = kinds.count(b"IDAT") - 1
        assert kinds == [b"IHDR"] + [b"IDAT"] * (bands + 1) + [b"IEND"]
        assert bands == min(shape[0], BANDS_PER_THREAD * threads) and bands > 1
        assert all(len(body) % 3 == 0 for _, body in chunks[1:-2])  # + 12 bytes of length, type and CRC
        assert chunks[1][1].startswith(b"\x78\x01") and len(chunks[-2][1]) == 4  # zlib header, then Adler-32
        stream = b"".join(body for _, body in chunks[1:-1])
        assert zlib.decompress(stream) == _filtered(pixels)
        assert chunks[-2][1] == zlib.adler32(_filtered(pixels)).to_bytes(4, "big")
        assert encode_png_base64(pixels, level, threads) == base64.b64encode(data).decode("ascii")
        assert np.array_equal(_decode(data).reshape(pixels.shape), pixels)


@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 5, 4), (1, 2000), (2, 3, 1)])
@pytest.mark.parametrize("threads", [1, 4, None])
def test_png_of_one_row_or_one_band(shape, threads):
    pixels = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    data = encode_png(pixels, 1, threads)
    kinds = [kind for kind, _ in _chunks(data)]
    bands = 1 if threads in (1, None) else shape[0]
    assert kinds == [b"IHDR"] + [b"IDAT"] * (bands + 1) + [b"IEND"]
    assert encode_png_base64(pixels, 1, threads) == base64.b64encode(data).decode("ascii")
    assert np.array_equal(_decode(data).reshape(pixels.shape), pixels)


def test_adler32_combine_matches_zlib_on_random_splits():
    rng = random.Random(0)
    data = rng.randbytes(300_000) + bytes(70_000) + b"\xff" * 50_000  # sums past the modulus, runs of 0 and 255
    for _ in range(200):
        cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randrange(1, 6)))
        cuts = [0, *cuts, len(data)] + ([len(data)] if rng.random() < 0.3 else [])  # empty parts too
        start = rng.randrange(len(data) + 1)
        parts = [data[a:b] for a, b in zip(cuts[:-1], cuts[1:])] + [b"", data[start:]]
        adler = zlib.adler32(b"")
        for part in parts:
            adler = adler32_combine(adler, zlib.adler32(part), len(part))
        assert adler == zlib.adler32(b"".join(parts))
    assert adler32_combine(zlib.adler32(b"abc"), zlib.adler32(b""), 0) == zlib.adler32(b"abc")
    assert adler32_combine(zlib.adler32(b""), zlib.adler32(b"abc"), 3) == zlib.adler32(b"abc")


def test_png_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match=r"got dtype float32, shape \(4, 4, 3\); expected uint8"):
        encode_png(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"shape \(4, 4, 5\)"):
        encode_png(np.zeros((4, 4, 5), np.uint8))
    with pytest.raises(ValueError, match="level=10 is invalid: must be 0..9"):
        encode_png(np.zeros((4, 4, 3), np.uint8), level=10)
    with pytest.raises(ValueError, match=r"shape \(0, 4, 3\)"):
        encode_png_base64(np.zeros((0, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="level=-1 is invalid"):
        encode_png_base64(np.zeros((4, 4, 3), np.uint8), level=-1)


def test_image_answers_give_each_image_file_and_its_float_fingerprint():
    floats = np.random.default_rng(1).random((2, 16, 24, 3), dtype=np.float32)
    pixels = quantize_pixels(floats)
    with ThreadPoolExecutor(1) as digests:
        files, fingerprints = image_answers(floats, pixels, "png", 100, digests)
    assert fingerprints == [hashlib.sha256(image.tobytes()).hexdigest() for image in floats]
    assert fingerprints[0] != fingerprints[1]
    for file, image in zip(files, pixels):
        assert np.array_equal(_decode(base64.b64decode(file)), image)


@pytest.mark.parametrize("output_format", ["png", "jpeg", "webp"])
def test_image_answers_files_are_the_base64_of_encode_pixels(output_format):
    rng = np.random.default_rng(2)
    floats = np.concatenate([rng.random((1, 512, 512, 3), dtype=np.float32), np.zeros((1, 512, 512, 3), np.float32)])
    pixels = quantize_pixels(floats)
    with ThreadPoolExecutor(1) as digests:
        files, _ = image_answers(floats, pixels, output_format, 90, digests)
    assert files == [base64.b64encode(encode_pixels(image, output_format, 90)).decode("ascii") for image in pixels]
    with ThreadPoolExecutor(1) as digests, pytest.raises(ValueError, match="output_format='gif' is invalid"):
        image_answers(floats, pixels, "gif", 90, digests)
