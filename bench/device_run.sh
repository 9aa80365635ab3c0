#!/usr/bin/env bash
# One device call: test, build, sanitize, check and time everything. Full log and results under
# $OUT (log.txt, and in results.tgz jit.json, the sanitizers' reports, and json + png for the
# memory, gemm, grouped, bf16 and decode suites); short tables last.
#   run from the repository root: bash bench/device_run.sh
#   (HOST_AB_BASE=/other/checkout/src bash bench/device_run.sh: host time per op against it)
# The models (the compile backend's GPU tests, `ptxforge bench model`, each kernel of a compiled
# call, precompiling Llama's kernels cold) take a call of their own, within the device's 10
# minutes a call:
#   bash bench/device_run.sh models
# The ONNX front end: its GPU test (an exported Llama against onnxruntime), then the bench
# (Llama-3-8B sizes exported at each opset beside the model compiled from PyTorch):
#   bash bench/device_run.sh onnx-test
#   bash bench/device_run.sh onnx [opsets, default 18,23]
# Expert parallelism (a rank a GPU, as many as are visible; on one GPU two ranks under MPS):
#   bash bench/device_run.sh ep
# Text generation (Llama-3-8B's sizes; transformers' generate eager, with its own compile,
# and with ptxforge's recipes; the step's roofline), a process each (case, candidate); all
# 32 layers take a call a case:
#   bash bench/device_run.sh generate [cases, default 1x512] [layers, default 32] [candidates,
#     default all: e.g. "torch.compile,ptxforge steps" where eager would not fit the call]
# Decode attention (its GPU tests, memcheck, `ptxforge bench attention` beside SDPA):
#   bash bench/device_run.sh attention
set -u -o pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
export PTXFORGE_CACHE_DIR=/tmp/ptxforge-cache
OUT=${OUT:-/tmp/ptxforge-out}
mkdir -p "$OUT"
log="$OUT/log.txt"
py=python3
step() { echo; echo "### $*"; "$@"; } 2>&1
if [ "${1:-}" = ep ]; then
  # Expert parallelism: the two-rank GPU tests (communication, the MoE layer, a compiled
  # DeepSeek-V3 block), then `ptxforge bench ep` on every visible GPU (the sweep, the P2P copy,
  # NCCL, the overlap with the grouped GEMM beside it, the MoE layer against its peers). A
  # rank a GPU where two or more are visible; on one GPU two ranks under MPS, so that
  # kernels waiting for each other are resident together. NVLink multicast stays off in
  # every process.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  gpus=$(nvidia-smi -L | wc -l)
  world=$(( gpus < 2 ? 2 : gpus ))
  if [ "$gpus" -lt 2 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/ptxforge-mps CUDA_MPS_LOG_DIRECTORY=/tmp/ptxforge-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
  fi
  {
    step env PTXFORGE_EP_TEST_TIMEOUT_S=150 timeout 540 $py -m pytest tests/gpu/test_ep_gpu.py tests/gpu/test_ep_low_latency_gpu.py tests/gpu/test_ep_layer_gpu.py tests/gpu/test_compiler_ep_gpu.py -q -s -p no:cacheprovider
    # Every scenario again on a rank a GPU of them all (the pytest runs above take two); the
    # layer's DeepSeek-V3 shape needs a GPU a rank (test_ep_layer_gpu.py says why).
    step timeout 240 $py -m torch.distributed.run --nproc-per-node "$world" tests/gpu/test_ep_gpu.py
    if [ "$gpus" -ge 2 ]; then
      step timeout 300 $py -m torch.distributed.run --nproc-per-node "$world" tests/gpu/test_ep_layer_gpu.py
    fi
    step timeout 400 $py -m ptxforge.cli bench ep --world "$world" --json "$OUT/ep.json" --plot "$OUT/ep.png"
  } > "$log" 2>&1
  grep -E "passed|failed|Error" "$log" | grep -v "^|\|^rank " | tail -18
  echo "torchrun, $world ranks: $(grep -o 'rank [0-9]*: [a-z_0-9]* passed' "$log" | wc -l) scenario runs passed"
  sed -n '/### .*bench ep/,$p' "$log" | grep -v "^###\|^DEBUG\|[Ww]arn"
  exit 0
fi
if [ "${1:-}" = generate ]; then
  $py -m ptxforge.cli bench generate --cases "${2:-1x512}" --layers "${3:-32}" \
    ${4:+--candidates "$4"} --json "$OUT/generate.json" --plot "$OUT/generate.png" > "$log" 2>&1
  grep -v "^DEBUG\|[Ww]arn" "$log" | tail -24
  exit 0
fi
if [ "${1:-}" = attention ]; then
  # Decode attention: its GPU tests (first the simulator's mma fragments against the GPU's),
  # memcheck on them, then `ptxforge bench attention`.
  {
    step timeout 300 $py -m pytest tests/gpu/test_fragments_gpu.py tests/gpu/test_attention_gpu.py -q -p no:cacheprovider
    step timeout 200 compute-sanitizer --tool memcheck $py -m pytest tests/gpu/test_attention_gpu.py -q -p no:cacheprovider -k "1000 or graph"
    step timeout 300 $py -m ptxforge.cli bench attention --json "$OUT/attention.json"
  } > "$log" 2>&1
  grep -E "passed|failed|ERROR SUMMARY|Invalid|Error" "$log" | grep -v "^|" | tail -8
  sed -n '/### .*bench attention/,$p' "$log" | grep -v "^###\|[Ww]arn"
  exit 0
fi
if [ "${1:-}" = moe ]; then
  # The MoE kernels' GPU tests, memcheck on the experts op, each MoE kernel timed.
  {
    step timeout 300 $py -m pytest tests/gpu/test_moe_layout_gpu.py tests/gpu/test_moe_combine_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_grouped_gemm_gpu.py -q -p no:cacheprovider -x
    step bash bench/sanitize.sh
    step $py bench/moe_kernels.py
  } > "$log" 2>&1
  grep -E "passed|failed|memcheck:|synccheck:|racecheck:|Error" "$log" | grep -v "^|" | tail -12
  sed -n '/### .*moe_kernels/,$p' "$log" | grep -v "^###\|[Ww]arn"
  exit 0
fi
if [ "${1:-}" = moe-models ]; then   # [models, default both MoE blocks]
  models=${2:-deepseek-v3-moe,mixtral-moe}
  $py -m ptxforge.cli bench model --models "$models" --json "$OUT/moe_model.json" --plot "$OUT/moe_model.png" > "$log" 2>&1
  grep -v "^DEBUG\|[Ww]arn" "$log" | tail -40
  exit 0
fi
if [ "${1:-}" = onnx-test ]; then
  timeout 540 $py -m pytest tests/gpu/test_onnx_gpu.py -q -p no:cacheprovider > "$log" 2>&1
  grep -v "^DEBUG\|[Ww]arn" "$log" | tail -30
  exit 0
fi
if [ "${1:-}" = onnx ]; then
  $py -m ptxforge.cli bench onnx --opsets "${2:-18,23}" --json "$OUT/onnx.json" > "$log" 2>&1
  grep -v "^DEBUG\|^W1\|[Ww]arn\|__new__" "$log" | tail -30
  exit 0
fi
if [ "${1:-}" = models ]; then
  {
    step timeout 200 $py -m pytest tests/gpu/test_compiler_gpu.py -q -p no:cacheprovider
    step env PTXFORGE_CACHE_DIR=/tmp/ptxforge-cold $py -m ptxforge.cli precompile --model llama-8b --tokens 16384
    step $py -m ptxforge.cli bench model --json "$OUT/model.json" --plot "$OUT/model.png"
    step $py bench/model_profile.py ffn:64 ffn:4096 llama-8b:64 llama-8b:2048
  } > "$log" 2>&1
  grep -E "passed|failed|kernels for 1-" "$log" | grep -v "^|" | tail -4
  sed -n '/### .*bench model/,$p' "$log" | grep -v "^###\|^DEBUG\|[Ww]arn"
  exit 0
fi
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  $py -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
  step $py -m ptxforge.cli info
  step timeout 300 $py -m pytest tests -q -p no:cacheprovider --ignore=tests/gpu/test_onnx_gpu.py
  step $py bench/jit_timing.py "$OUT/jit.json"
  step $py bench/host_breakdown.py
  # host time per op: against the tree at $HOST_AB_BASE (another checkout's src) where set,
  # else this tree's ctypes launches against its C launcher
  step $py bench/host_ab.py "${HOST_AB_BASE:---native}" 21
  step bash bench/sanitize.sh
  step $py -m ptxforge.cli asm quantize_fp8_per_token hidden=7168 --sass
  step $py -m ptxforge.cli asm fp8_gemm_nt m=4096 n=7168 k=16384 --sass
  step $py -m ptxforge.cli demo
  step $py -m ptxforge.cli bench memory --json "$OUT/memory.json" --plot "$OUT/memory.png"
  step $py -m ptxforge.cli bench fp8-gemm --json "$OUT/gemm.json" --plot "$OUT/gemm.png"
  step $py -m ptxforge.cli bench grouped-gemm --json "$OUT/grouped.json" --plot "$OUT/grouped.png"
  step $py -m ptxforge.cli bench bf16-gemm --json "$OUT/bf16.json" --plot "$OUT/bf16.png"
  step $py -m ptxforge.cli bench chain --json "$OUT/chain.json"
  step $py -m ptxforge.cli bench decode --json "$OUT/decode.json" --plot "$OUT/decode.png"
} > "$log" 2>&1
sed -n "/### .*jit_timing/,/### .*asm/p" "$log" | grep -v "^\[" | tail -60
sed -n '/### .*bench memory/,/### .*bench decode/p' "$log" | grep -v "[Ww]arn"
# decode's summary lines; its table (104 rows) is in log.txt and decode.json
sed -n '/### .*bench decode/,$p' "$log" | grep -v -e "^|" -e "^###" -e "[Ww]arn"
# Everything but the log in one archive: the device tool brings back a few files only.
(cd "$OUT" && tar czf results.tgz --exclude=log.txt --exclude=results.tgz -- * \
   && find . -maxdepth 1 -type f ! -name log.txt ! -name results.tgz -delete)
# The checks last: the device tool returns the output's tail.
echo; echo "### checks"
grep -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR) " "$log" | tail -12
grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -3
grep -E "FAIL|checks passed" "$log" | grep -v "^FAILED " | tail -20
