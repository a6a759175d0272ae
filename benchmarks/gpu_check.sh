#!/usr/bin/env bash
# GPU check of the Triton decode kernels (issues 3 and 13), one prepared script, < 5 minutes on an H100/H200:
#   1. the kernel tests compiled (TRITON_INTERPRET=0), decode tests first, against the torch references;
#   2. a correctness gate: Triton decode vs the chunked fp32 torch path at 32K tokens x batch 8 (asserted);
#   3. timings: FP16 SDPA (backend pinned, logged) vs each kvquant precision at 4K/32K/128K, batch 1/8
#      (do_bench, L2 flushed), bandwidth vs the copy bandwidth measured in the same run; JSON after each point.
# Logs, JSON and tables go to $OUT (the device tool's output folder) or docs/results/.
#
#   bash benchmarks/gpu_check.sh             # on a GPU
#   bash benchmarks/gpu_check.sh --dry-run   # anywhere (CPU): shapes, plan, 32-bit offset check, sm_90a compile only
#   bash benchmarks/gpu_check.sh [--dry-run] --python PATH   # or KVQUANT_PYTHON=PATH: the interpreter to use
#
# Which Python: --python, else $KVQUANT_PYTHON (or $PYTHON), else .venv/bin/python if any, else python3. On the GPU
# image (python3 with torch 2.11, triton 3.6, transformers 5.17, no network) run it as copied, nothing to
# install: kvquant is imported from this checkout. `make gpu-image-check` runs the dry run in a venv holding
# those versions (constraints-gpu-image.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
PY="${KVQUANT_PYTHON:-${PYTHON:-}}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --python) PY="${2:?--python needs a path}"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --python PATH)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null || { echo "gpu_check.sh: no Python at $PY" >&2; exit 2; }
OUT="${OUT:-docs/results}"
[ $DRY = 1 ] && OUT="${OUT_DRY:-$(mktemp -d)}"
mkdir -p "$OUT"
unset TRITON_INTERPRET KVQUANT_ATTENTION
export TRITON_DEFAULT_FP_FUSION=1
PRECISIONS=fp16,int8,int8-token,fp8-e4m3,int4,int4-channel,int2
# shellcheck disable=SC2054
POINTS=(--contexts 4096,32768,131072 --batches 1,8 --precisions "$PRECISIONS")

# kvquant from this checkout, installed or not (the GPU image has no install): the root goes on PYTHONPATH, so
# scripts run by path (benchmarks/*.py, whose sys.path[0] is benchmarks/) import it too. Safe: kernels/ and eval/
# are namespace portions, they shadow no installed package. kvquant/kernels and kvquant/eval are the package's
# links to them (tracked; re-made here if a copy lost them).
[ -e kvquant/kernels ] || ln -s ../kernels kvquant/kernels
[ -e kvquant/eval ] || ln -s ../eval kvquant/eval
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  echo "python: $PY"
  $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, \
'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
} 2>&1 | tee "$OUT/gpu_check_env.txt"

if [ $DRY = 1 ]; then
  echo "== dry run: compile check (sm_90a / sm_80, the launcher's own specialisation) =="
  $PY -m kvquant.kernels.triton_compile_check --quick 2>&1 | grep -v -i warn
  cc_rc=${PIPESTATUS[0]}
  echo "== dry run: plan of the gate (32K x 8) and of the timed points =="
  $PY benchmarks/attention_decode.py --dry-run "${POINTS[@]}" 2>&1 | grep -v -i warn | tee "$OUT/gpu_check_plan.log"
  plan_rc=${PIPESTATUS[0]}
  echo "dry run: compile rc=$cc_rc plan rc=$plan_rc (logs in $OUT)"
  exit $(( cc_rc != 0 || plan_rc != 0 ))
fi

echo "== 1. kernel tests (compiled), decode first =="
timeout 150 $PY -m pytest -x -q -p no:cacheprovider tests/test_kernels.py -k "decode" 2>&1 \
  | tee "$OUT/gpu_check_tests.log" | tail -5
dec_rc=${PIPESTATUS[0]}
timeout 120 $PY -m pytest -x -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_e2e.py -k "not decode" \
  2>&1 | tee -a "$OUT/gpu_check_tests.log" | tail -5
tests_rc=${PIPESTATUS[0]}

echo "== 2. correctness gate: 32K x batch 8 vs the chunked torch path =="
timeout 60 $PY benchmarks/attention_decode.py --gate --no-sdpa --contexts 32768 --batches 8 \
  --precisions "$PRECISIONS" --out "$OUT/gate" 2>&1 | tee "$OUT/gpu_check_gate.log" | tail -12
gate_rc=${PIPESTATUS[0]}

echo "== 3. decode timings vs FP16 SDPA =="
timeout 120 $PY benchmarks/attention_decode.py "${POINTS[@]}" --sdpa-backend flash --out "$OUT" 2>&1 \
  | tee "$OUT/gpu_check_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "decode tests rc=$dec_rc other tests rc=$tests_rc gate rc=$gate_rc bench rc=$bench_rc"
exit $(( dec_rc != 0 || tests_rc != 0 || gate_rc != 0 || bench_rc != 0 ))
