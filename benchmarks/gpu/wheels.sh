#!/usr/bin/env bash
# The wheels a device call carries (`carry: [".whl"]`): the packages the GPU machine lacks (its Python 3.12 and torch
# 2.11 are there; torchao, the serve extra and a few pure-Python helpers are not), downloaded here for x86-64 into
# .whl (about 6.6 MB; a call carries at most 64 MiB with the working tree). Run once per checkout, in the repository:
#
#   bash benchmarks/gpu/wheels.sh          # then every step script's `wheels` step installs them into /tmp/site
#
# One pinned list for every script of benchmarks/gpu/ (fast_path, startup, cached_step, faults_and_soak): torchao
# (FP8), fastapi, starlette, uvicorn and pydantic(-settings) with their needs (fastapi 0.165 imports
# opentelemetry-api), pynvml (nvidia-ml-py: the GPU health metrics) and pytorch-msssim (the sweep's SSIM).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo "/.whl/" >> .git/info/exclude; }
WHEELS=(
  torchao==0.18.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5
  python-dotenv==1.2.4 typing-extensions==4.16.0
  opentelemetry-api==1.45.2 importlib-metadata==10.2.0 lazy-importer
  nvidia-ml-py==13.615.71 pytorch-msssim==1.0.0
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
du -sh .whl
