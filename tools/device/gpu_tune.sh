#!/usr/bin/env bash
# One device call: tune epilora-kernels' launch settings (benchmarks/tune.py) into $OUT; copy
# $OUT/NVIDIA_H200.json to packages/epilora-kernels/src/epilora_kernels/configs/ afterwards.
set -uo pipefail
source tools/device/setup.sh
timeout "${TUNE_TIMEOUT:-540}" python3 benchmarks/tune.py --out-table "$OUT/NVIDIA_H200.json" \
  --out "$OUT/tune.json" --git-sha "${EPILORA_GIT_SHA:-}" 2>&1 | tee "$OUT/tune.log"
