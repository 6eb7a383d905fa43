#!/usr/bin/env bash
# Issue 45 on one H200, in one call (< 9 min, model builds included): the GPU fault tests on the tiny model and on
# full-size Krea-2 with random weights (real out-of-memory errors under a memory cap and injected ones, in each
# phase: 503, memory back within 1 %, the next requests served), then the soak at full size (600 requests, 100 of
# warm-up, concurrency 8: nothing lost, nothing leaked, P99 stable). Results and logs under $OUT:
#   faults_gpu.log, faults_gpu.jsonl (one line per measured case), soak.json, soak.md (the table), soak.log,
#   soak-server.log.
#
#   bash benchmarks/gpu/faults_and_soak.sh
#
# Needs the serve extra (fastapi, uvicorn, pydantic; prometheus_client and httpx are on the machine), carried as
# wheels: `bash benchmarks/gpu/wheels.sh` once per checkout, carry [".whl"].
set -u
OUT=${OUT:-$PWD/out-issue45}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
DICACHE_FAULTS_FULL_SIZE=1 timeout 250 python -m pytest -m gpu tests/test_server_faults_gpu.py -p no:cacheprovider \
  -q -s -rs 2>&1 | tee "$OUT/faults_gpu.log" | grep -v '^W[0-9]' | tail -40
echo "fault tests: $(( $(date +%s) - start )) s"
timeout 280 python benchmarks/bench_soak.py --requests 500 --warmup 100 --concurrency 8 --out "$OUT/soak.json" \
  --results "$OUT/soak.md" --server-log "$OUT/soak-server.log" > "$OUT/soak.log" 2>&1
status=$?
tail -32 "$OUT/soak.log"
echo "soak: exit $status; total $(( $(date +%s) - start )) s"
