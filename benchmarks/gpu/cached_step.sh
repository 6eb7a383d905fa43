#!/usr/bin/env bash
# Issue 43 on one H200: the cached-step methods (docs/cached-step.md) under compile, in wall time, in FP8 and through
# `dicache serve`. Each step fits one device call (< 9 min on a fresh machine), publishing its tables
# (benchmarks/publish.py) to $OUT/RESULTS.md (a run log line there, its file under $OUT/results/archive/) and its
# JSON, the calibrated profile and one log, cached_step.log, under $OUT (at most 6 files for each suggested call below:
# 8 come back).
#
#   bash benchmarks/gpu/cached_step.sh STEP [STEP ...]
#   # STEP: wheels | tests | speed | fidelity | serve
#   CPU=1 bash benchmarks/gpu/cached_step.sh tests speed fidelity serve   # the logic check on a CPU (minutes)
#
# Wheels (carry [".whl"]): `bash benchmarks/gpu/wheels.sh` once per checkout makes them. Every step needs pydantic
# and pydantic-settings (dicache's settings); FP8 needs torchao (speed, fidelity, serve); the sweep pytorch-msssim
# (fidelity); the server fastapi, starlette, uvicorn and their dependencies (serve).
#
#   tests     pytest -m gpu tests/test_cached_step_gpu.py: every cached-step method (forecast, tokens 0.1 / 0.2,
#             fitted) under torch.compile on the embedded Turbo student compiles nothing after its warm-up, and
#             matches eager                                                                          (~2 min)
#   speed     bench_krea2_speed --mode compiled --sections cachedstep on the full-size Krea-2 (random weights,
#             1024²), FP8 then bf16 ($SPEED_QUANTIZATIONS, default "fp8 none"): the wall time of one cached call
#             under `forecast`, `fitted` (no forward: one small matmul) and `tokens` 0.1 / 0.2 against a full
#             forward, with the FLOP share and the graphs compiled after the warm-up                (~4 min each)
#   fidelity  1) `dicache calibrate --variant turbo --quantization fp8` on the 6 training captions
#             (benchmarks/grids/turbo_calibration_prompts.json, 32 other seeds for the fits; the mask 0,1,3,6
#             scored first: `--fit-masks`, which the beam search does not reach), target 35 dB
#             ($CRITERION, default mean: the issue's target is a mean, its worst prompt reported), against the bf16
#             uncached run: the profile and its predictor go to $CALIBRATED (default
#             /var/tmp/dicache-cached-step/turbo-fp8.json) and $OUT/calibrated/; 2) sweep_substep.py on
#             sweep_turbo_substep_fp8.yaml with --profile that profile: the embedded Turbo student, 128 px, 8 steps,
#             16 held-out prompts, PSNR against bf16 uncached, bf16 and FP8 side by side for today's masks
#             (input_corrected) and the fitted predictor on the frontier masks, FP8 uncached, and the calibrated
#             profile; its results.json as $OUT/sweep_results.json                                    (~4 min)
#   serve     bench_serving.py, the fp8-te server (`dicache serve --compile --quantization fp8
#             --text-encoder-quantization fp8`, full-size random weights, `--load-format dummy`), Turbo at
#             concurrency 1 (5 requests) and 20 (20 requests): today's recommended setting, the calibrated profile
#             ($CALIBRATED when that file exists) and timing stand-ins of the fitted predictor on the masks
#             $FITTED_MASKS (default "0,1,3,6 0,1,2,4,6"; empty: none; the committed profile is 0,1,3,6). The
#             predictor is per channel (64 latent channels, as full-size Krea-2), so the student's fit loads on the
#             full-size model: there the time is what counts, the quality is the fidelity step's. Target:
#             <= 0.6 s at concurrency 1. A fresh machine's server was ready after 371 s on 2026-12-04, before issue
#             41's start-up work (97.5 s with a real checkpoint on 2026-12-05, docs/startup.md); the timed runs
#             start once its prompt lengths, met in the background after ready, are all met (about 22 s more:
#             bench_serving's `wait_steady`)                                                             (~8 min)
#
# Suggested calls (a machine is given back 30 s after a call, so each call starts a fresh one, a minute or two
# each; ~22 min of commands, ~26 min in all):
#   1) `bash benchmarks/gpu/cached_step.sh wheels fidelity tests`                                     (~6 min)
#   2) `CALIBRATED=.calibrated/turbo-fp8.json bash benchmarks/gpu/cached_step.sh wheels serve`, carry
#      [".whl", ".calibrated"] (or CALIBRATED=benchmarks/results/profiles/turbo-fp8.json: the H100 call 1 of
#      2026-12-05, committed): first copy call 1's $OUT/calibrated/ (the profile and its predictor folder) to
#      .calibrated/ in the checkout (`echo /.calibrated/ >> .git/info/exclude`); without it the stand-ins still run
#                                                                                                      (~8 min)
#   3) `bash benchmarks/gpu/cached_step.sh wheels speed`                                              (~8 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu/cached_step.sh STEP ... (see the header)" >&2; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT=${OUT:-/tmp/cached-step-out}  # the benchmarks write their JSON and server logs there too
out=$OUT
mkdir -p "$out"
results=$out/RESULTS.md
work=${WORK:-/var/tmp/dicache-cached-step}  # the sweep's folder and the profile: outside $OUT (8 files come back)
cpu=${CPU:-}
if [ -n "$cpu" ]; then  # the logic check: the tiny model, FP8 emulated (FP8 GEMMs need the GPU), small runs
  quantization=fp8-emulated speed_quantization=int8 device=cpu  # speed: INT8 runs for real on the CPU
