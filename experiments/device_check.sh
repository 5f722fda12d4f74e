#!/usr/bin/env bash
# The one prepared run for a session that is lent a GPU (see ../.library/device/README.md): the two
# benchmarks whose numbers this project could not measure on CPU, in about 8 minutes, results in $1.
#   * bench_sweep.py: issue 3's speed-up of the one jit(vmap) sweep over a Python loop (≥ 20× target);
#   * bench_attention.py --gpu: bf16 blockwise and dense attention against jax.nn.dot_product_attention
#     with implementation='xla' and 'cudnn' (peak memory per configuration skipped: time is scarce).
# It needs only jax (with CUDA) and numpy, which the device image has: jaxattn is used from the tree.
# Call it as, e.g.:  run(command="bash experiments/device_check.sh $OUT", timeout_s=560)
set -u
out=${1:-device-output}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee "$out/devices.txt"
timeout 200 python experiments/bench_sweep.py 2>&1 | tee "$out/bench_sweep.txt"
timeout 300 python experiments/bench_attention.py --gpu --no-memory --seconds-per-config 2 --max-rounds 5 \
  --out "$out" 2>&1 | tee "$out/bench_attention.txt"
ls -l "$out"
