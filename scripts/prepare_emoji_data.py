"""Build the training data of the embedded Krea-2-architecture checkpoint from npm's `emoji-datasource-twitter`.

Fetches the pinned package with `npm pack` (Twemoji graphics, CC-BY 4.0, https://github.com/twitter/twemoji),
reads its 64 px PNGs and `emoji.json`, composites each RGBA image on white and writes one compressed npz:

- ``images``: uint8 (N, 64, 64, 3). Kept at 64 px to stay small; the training script upsamples them to 128 px
  (bicubic, ``torch.nn.functional.interpolate(..., scale_factor=2, mode="bicubic", align_corners=False)``).
- ``captions``: the cleaned name — lowercase ASCII words (accents stripped, anything else turned into spaces);
  skin-tone variants append the tone names, e.g. ``"thumbs up sign medium dark skin tone"``.
- ``short_names``: the emoji's short names, cleaned the same way and joined with ``"|"`` (not used for training).
- ``files``: the PNG file names; ``package``/``version``/``license``: provenance.

The output is byte-for-byte deterministic: entries keep the order of ``emoji.json`` (skin variants after their
base emoji, in sorted key order) and the zip members carry a fixed timestamp.

Usage: ``python scripts/prepare_emoji_data.py [--out data/emoji64.npz] [--package-dir DIR]``
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import tarfile
import tempfile
import unicodedata
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

PACKAGE = "emoji-datasource-twitter"
VERSION = "16.0.0"
LICENSE = "Twemoji graphics (c) Twitter/X and contributors, CC-BY 4.0; emoji data (c) iamcal, MIT"
SKIN_TONES = {
    "1F3FB": "light skin tone",
    "1F3FC": "medium light skin tone",
    "1F3FD": "medium skin tone",
    "1F3FE": "medium dark skin tone",
    "1F3FF": "dark skin tone",
}


def clean_caption(text: str) -> str:
    """Lowercase ASCII words only: ``"Côte d’Ivoire Flag"`` → ``"cote d ivoire flag"``."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return " ".join(re.findall(r"[a-z0-9]+", text))


def tone_caption(key: str) -> str:
    """``"1F3FB-1F3FF"`` → ``"light skin tone dark skin tone"``; a repeated tone is named once."""
    parts = list(dict.fromkeys(key.split("-")))
    return " ".join(SKIN_TONES[p] for p in parts)


def fetch_package(dest: Path) -> Path:
    """``npm pack`` the pinned version into ``dest`` and unpack it; returns the package root."""
    subprocess.run(
        ["npm", "pack", f"{PACKAGE}@{VERSION}", "--silent", "--pack-destination", str(dest)],
        check=True,
        capture_output=True,
    )
    tgz = dest / f"{PACKAGE}-{VERSION}.tgz"
    with tarfile.open(tgz) as tar:
        keep = {"package/emoji.json", "package/package.json", "package/LICENSE"}
        members = [m for m in tar.getmembers() if m.name in keep or m.name.startswith("package/img/twitter/64/")]
        tar.extractall(dest, members=members, filter="data")
    return dest / "package"


def composite_on_white(png: bytes | Path) -> np.ndarray:
    """RGBA PNG → uint8 (64, 64, 3) RGB over a white background."""
    src = Image.open(io.BytesIO(png) if isinstance(png, bytes) else png).convert("RGBA")
    if src.size != (64, 64):
        raise ValueError(f"expected a 64x64 PNG, got {src.size}")
    white = Image.new("RGBA", src.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, src).convert("RGB"), dtype=np.uint8)


def collect(package_dir: Path) -> tuple[np.ndarray, list[str], list[str], list[str]]:
    """All Twemoji images with their captions, in ``emoji.json`` order."""
    entries = json.loads((package_dir / "emoji.json").read_text(encoding="utf-8"))
    img_dir = package_dir / "img" / "twitter" / "64"
    images, captions, short_names, files = [], [], [], []

    def add(image_file: str, caption: str, names: list[str]) -> None:
        images.append(composite_on_white(img_dir / image_file))
        captions.append(caption)
        short_names.append("|".join(clean_caption(n.replace("_", " ")) for n in names))
        files.append(image_file)

    for e in entries:
        base = clean_caption(e.get("name") or e["short_name"].replace("_", " "))
        names = e.get("short_names") or [e["short_name"]]
        if e.get("has_img_twitter"):
            add(e["image"], base, names)
        for key, var in sorted((e.get("skin_variations") or {}).items()):
            if var.get("has_img_twitter"):
                add(var["image"], f"{base} {tone_caption(key)}", names)
    return np.stack(images), captions, short_names, files


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like ``np.savez_compressed`` but byte-for-byte reproducible (fixed member timestamps and order)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, buf.getvalue(), compresslevel=9)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/emoji64.npz")
    ap.add_argument("--package-dir", default=None, help="an already unpacked package (skips npm)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(args.package_dir) if args.package_dir else fetch_package(Path(tmp))
        version = (
            json.loads((pkg / "package.json").read_text())["version"] if (pkg / "package.json").exists() else VERSION
        )
        images, captions, short_names, files = collect(pkg)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_npz(
        out,
        {
            "images": images,
            "captions": np.array(captions),
            "short_names": np.array(short_names),
            "files": np.array(files),
            "package": np.array(PACKAGE),
            "version": np.array(version),
            "license": np.array(LICENSE),
        },
    )
    size_mb = out.stat().st_size / 2**20
    print(f"wrote {out}: {len(captions)} images {images.shape[1:]} from {PACKAGE}@{version}, {size_mb:.1f} MiB")


if __name__ == "__main__":
    main()