else
  quantization=fp8 speed_quantization=fp8 device=cuda
fi
calibrated=${CALIBRATED:-$work/turbo-$quantization.json}
criterion=${CRITERION:-mean}

wheels() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  python3 -c "import torch, pydantic_settings; print('torch', torch.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" || echo "no torchao: FP8 steps fail (speed, fidelity, serve)"
  python3 -c "import pytorch_msssim" || echo "no pytorch_msssim: the fidelity step's sweep fails"
  python3 -c "import fastapi, uvicorn" || echo "no fastapi / uvicorn: the serve step fails"
  if [ -z "$cpu" ]; then nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv; fi
}

tests() {
  timeout 180 python3 -m pytest -m gpu tests/test_cached_step_gpu.py -p no:cacheprovider -q -rs
}

speed() {
  local q status=0
  for q in ${SPEED_QUANTIZATIONS:-$speed_quantization none}; do  # FP8 first: the served model, the longer cold compile
    if [ -n "$cpu" ]; then
      timeout 300 python3 benchmarks/bench_krea2_speed.py --tiny --device cpu --mode eager --sections cachedstep \
        --no-diffusers --quantization "$q" --results "$results" --out "$out/speed_$q.json" || status=$?
    else
      timeout "$([ "$q" = none ] && echo 240 || echo 290)" python3 benchmarks/bench_krea2_speed.py --mode compiled \
        --sections cachedstep --no-diffusers --quantization "$q" --results "$results" --out "$out/speed_$q.json" \
        || status=$?
    fi
  done
  return $status
}

fidelity() {
  local status=0 small=() profile=()
  [ -n "$cpu" ] && small=(--size 32 --fit-seeds 1 --prompts 1 --prompt-split train --threads 1)
  mkdir -p "$work"
  rm -rf "$calibrated" "${calibrated%.json}.predictors"
  # exit 2: no candidate met the target (the table says how close each came); the sweep then runs without it
  timeout 300 python3 -m dicache.cli calibrate --variant turbo --quantization "$quantization" --device "$device" \
    --dtype "$([ -n "$cpu" ] && echo float32 || echo bfloat16)" --prompts benchmarks/grids/turbo_calibration_prompts.json \
    --target-psnr 35 --criterion "$criterion" --fit-seeds 32 --fit-masks 0,1,3,6 --no-progress --out "$calibrated" \
    "${small[@]}" || status=$?
  if [ -f "$calibrated" ]; then
    profile=(--profile "$calibrated")
    mkdir -p "$out/calibrated"
    cp -r "$calibrated" "$out/calibrated/"
    [ -d "${calibrated%.json}.predictors" ] && cp -r "${calibrated%.json}.predictors" "$out/calibrated/"
  fi
  [ -n "$cpu" ] && small=(--num-prompts 1 --height 32 --width 32 --threads 1 --quantization none fp8-emulated)
  timeout 200 python3 benchmarks/sweep_substep.py --grid benchmarks/grids/sweep_turbo_substep_fp8.yaml \
    --dtype bfloat16 --device "$device" --no-progress --out "$work/sweep" "${profile[@]}" "${small[@]}" \
    --results "$results" || status=$?
  [ -f "$work/sweep/results.json" ] && cp "$work/sweep/results.json" "$out/sweep_results.json"
  return $status
}

serve() {
  local profile=() masks=() mask small=()
  if [ -f "$calibrated" ]; then
    profile=(--profile "$calibrated")
  else
    echo "no calibrated profile at $calibrated (run fidelity first, or set CALIBRATED): the stand-ins run alone"
  fi
  for mask in ${FITTED_MASKS-0,1,3,6 0,1,2,4,6}; do masks+=(--fitted-mask "$mask"); done  # FITTED_MASKS= : none
  if [ -n "$cpu" ]; then
    small=(--tiny --device cpu --servers none --no-compile --requests-c1 1 --requests-c20 0 --start-timeout 300)
  else
    small=(--servers fp8-te --requests-c1 5 --requests-c20 20 --start-timeout 420)
  fi
  timeout 530 python3 benchmarks/bench_serving.py --variants turbo --caches recommended "${profile[@]}" \
    "${masks[@]}" "${small[@]}" --results "$results"
}

for step in "$@"; do
  case "$step" in wheels | tests | speed | fidelity | serve) ;; *) echo "unknown step: $step" >&2; exit 2 ;; esac
done
status=0
for step in "$@"; do
  echo "== $step ($(date -u +%H:%M:%S))" | tee -a "$out/cached_step.log"
  "$step" 2>&1 | tee -a "$out/cached_step.log" || { status=$?; echo "== $step failed: $status" | tee -a "$out/cached_step.log"; }
done
exit $status
