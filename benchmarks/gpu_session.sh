#!/bin/bash
# One prepared GPU session (about 9 minutes on an H200): the FlashAttention benchmark, the MoE dispatch
# benchmark, then the kernel tests on CUDA (compiled Triton, not the interpreter), each under a time limit so
# that the whole run ends inside one device call. Writes to $OUT (default benchmarks/results):
# flash_attention.{json,png}, moe_dispatch.{json,png}, kernel_tests.xml and gpu_session_log.txt.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_session.sh
#
# It runs under whatever torch and triton the GPU machine has (no install step): the JSON files name them.
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg TQDM_DISABLE=1
PY=${PYTHON:-python3}
T0=$(date +%s)
stamp() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
{
  stamp start
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  stamp "FlashAttention benchmark"
  timeout 300 $PY benchmarks/flash_attention.py --budget-s 250 --out-dir "$OUT"
  stamp "MoE dispatch benchmark (exit $?)"
  timeout 120 $PY benchmarks/moe_dispatch.py --out "$OUT"
  stamp "kernel tests on CUDA (exit $?)"
  timeout 110 $PY -m pytest tests/kernels -q -p no:cacheprovider -n 8 -rfE --junitxml="$OUT/kernel_tests.xml" 2>&1 | tail -30
  stamp "done"
} > "$OUT/gpu_session_log.txt" 2>&1
grep -v "^bfloat16\|^float16" "$OUT/gpu_session_log.txt" | tail -80
