#!/usr/bin/env bash
# Issue 3 GPU check, one prepared script (< 8 minutes on one H100/H200):
#   1. the kernel tests, compiled (TRITON_INTERPRET=0), against the torch references;
#   2. the decode-attention benchmark (Triton on the quantized store vs SDPA on FP16 K/V).
# Logs and the benchmark table go to $OUT (the device tool's output folder) or docs/results/.
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-docs/results}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0
unset KVQUANT_ATTENTION
[ -f .venv/bin/activate ] && . .venv/bin/activate

# the package maps kvquant.kernels -> kernels/ (pyproject); without an install, link it in place
if ! python -c "import kvquant.kernels" 2>/dev/null; then
  [ -e kvquant/kernels ] || ln -s ../kernels kvquant/kernels
  [ -e kvquant/eval ] || ln -s ../eval kvquant/eval
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name(0), \
'capability', torch.cuda.get_device_capability(0))"
} 2>&1 | tee "$OUT/gpu_check_env.txt"

echo "== kernel tests (compiled) =="
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_e2e.py \
  --durations=5 2>&1 | tee "$OUT/gpu_check_tests.log" | tail -40
tests_rc=${PIPESTATUS[0]}

echo "== decode attention benchmark =="
timeout 150 python benchmarks/attention_decode.py --contexts 1024,8192,32768,131072 --batches 1,8,16 \
  --precisions fp16,int8,int4,fp8-e4m3 --out "$OUT" 2>&1 | tee "$OUT/gpu_check_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
