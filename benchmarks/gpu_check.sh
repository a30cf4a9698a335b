#!/usr/bin/env bash
# The GPU check, in under 5 minutes on one H100/H200-class GPU, nothing downloaded.
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#   DEVICE=cpu benchmarks/gpu_check.sh [OUT_DIR]   # the dry run: toy shapes on CPU
#
# 1. benchmarks/gpu_timing.py: a random-weight model of Llama-3-8B's shape in bf16 (built from
#    its config): the draft step, verify pass (k + 1 = 33 rows) and full step at batch 16-64
#    and contexts 8k-32k (the points that fit), each full step's read rate, the device's
#    memory rate (a device-to-device copy), the host-to-device copy rate, and how much of an
#    offloaded verify pass's copy its compute hides -> OUT_DIR/gpu_times.json.
# 2. benchmarks/gpu_identity.py: tiny random-weight models of the runner's families (its
#    default --archs, from tests/test_architectures.py: one of each attention and norm path the
#    runner has), in bf16 and fp32 on the device: `vericache` mode against
#    `full` for every compressor and both `exact` modes, and `full` against transformers'
#    generate -> OUT_DIR/gpu_identity.json (its exit status is 1 if a vericache case differs).
#    (The default model, a 94 MB GGUF from a PyPI package, does not travel to a bare device.)
# 3. benchmarks/project_json.py: the τ, drafts per round and compression of a long-context
#    run measured on CPU ($RUN_JSON, default this repository's latest) with step 1's times in
#    place of the bandwidth model's peak x 0.8 -> OUT_DIR/projection.json.
# 4. (CUDA) benchmarks/gpu_profile.py: decode and verify passes under each SDPA backend, and
#    a profiled pass set (GPU busy time, kernel launches, top kernels) -> OUT_DIR/profile.txt.
# Every step runs; the exit status is the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-benchmarks/out}}"
DEVICE="${DEVICE:-cuda}"
RUN_JSON="${RUN_JSON:-benchmarks/results/2026-12-02/thirteenth/long_context_8x4k.json}"
if [ -x .venv/bin/python ]; then PY="${PYTHON:-.venv/bin/python}"; else PY="${PYTHON:-python3}"; fi
export LMCACHE_TRACK_USAGE=false PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
rc=0
step() { "$@"; local r=$?; [ $r -ne 0 ] && echo "gpu_check: exit $r from: $*" >&2 && [ $rc -eq 0 ] && rc=$r; return 0; }
if [ "$DEVICE" = cpu ]; then
  step timeout 120 "$PY" benchmarks/gpu_timing.py --device cpu --shape tiny --batches 2,4 \
    --contexts 256,1024 --json "$OUT/gpu_times.json"
  step timeout 120 "$PY" benchmarks/gpu_identity.py --device cpu --archs llama --dtypes float32 \
    --prompt 96 --new 16 --json "$OUT/gpu_identity.json"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  step timeout "${TIMING_S:-170}" "$PY" benchmarks/gpu_timing.py --device "$DEVICE" --shape llama3-8b \
    --batches "${BATCHES:-16,32,64}" --contexts "${CONTEXTS:-8192,16384,32768}" \
    --json "$OUT/gpu_times.json"
  step timeout "${IDENTITY_S:-120}" "$PY" benchmarks/gpu_identity.py --device "$DEVICE" \
    --json "$OUT/gpu_identity.json"
fi
[ -f "$OUT/gpu_times.json" ] && step "$PY" benchmarks/project_json.py "$RUN_JSON" \
  --gpu-times "$OUT/gpu_times.json" --out "$OUT/projection.json"
if [ "$DEVICE" != cpu ]; then
  step timeout "${PROFILE_S:-100}" "$PY" benchmarks/gpu_profile.py > "$OUT/profile.txt"
fi
exit $rc
