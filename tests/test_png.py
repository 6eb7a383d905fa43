"""`dicache.server.png`: the PNG files `dicache serve` answers with decode, with Pillow, to exactly the pixels given."""

from __future__ import annotations

import base64
import hashlib
import io
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from dicache.server.backend import encode_pixels, image_answers, quantize_pixels
from dicache.server.png import encode_png


def _decode(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    image.load()
    return np.asarray(image)


@pytest.mark.parametrize("shape", [(64, 48, 3), (5, 7), (9, 3, 1), (17, 33, 2), (40, 40, 4), (1, 1, 3), (300, 2, 3)])
@pytest.mark.parametrize("threads", [1, 3, None])
def test_png_decodes_to_the_same_pixels(shape, threads):
    pixels = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    for level in (0, 1, 9):
        got = _decode(encode_png(pixels, level, threads))
        assert got.dtype == np.uint8 and np.array_equal(got.reshape(pixels.shape), pixels)


def test_png_bands_join_into_one_valid_zlib_stream_and_smooth_images_shrink():
    y, x = np.mgrid[0:256, 0:256]
    smooth = np.stack([x, y, (x + y) // 2], axis=-1).astype(np.uint8)
    data = encode_png(smooth, 1, threads=4)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    length = int.from_bytes(data[33:37], "big")  # the IDAT chunk follows the signature (8) and IHDR (25)
    assert data[37:41] == b"IDAT"
    assert (
        zlib.decompress(data[41 : 41 + length])
        == b"".join(  # filter byte 2 (Up) then the row differences
            bytes([2]) + (row - prev).tobytes()
            for prev, row in zip([np.zeros_like(smooth[0])] + list(smooth[:-1]), smooth)
        )
    )
    assert len(data) < smooth.nbytes / 3
    assert len(encode_png(smooth, 1, threads=4, run_length=False)) < smooth.nbytes / 10  # string matching
    assert np.array_equal(_decode(encode_pixels(smooth, "png")), smooth)


def test_png_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match=r"got dtype float32, shape \(4, 4, 3\); expected uint8"):
        encode_png(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"shape \(4, 4, 5\)"):
        encode_png(np.zeros((4, 4, 5), np.uint8))
    with pytest.raises(ValueError, match="level=10 is invalid: must be 0..9"):
        encode_png(np.zeros((4, 4, 3), np.uint8), level=10)


def test_image_answers_give_each_image_file_and_its_float_fingerprint():
    floats = np.random.default_rng(1).random((2, 16, 24, 3), dtype=np.float32)
    pixels = quantize_pixels(floats)
    with ThreadPoolExecutor(1) as digests:
        files, fingerprints = image_answers(floats, pixels, "png", 100, digests)
    assert fingerprints == [hashlib.sha256(image.tobytes()).hexdigest() for image in floats]
    assert fingerprints[0] != fingerprints[1]
    for file, image in zip(files, pixels):
        assert np.array_equal(_decode(base64.b64decode(file)), image)
