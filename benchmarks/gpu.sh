#!/usr/bin/env bash
# olmax on one NVIDIA H200, in about 15 minutes: the grouped-matmul kernels' check, the train step at the CPU benchmark's shape and at a slice
# of the OLMo 3 7B shape, cuDNN attention against olmax's blocked XLA attention (numerics and time), and the
# MoE experts' grouped-matmul kernels and a 47B-shaped MoE layer.
# JSON results go to $OUT (default benchmarks/out/gpu); MFU is against 989 TFLOP/s, the H200's dense bf16
# peak. The step runs the attention `auto` picks there (cuDNN); each step row also carries the step-time model's
# prediction for the GPU it runs on (predicted_step_s beside median_step_s). Never run by CI; not yet run on a GPU
# (written and checked on a CPU machine: its Python half is tested at toy sizes).
#
#   bash benchmarks/gpu.sh
#
# JAX with CUDA: the machine's own if it already sees the GPU, else `jax[cuda12]==0.10.2` from the
# package index, or from a folder of wheels (WHEELS=DIR) where nothing can be fetched. olmax runs from
# src/ (PYTHONPATH); its pure-Python dependencies that are missing are installed the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

pip_install() {
  if [[ -n "${WHEELS:-}" ]]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@"
  else
    "$PY" -m pip install -q "$@"
  fi
}

if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  pip_install 'jax[cuda12]==0.10.2'
fi
for module in pydantic:pydantic==2.14.4 yaml:pyyaml==6.0.4 optax:optax==0.2.8; do
  "$PY" -c "import ${module%%:*}" 2>/dev/null || pip_install "${module#*:}"
done

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; } > "$OUT/gpu.txt"
"$PY" -c 'import jax; print(jax.__version__, jax.devices())' | tee -a "$OUT/gpu.txt"

# Each part has its own time limit, so one that hangs leaves the others their results.
status=0
# First the check a run makes before it trusts the experts' grouped kernels, for every one this GPU runs (and the
# block loop), with each one's error against float64: a kernel that fails it leaves a run the block loop.
timeout 120 "$PY" benchmarks/gpu_bench.py check --out "$OUT/kernel_check.json" || status=1
timeout 150 "$PY" benchmarks/gpu_bench.py step --shape cpu --steps 10 --out "$OUT/step_cpu_shape.json" || status=1
timeout 210 "$PY" benchmarks/gpu_bench.py step --shape 7b-slice --steps 5 --out "$OUT/step_7b_slice.json" || status=1
timeout 120 "$PY" benchmarks/gpu_bench.py attention --implementation cudnn --out "$OUT/attention_cudnn.json" || status=1
# The experts' grouped-matmul kernels (impl.moe.dispatch=grouped: Hopper and Blackwell) against the block loop and
# lax.ragged_dot at the 47B's expert shapes (one of 8 GPUs: 16 experts, 32,768 rows, 3584 x 1024), forward and
# gradients; then a 47B-shaped MoE layer's step on one GPU, grouped and blocks, predicted against measured.
timeout 180 "$PY" benchmarks/gpu_bench.py experts --out "$OUT/experts.json" || status=1
timeout 240 "$PY" benchmarks/gpu_bench.py moe-layer --out "$OUT/moe_layer.json" || status=1
# MXFP8 (impl.fp8=mxfp8: cuDNN's block-scaled GEMMs) against the bf16 step above, on the same shape and data,
# where the GPU has them (compute capability 10.x, Blackwell; olmax refuses mxfp8 below that): the dense
# 7B slice, and the MoE tiny with its experts' grouped matmuls in MXFP8 too against its bf16 step.
if "$PY" -c 'import jax, sys; sys.exit(float(jax.devices()[0].compute_capability) < 10)'; then
  timeout 210 "$PY" benchmarks/gpu_bench.py step --shape 7b-slice --steps 5 --out "$OUT/step_7b_slice_mxfp8.json" \
    impl.fp8=mxfp8 || status=1
  for fp8 in false mxfp8; do
    timeout 150 "$PY" benchmarks/gpu_bench.py step --shape cpu --steps 10 --out "$OUT/step_moe_$fp8.json" \
      model.mlp=moe model.moe.num_experts=8 model.moe.top_k=2 model.moe.expert_hidden=768 impl.fp8=$fp8 || status=1
  done
else
  echo "MXFP8 skipped: compute capability $("$PY" -c 'import jax; print(jax.devices()[0].compute_capability)') < 10" \
    | tee -a "$OUT/gpu.txt"
fi
exit $status
