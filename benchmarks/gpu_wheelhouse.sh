#!/usr/bin/env bash
# Downloads the wheels that an aggregated `tandem up --engine reference` imports and the lent GPU
# machine's image lacks (it has no package registry), for Python 3.12 on x86-64 Linux, into
# .gpu-wheels/ (git-ignored), and prints their total size. benchmarks/serve_gpu.py's device call
# carries that folder and tandem/v1/ (the generated stubs) and installs the wheels with
#   python3 -m pip install --no-index --no-deps --upgrade .gpu-wheels/*.whl
#
# What is in it, and why:
#   grpcio 1.85.1, protobuf 7.36.2: the image has grpcio 1.84 and an older protobuf 7, but the
#     stubs in tandem/v1/ (grpcio-tools 1.85.1, protobuf gencode 7.35.1) refuse an older runtime
#     at import time.
#   grpcio-health-checking, grpcio-reflection 1.85.1: imported by every gRPC server
#     (tandem/runtime/server.py, health.py); pinned to grpcio's version.
#   orjson: the frontend's SSE encoding (services/frontend/http_app.py).
#   opentelemetry-api: tandem/runtime/tracing.py and every client import opentelemetry.trace.
#   nixl 1.5.1 (disaggregated workers), in nixl/: the meta package's wheel and nixl-cu13 cut down
#     to its UCX backend by gpu_nixl_slim.py (59 MB -> ~10 MB); on the device,
#     `tar -xJf .gpu-wheels/nixl/nixl_cu13-slim.tar.xz -C <the --target folder>`.
# Not carried (imported lazily, never on the aggregated path without OTEL_* or guided requests):
#   opentelemetry-sdk and the OTLP exporter (only when OTEL_* variables ask for traces), diffusers
#   and av (video); xgrammar (structured outputs) and its dependencies are downloaded by hand for
#   benchmarks/guided_decoding.py's calls.
#
#   bash benchmarks/gpu_wheelhouse.sh [DIR]      # default .gpu-wheels
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-wheels}
mkdir -p "$dir"
pip=${PIP:-.venv/bin/pip}
"$pip" download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
  orjson==3.13.0 opentelemetry-api==1.45.2
mkdir -p "$dir/nixl"
"$pip" download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$dir/nixl" nixl==1.5.1 nixl-cu13==1.5.1
"${PYTHON:-.venv/bin/python}" benchmarks/gpu_nixl_slim.py "$dir"/nixl/nixl_cu13-*.whl \
  "$dir/nixl/nixl_cu13-slim.tar.xz"
rm "$dir"/nixl/nixl_cu13-*.whl
ls -l "$dir" "$dir/nixl"
total=$(du -cb "$dir"/*.whl "$dir"/nixl/* | tail -1 | cut -f1)
stubs=$(du -cb tandem/v1/*_pb2*.py | tail -1 | cut -f1)
echo "wheels: $((total / 1024)) KiB; stubs (tandem/v1): $((stubs / 1024)) KiB;" \
  "together $(((total + stubs) / 1024 / 1024)) MiB of the 64 MiB a device call carries"
