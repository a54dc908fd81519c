#!/usr/bin/env bash
# For a session with a CUDA GPU: every CUDA-marked test, the Triton tests, the attention op alone
# per backend, then the graph-mode benchmark on a random-weight model with Qwen3-0.6B's shapes in
# bf16; its table prints last.
#
# Sized for the device budget (15 minutes per session, machine start included): the parts have
# their own deadlines, 7 minutes together (run it with timeout_s 450), which leaves time for a
# fresh machine and one rerun of a part. The CUDA tests run in pytest-xdist workers (the image
# has it) beside the Triton tests; the two timed parts run alone after them. Each part logs under $OUT (what the device tool brings back), so a
# part cut at its deadline still reports; the benchmark prints and saves each row as it is
# measured, FULL and PIECEWISE first.
# Runs against the machine's preinstalled torch (no install): PYTHONPATH=. puts kiln on the path.
#
#   bash scripts/gpu_check.sh                 # everything
#   bash scripts/gpu_check.sh bench           # one part: tests | triton | attention | bench
#   bash scripts/gpu_check.sh checks          # the tests and the Triton tests, side by side
#   bash scripts/gpu_check.sh hybrid          # not in all: the graph modes on qwen3-next-random
#   bash scripts/gpu_check.sh moe             # not in all: the MoE block, Triton vs _grouped_mm
#   bash scripts/gpu_check.sh gdn             # not in all (60 s): the Triton GDN core's chunked
#                                             # rule vs token by token, 1 to 16k tokens
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
# the image's Python is python3 (there may be no plain python)
PY=${PYTHON:-python3}
# the device image lacks the gguf package kiln's loader imports: it travels as a wheel in .whl
# (carry: [".whl"]), downloaded here with pip download --no-deps gguf==<kiln's version>
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kiln-site .whl/*.whl && export PYTHONPATH=.:/tmp/kiln-site
fi
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-gpu-cache}
OUT=${OUT:-/tmp/kiln-gpu-check}
mkdir -p "$OUT"
PART=${1:-all}
"$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"

if [[ $PART == all || $PART == checks || $PART == triton ]]; then
  # the Triton kernel on the GPU, compiled (the tests that run it in the interpreter on the CPU),
  # split-KV included: ~30 specializations (head layouts, block sizes, segment counts) to compile;
  # in the background, beside the CUDA tests
  timeout 200 "$PY" -m pytest -q tests/test_triton_backend.py tests/test_gdn_triton.py \
    tests/test_moe_triton.py \
    >"$OUT/triton_tests.log" 2>&1 &
  TRITON_PID=$!
fi
if [[ $PART == all || $PART == checks || $PART == tests ]]; then
  # real CUDA graphs in the five modes vs eager (dense, and a hybrid with the Triton Gated
  # DeltaNet core), graph misses, graph memory vs the reservation, and speculative
  # verification (1 + k tokens per sequence) in FULL graphs.
  # -v: each test's result is logged as it finishes, so a run cut at the deadline still says
  # which passed; --durations shows where the time went
  # The two that measure graph memory as the device's free memory run after the others, alone:
  # a worker beside them sizing its KV cache moves that number by gigabytes.
  ALONE="memory_within_ten_percent or share_one_pool"
  timeout 170 "$PY" -m pytest -v -n 6 -m cuda --durations=8 -k "not ($ALONE)" tests/test_cuda.py \
    tests/test_cuda_speculative.py 2>&1 \
    | tee "$OUT/cuda_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|error|skipped|s call|s setup" | tail -40
  timeout 80 "$PY" -m pytest -v -m cuda -k "$ALONE" tests/test_cuda.py 2>&1 \
    | tee "$OUT/cuda_memory_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|error" | tail -6
fi
if [[ -n ${TRITON_PID:-} ]]; then
  wait "$TRITON_PID"
  tail -4 "$OUT/triton_tests.log"
fi
if [[ $PART == all || $PART == attention ]]; then
  # the Triton kernel against the pure-PyTorch backend and fused SDPA on contiguous keys, and
  # split against unsplit where the launcher splits the keys (the b=1 decodes)
  timeout 40 "$PY" benchmarks/attention_kernels.py --iters 30 \
    --output "$OUT/attention_kernels.json" 2>&1 | tee "$OUT/attention_kernels.log" | tail -8
fi
if [[ $PART == gdn ]]; then
  # the Triton Gated DeltaNet core at Qwen3-Next's heads: its chunked rule for prefills
  # against its token-by-token form (and the two checked equal), the PyTorch core and HF's
  timeout 60 "$PY" benchmarks/gdn_op.py --triton --tokens 1 512 4096 16384 --rounds 3 2>&1 \
    | grep -v Warning | tee "$OUT/gdn_op.log" | grep -E "^\||tokens:"
fi
if [[ $PART == all || $PART == bench ]]; then
  timeout 160 "$PY" benchmarks/graph_modes.py --model qwen3-0.6b-random --dtype bfloat16 \
    --output "$OUT/graph_modes.json" 2>&1 | grep -v Warning | tee "$OUT/graph_modes.log" | tail -9
fi
if [[ $PART == hybrid ]]; then
  # Qwen3-Next's mix (Gated DeltaNet + gated attention + MoE), scaled, in bf16: the Triton GDN
  # core and the grouped experts inside every graph mode
  timeout 170 "$PY" benchmarks/graph_modes.py --model qwen3-next-random --dtype bfloat16 \
    --output "$OUT/graph_modes_hybrid.json" 2>&1 | grep -v Warning \
    | tee "$OUT/graph_modes_hybrid.log" | tail -9
fi
if [[ $PART == moe ]]; then
  # Qwen3-30B-A3B's expert shapes: kiln's Triton kernel against torch._grouped_mm (bf16, where
  # both capture) and HF's block, and the experts kept 4-bit (Q4_0, the grouped int4 Triton
  # kernel); then float32, where only the Triton kernels capture
  for dtype in bfloat16 float32; do
    timeout 90 "$PY" benchmarks/moe_block.py --hidden 2048 --intermediate 768 --experts 128 \
      --dtype "$dtype" --tokens 1 16 128 1024 --int4 2>&1 | tee "$OUT/moe_block_$dtype.log" \
      | grep "^|"
  done
fi
