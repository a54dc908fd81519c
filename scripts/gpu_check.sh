#!/usr/bin/env bash
# For a session with a CUDA GPU: every CUDA-marked test, then the graph-mode benchmark on a
# random-weight model with Qwen3-0.6B's shapes in bf16; the benchmark's table prints last.
# Runs against the machine's preinstalled torch (no install): PYTHONPATH=. puts kiln on the path.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-gpu-cache}
OUT=${OUT:-/tmp}
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
# real CUDA graphs in the five modes, then the Triton kernels compiled for the GPU
timeout 360 python -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tail -20
timeout 120 python -m pytest -q tests/test_triton_backend.py 2>&1 | tail -5
timeout 240 python benchmarks/graph_modes.py --model qwen3-0.6b-random --dtype bfloat16 \
  --output "$OUT/graph_modes.json" 2>&1 | grep -v Warning | tail -12
