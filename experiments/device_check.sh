#!/usr/bin/env bash
# The benchmarks that need a GPU, in one command of about 6 minutes; results in $1 (devices.txt,
# bench_sweep.txt, bench_attention.txt/.json/.md, status.txt).
#   * bench_sweep.py: the speed-up of the one jit(vmap) sweep over a Python loop, waiting for each
#     result and asynchronous;
#   * bench_attention.py --gpu: bf16 blockwise and dense attention against jax.nn.dot_product_attention
#     with implementation='xla' and 'cudnn', GPT-2 shapes and T = 8k, 32k (peak memory skipped).
# It needs only jax (with CUDA) and numpy, which the device image has: jaxattn is used from the tree.
#   bash experiments/device_check.sh OUT
# Exit status: 0 only if every step succeeded; each step's status is in status.txt.
set -uo pipefail
out=${1:-device-output}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.txt, record the status
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local status=${PIPESTATUS[0]}
  echo "$name $status" >>"$out/status.txt"
  [ "$status" -eq 0 ] || failed=1
}
step devices 60 python -c "import jax; print(jax.__version__, jax.devices())"
step bench_sweep 150 python experiments/bench_sweep.py --repeats 3  # best of 3: both loops and the program
step bench_attention 200 python experiments/bench_attention.py --gpu --no-memory --seconds-per-config 2 \
  --max-rounds 5 --long-T 8192 32768 --out "$out"
cat "$out/status.txt"
exit "$failed"
