#!/usr/bin/env bash
# One device call: build, check and time everything; full results under $OUT, a short table last.
#   run: bash bench/device_run.sh
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export PTXFORGE_CACHE_DIR=/tmp/ptxforge-cache
OUT=${OUT:-/tmp/ptxforge-out}
mkdir -p "$OUT"
py=python3
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  $py -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
  $py -m ptxforge.cli info
} 2>&1 | tee "$OUT/env.txt"
$py -m pytest tests -q -p no:cacheprovider -x 2>&1 | tee "$OUT/pytest.txt" | tail -15
$py bench/jit_timing.py "$OUT/jit.json" 2>&1 | tail -12 | tee "$OUT/jit.txt"
$py -m ptxforge.cli asm rms_norm_quantize_fp8 hidden=7168 --sass 2>&1 | head -30 | tee "$OUT/sass.txt"
$py -m ptxforge.cli demo 2>&1 | tee "$OUT/demo.txt" | tail -12
$py -m ptxforge.cli bench memory --json "$OUT/memory.json" --plot "$OUT/memory.png" 2>&1 | tee "$OUT/bench.txt"
