"""Settings exploration on the embedded checkpoint's training prompts (never the held-out ones): mean PSNR against
the uncached run for configs given as overrides of the recommended family at a budget.

    python experiments/explore_forecasters.py STEPS FRACTION "name={'scm_curve': 3.0}" "name2={...}" ...

Prints one JSON line per config (mean and worst PSNR over the first 3 `split: train` prompts, compute, seconds).
"""

import ast
import json
import sys
import time

import torch

from dicache import CacheConfig
from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.checkpoints import heldout_prompts_file, resolve_model
from dicache.sweep.metrics import psnr
from dicache.sweep.prompts import read_prompts
from dicache.sweep.settings import recommended
from dicache.tuning import PipelineRunner

torch.set_num_threads(1)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 28
frac = float(sys.argv[2]) if len(sys.argv) > 2 else 0.3
pipe = Krea2Pipeline.from_pretrained(resolve_model(None, None), device="cpu")
prompts = read_prompts(heldout_prompts_file(None), split="train")[:3]
runner = PipelineRunner(pipe, steps, 4.5, "raw", 128, 128)
refs = [runner.run(p, s or 0, None) for p, s in prompts]
rec = recommended(frac)

configs = {}
for item in sys.argv[3:]:
    name, _, extra = item.partition("=")
    configs[name] = {**rec, **ast.literal_eval(extra)}
for name, o in configs.items():
    t = time.perf_counter()
    cfg = CacheConfig.defaults().merged({**o, "enable_cache": True})
    vals, comp = [], []
    for (p, s), ref in zip(prompts, refs):
        m = runner.run(p, s or 0, cfg)
        vals.append(psnr(m.image, ref.image)[0])
        comp.append(m.blocks_run / ref.blocks_total)
    print(
        json.dumps(
            {
                "name": name,
                "psnr": round(sum(vals) / len(vals), 2),
                "min": round(min(vals), 2),
                "compute": round(sum(comp) / len(comp), 3),
                "s": round(time.perf_counter() - t, 1),
            }
        ),
        flush=True,
    )
