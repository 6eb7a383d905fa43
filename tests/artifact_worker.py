"""A fresh process for tests/test_compile_artifact.py: the embedded checkpoint's transformer with its blocks compiled
(on the CPU, or on CUDA with FP8), one forward at one shape, with a compile artifact
(`dicache.models.compile_artifact`).

    python tests/artifact_worker.py STORE OUT.json [--device cuda --quantization fp8 [--weight-store DIR]]
        [--key-field NAME=VALUE]

Loads the artifact of its key from STORE before compiling (one log line whatever happens), runs the forward, saves
the artifact when none was loaded, and writes OUT.json: the load and save outcomes, torch.compile's counters over the
forward (`compile_counters`) and the output's checksum."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from dicache.models.compile_artifact import compile_counters, load_artifact, save_artifact
from dicache.models.krea2.checkpoints import load_transformer
from dicache.models.krea2.pipeline import EMBEDDED_CHECKPOINT, Krea2Pipeline
from dicache.models.krea2.transformer import Krea2Transformer
from dicache.models.loading import default_dtype
from dicache.quantization import parse_quantization


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("out")
    parser.add_argument("--key-field", action="append", default=[])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantization", default=None, help="fp8 (CUDA) or int8")
    parser.add_argument("--weight-store", default=None, help="with --quantization: keep / find the quantised weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    snapshots = {}
    if args.weight_store:  # quantised as read, or read from its snapshot (`weight_snapshot`)
        device = torch.device(args.device)
        spec = parse_quantization(args.quantization)
        transformer = load_transformer(
            EMBEDDED_CHECKPOINT, spec, args.weight_store, dtype=default_dtype(device), device=device, outcomes=snapshots
        )
    else:
        transformer = Krea2Transformer.from_pretrained(EMBEDDED_CHECKPOINT, device=args.device)
    pipe = Krea2Pipeline(transformer)  # the transformer alone: no text encoder to import and load
    if args.quantization and not args.weight_store:
        pipe.quantize(args.quantization)
    transformer.compile_blocks()
    pipe.compile_options = {"blocks": True}
    rows = cols = 4
    shapes = {"tokens": rows * cols, "text": 7}
    key = pipe.compile_key(shapes)
    key = type(key)({**key.fields, **dict(item.split("=", 1) for item in args.key_field)})
    loaded = load_artifact(args.store, key)
    config = transformer.config
    latents = torch.randn(1, rows * cols, config.in_channels).to(args.device)
    text = torch.randn(1, 7, config.num_text_layers, config.text_hidden_dim).to(args.device)
    positions = torch.cat([torch.zeros(7, 3), pipe.position_ids(rows, cols, "cpu")]).to(args.device)
    before = compile_counters()
    start = time.perf_counter()
    with torch.no_grad():
        out = transformer(latents, text, torch.tensor([0.5], device=args.device), positions)
    seconds = time.perf_counter() - start
    after = compile_counters()
    saved = save_artifact(args.store, key) if loaded.status != "loaded" else None
    record = {
        "loaded": loaded.to_dict(),
        "weight_snapshots": snapshots,
        "saved": saved.to_dict() if saved is not None else None,
        "counters": {name: after[name] - before[name] for name in after},
        "forward_s": round(seconds, 2),
        "checksum": float(out.double().abs().sum()),
    }
    with open(args.out, "w") as fh:
        json.dump(record, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
