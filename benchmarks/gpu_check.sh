#!/usr/bin/env bash
# The GPU check, in under 5 minutes on one H100/H200-class GPU, nothing downloaded.
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#   DEVICE=cpu benchmarks/gpu_check.sh [OUT_DIR]   # the dry run: a toy shape on CPU
#
# 1. benchmarks/gpu_timing.py: a random-weight model of Llama-3-8B's shape in bf16 (built from
#    its config): the draft step, verify pass (k + 1 = 33 rows) and full step at batch 16-64
#    and contexts 8k-32k (the points that fit), the host-to-device copy rate, and how much of
#    an offloaded verify pass's copy its compute hides -> OUT_DIR/gpu_times.json.
# 2. benchmarks/project_json.py: the τ, drafts per round and compression of a long-context
#    run measured on CPU ($RUN_JSON, default this repository's latest) with those times in
#    place of the bandwidth model's peak x 0.8 -> OUT_DIR/projection.json.
# 3. (CUDA) `vericache bench --scenario long-context` with the default model on the GPU:
#    full KV resident and offloaded (pinned host memory behind a 25 GB/s link, copies on a
#    side stream), lossy, VeriCache lockstep and staggered; every non-lossy output checked
#    against full greedy (exit 1 if one differs) -> OUT_DIR/long_context_cuda.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-benchmarks/out}}"
DEVICE="${DEVICE:-cuda}"
RUN_JSON="${RUN_JSON:-benchmarks/results/2026-12-02/thirteenth/long_context_8x4k.json}"
PY="${PYTHON:-.venv/bin/python}"
VC="${VERICACHE:-.venv/bin/vericache}"
export LMCACHE_TRACK_USAGE=false
mkdir -p "$OUT"
if [ "$DEVICE" = cpu ]; then
  timeout 120 "$PY" benchmarks/gpu_timing.py --device cpu --shape tiny --batches 2,4 \
    --contexts 256,1024 --json "$OUT/gpu_times.json"
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  timeout 170 "$PY" benchmarks/gpu_timing.py --device "$DEVICE" --shape llama3-8b \
    --batches "${BATCHES:-16,32,64}" --contexts "${CONTEXTS:-8192,16384,32768}" \
    --json "$OUT/gpu_times.json"
fi
"$PY" benchmarks/project_json.py "$RUN_JSON" --gpu-times "$OUT/gpu_times.json" \
  --out "$OUT/projection.json"
if [ "$DEVICE" != cpu ]; then
  timeout 110 "$VC" bench --scenario long-context --device "$DEVICE" --dtype float32 \
    --concurrency "${CONCURRENCY:-8}" --context-tokens "${CONTEXT_TOKENS:-4096}" \
    --max-tokens "${MAX_TOKENS:-64}" --compressors snapkv --ratios 4 --draft-lens 8 \
    --link-gbps "${LINK_GBPS:-200}" --project h200-pcie5 --quiet \
    --json "$OUT/long_context_cuda.json" | tee "$OUT/long_context_cuda.txt"
fi
