#!/usr/bin/env bash
# For a session with a CUDA GPU: every CUDA-marked test, the Triton tests, the attention op alone
# per backend, then the graph-mode benchmark on a random-weight model with Qwen3-0.6B's shapes in
# bf16; its table prints last.
#
# Sized for the device budget (15 minutes per session, machine start included): the parts have
# their own deadlines, about 9 minutes together (run it with timeout_s 570), which leaves time
# for one rerun of a part. Each part logs under $OUT (what the device tool brings back), so a
# part cut at its deadline still reports; the benchmark prints and saves each row as it is
# measured, FULL and PIECEWISE first.
# Runs against the machine's preinstalled torch (no install): PYTHONPATH=. puts kiln on the path.
#
#   bash scripts/gpu_check.sh                 # everything
#   bash scripts/gpu_check.sh bench           # one part: tests | triton | attention | bench
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-gpu-cache}
OUT=${OUT:-/tmp/kiln-gpu-check}
mkdir -p "$OUT"
PART=${1:-all}
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"

if [[ $PART == all || $PART == tests ]]; then
  # real CUDA graphs in the five modes vs eager (dense, and a hybrid with the Triton Gated
  # DeltaNet core), graph misses, graph memory vs the reservation, and speculative
  # verification (1 + k tokens per sequence) in FULL graphs.
  # -v: each test's result is logged as it finishes, so a run cut at the deadline still says
  # which passed; --durations shows where the time went
  timeout 240 python -m pytest -v -m cuda --durations=8 tests/test_cuda.py \
    tests/test_cuda_speculative.py 2>&1 \
    | tee "$OUT/cuda_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|error|skipped|s call|s setup" | tail -30
fi
if [[ $PART == all || $PART == triton ]]; then
  # the Triton kernel on the GPU, compiled (the tests that run it in the interpreter on the CPU),
  # split-KV included: ~30 specializations (head layouts, block sizes, segment counts) to compile
  timeout 90 python -m pytest -q tests/test_triton_backend.py tests/test_gdn_triton.py 2>&1 \
    | tee "$OUT/triton_tests.log" | tail -4
fi
if [[ $PART == all || $PART == attention ]]; then
  # the Triton kernel against the pure-PyTorch backend and fused SDPA on contiguous keys, and
  # split against unsplit where the launcher splits the keys (the b=1 decodes)
  timeout 40 python benchmarks/attention_kernels.py --iters 30 \
    --output "$OUT/attention_kernels.json" 2>&1 | tee "$OUT/attention_kernels.log" | tail -8
fi
if [[ $PART == all || $PART == bench ]]; then
  timeout 175 python benchmarks/graph_modes.py --model qwen3-0.6b-random --dtype bfloat16 \
    --output "$OUT/graph_modes.json" 2>&1 | grep -v Warning | tee "$OUT/graph_modes.log" | tail -9
fi
