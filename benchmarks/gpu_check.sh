#!/usr/bin/env bash
# The long-context benchmark on CUDA, in under 8 minutes on one H100/H200-class GPU.
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#
# Runs `vericache bench --scenario long-context` on the GPU: full KV resident, full KV
# offloaded to pinned host memory behind a 25 GB/s link (PCIe-like; the copies run on a side
# stream, layer by layer, while the verify pass computes), lossy, and VeriCache lockstep and
# staggered; every non-lossy output is checked against full greedy (exit 1 if one differs).
# Writes OUT_DIR/long_context_cuda.json and the same run projected on h200-pcie5.
# Settings: fp32 (the lossless reference setting; see docs/performance.md for bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-benchmarks/out}}"
mkdir -p "$OUT"
VC="${VERICACHE:-.venv/bin/vericache}"
export LMCACHE_TRACK_USAGE=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 450 "$VC" bench --scenario long-context --device cuda --dtype float32 \
  --concurrency "${CONCURRENCY:-8}" --context-tokens "${CONTEXT_TOKENS:-4096}" \
  --max-tokens "${MAX_TOKENS:-64}" --compressors snapkv --ratios 4 --draft-lens 8 \
  --link-gbps "${LINK_GBPS:-200}" --project h200-pcie5 --quiet \
  --json "$OUT/long_context_cuda.json" | tee "$OUT/long_context_cuda.txt"
