#!/usr/bin/env bash
# The fast path on one H200 (`--compile --quantization fp8`, the text encoder in FP8, `dicache serve`): speed, memory
# and fidelity measured with the product's flags, each step one device call (< 10 min), each publishing its tables
# (benchmarks/publish.py) to $OUT/RESULTS.md: a run log line there and its file under $OUT/results/archive/. Copy
# those files into benchmarks/results/archive/ and append the lines to benchmarks/RESULTS.md's run log.
#
#   bash benchmarks/gpu/fast_path.sh STEP [STEP ...]
#   # STEP: wheels | check | host | textenc | fp8 | int8 | joins | attention | speed | speedint8 | length | serve | serveint8 | workers | fresh | alloc | all
#
# The machine has torch 2.11 but not torchao, fastapi, uvicorn, pydantic(-settings): carry them as wheels in .whl,
# made here by `bash benchmarks/gpu/wheels.sh` (once per checkout; about 6.6 MB, within the 64 MiB a call carries),
# and run the steps in few calls with carry [".whl"]. Steps and what each measures (the targets were issue 27's):
#   check    the GPU tests: FP8 and INT8 linears, the server's phases on CUDA streams of their own giving the bytes of
#            the pipeline call, alone and with requests in flight, prompt lengths prepared on the denoise thread, the
#            text path's shape-free attention, the compiled VAE decoder, the text encoder replayed from CUDA graphs
#            (pytest -m gpu; alone in a call: the FP8 tests compile with inductor)                        (~7 min)
#   host     bench_server_cpu on the GPU host's CPU: the PNG writer, the image phase part by part (which of the
#            fingerprint, the PNG file and base64 bounds it) and the answer's JSON                       (~1 min)
#   textenc  bench_text_encoder: the full-size text encoder's encode time (eager and from CUDA graphs), weight bytes,
#            activation peak and graph pool in bf16, with FP8 weight storage (--text-encoder-quantization fp8)
#            and FP8 GEMMs (fp8-dynamic), and each method's top kernels (--profile)                       (~2 min)
#   fp8      bench_fp8 fidelity (>= 35 dB mean, worst prompt reported) and block time of the FP8 default (attention
#            projections bf16), of all-FP8, and of q in FP8 too (attn_kv,attn_out kept bf16: the choice the CPU
#            emulation puts at about 35 dB on Raw 28), with the block output's error against bf16 (fast accumulation)
#                                                                                                       (~5 min)
#   int8     bench_fp8 fidelity of the FP8 default against INT8 on every block linear (--quantization int8), and the
#            block time of bf16, FP8 (default, all), INT8 (all; cuBLAS GEMM + rescale, and fused in one Triton kernel)
#                                                                                                       (~5 min)
#   joins    experiments/probe_fp8_block_compile: one FP8 block with its projections apart, joined (the default), and joined but
#            for one group each (gate|up, k|v, q|gate): what each join brings. Each variant compiles cold in about
#            70 s on a fresh machine                                                                     (~8 min)
#   attention  experiments/probe_fp8_attention: 8-bit attention (experiments/fp8_attention_kernel.py, Triton) against bf16 SDPA on a
#            full-size block's shapes, per scheme and kernel configuration: ms, SNR, agreement with the reference
#                                                                                                       (~2 min)
#   speedint8  bench_krea2_speed compiled with --quantization int8: one forward and Turbo / Raw, SGLang's pattern
#                                                                                                       (~3 min)
#   length   experiments/probe_prompt_length: a new prompt length's first-call cost, per part of a request, in the warmed-up
#            backend of `dicache serve` (FP8, text encoder FP8)                                         (~2 min)
#   serveint8  bench_serving with the int8-te server: Turbo c1 / c20, SGLang's pattern and the recommended setting
#                                                                                                       (~4 min)
#   speed    bench_krea2_speed compiled: one forward (<= 0.125 s) and Turbo / Raw under SGLang's default pattern
#            (Turbo denoise <= 0.65 s), for each exclusion choice in $SPEED_EXCLUDES (';'-separated
#            --quantization-exclude values, `default` for none given; default: "attn_kv attn_out;default") (~3 min each);
#            $SPEED_SECTIONS (default forward,sglang) adds e.g. `gaps`: the GPU timeline and the host's waits
#   serve    bench_serving, FP8 servers with 2 workers (the default), with the text encoder in FP8 (fp8-te: memory)
#            and in bf16 (fp8: its eager FP8 linears cost about 0.2 s per encode): Turbo concurrency 1 (<= 0.75 s)
#            and 20 (>= 1.35 req/s) with SGLang's default pattern, the recommended Turbo setting (the moonshot,
#            <= 0.6 s at concurrency 1), same-seed bytes across concurrency, peak memory (<= 28 GB) with its
#            breakdown, where each request's time goes; $SERVER_ARGS are added to the servers' flags   (~7 min)
#   workers  the fp8-te server with 2 workers (the default) and with --workers 1 side by side, Turbo concurrency 1 and
#            20, SGLang's default pattern and the recommended setting (2 workers no slower alone)      (~6 min)
#   fresh    the fp8-te server, every request a prompt length it has not met (--fresh-prompts): against `serve`'s
#            fp8-te rows (the five prompts, each met once untimed before the runs), what a new length costs (~4 min)
#   alloc    the fp8 server (text encoder bf16) with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: whether the
#            allocator's slack (peak reserved - peak allocated, 4.5 GB on 2026-12-03) shrinks enough for 28 GB
#            without the text encoder in FP8                                                          (~3 min)
#
# A server on a fresh machine (empty inductor cache) takes 7-8 min to become ready (warm-up 391 s on 2026-12-03 17:03:
# the VAE's compile and the text encoder's CUDA-graph capture included), about 2.5 min once the cache is warm: the
# servers wait up to 420 s (`fresh`: 510 s, it is meant to run first and alone on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu/fast_path.sh STEP ... (see the header)" >&2; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
results=${OUT:-/tmp}/RESULTS.md  # a run log of the new runs, their files in results/archive/ beside it, written as
# each benchmark ends: a call cut short keeps what it finished

wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python3 -c "import torch, torchao, fastapi, uvicorn, pydantic_settings; print(torch.__version__, torchao.__version__)"
  nvidia-smi --query-gpu=name,memory.used,power.limit --format=csv
}

check() {
  timeout 560 python3 -m pytest -m gpu tests/test_fp8_gpu.py tests/test_server_stages.py tests/test_prompt_lengths.py \
    tests/test_compile_gpu.py tests/test_text_graphs_gpu.py tests/test_fp8_attention_gpu.py tests/test_host_syncs_gpu.py \
    -p no:cacheprovider
}

host() {
  timeout 120 python3 benchmarks/bench_server_cpu.py --sections png,image,json --reps 10 --results "$results"
}

textenc() {
  timeout 200 python3 benchmarks/bench_text_encoder.py --profile --results "$results"
}

fp8() {
  timeout 330 python3 benchmarks/bench_fp8.py --sections fidelity,block --compare default none attn_kv,attn_out \
    --results "$results"
}

int8() {
  timeout 340 python3 benchmarks/bench_fp8.py --sections fidelity,block --compare default int8:default \
    --results "$results"
}

speedint8() {
  timeout 240 python3 benchmarks/bench_krea2_speed.py --mode compiled --sections forward,sglang --no-diffusers \
    --quantization int8 --results "$results" --out "${OUT:-/tmp}/speed_int8.json"
}

length() {
  timeout 300 python3 experiments/probe_prompt_length.py --lengths 6,17,28 --quantization fp8 --text-encoder-fp8 --results "$results"
}

serveint8() {
  timeout 560 python3 benchmarks/bench_serving.py --servers int8-te --variants turbo --caches sglang recommended \
    --requests-c1 5 --requests-c20 20 --start-timeout 420 ${SERVER_ARGS:+"--server-args=$SERVER_ARGS"} \
    --results "$results"
}

attention() {
  timeout 300 python3 experiments/probe_fp8_attention.py --results "$results"
}
joins() {
  timeout 560 python3 experiments/probe_fp8_block_compile.py --results "$results"
}
speed() {
  local choice i=0
  IFS=';' read -ra choices <<<"${SPEED_EXCLUDES:-attn_kv attn_out;default}"
  for choice in "${choices[@]}"; do
    i=$((i + 1))
    local exclude=()
    [ "$choice" = default ] || read -ra exclude <<<"$choice"
    timeout 300 python3 benchmarks/bench_krea2_speed.py --mode compiled --sections "${SPEED_SECTIONS:-forward,sglang}" --no-diffusers \
      --quantization fp8 ${exclude[@]:+--quantization-exclude "${exclude[@]}"} --results "$results" \
      --out "${OUT:-/tmp}/speed_$i.json"
  done
}

serve() {
  timeout 560 python3 benchmarks/bench_serving.py --servers fp8-te fp8 --variants turbo --caches sglang recommended \
    --requests-c1 5 --requests-c20 20 --start-timeout 420 ${SERVER_ARGS:+"--server-args=$SERVER_ARGS"} \
    --results "$results"
}

workers() {
  timeout 560 python3 benchmarks/bench_serving.py --servers fp8-te fp8-te-w1 --variants turbo \
    --caches sglang recommended --requests-c1 5 --requests-c20 20 --start-timeout 420 \
    ${SERVER_ARGS:+"--server-args=$SERVER_ARGS"} --results "$results"
}

fresh() {
  timeout 575 python3 benchmarks/bench_serving.py --servers fp8-te --variants turbo --caches sglang recommended \
    --requests-c1 5 --requests-c20 20 --start-timeout 510 --fresh-prompts ${SERVER_ARGS:+"--server-args=$SERVER_ARGS"} \
    --results "$results"
}

alloc() {
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 440 python3 benchmarks/bench_serving.py --servers fp8 \
    --variants turbo --caches sglang --requests-c1 5 --requests-c20 20 --start-timeout 420 \
    ${SERVER_ARGS:+"--server-args=$SERVER_ARGS"} --results "$results"
}

[ "$*" = all ] && set -- check host textenc fp8 int8 speed speedint8 length serve serveint8 workers fresh alloc
for step in "$@"; do
  case "$step" in wheels | check | host | textenc | fp8 | int8 | joins | attention | speed | speedint8 | length | serve | serveint8 | workers | fresh | alloc) ;; *) echo "unknown step: $step" >&2; exit 2 ;; esac
done
wheels
status=0
for step in "$@"; do
  [ "$step" = wheels ] && continue
  echo "== $step ($(date -u +%H:%M:%S))"
  "$step" || { status=$?; echo "== $step failed: $status"; }
done
exit $status
