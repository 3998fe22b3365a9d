#!/usr/bin/env bash
# One device call: epilora-kernels' GPU tests, then the layer benchmark, on the H200, into $OUT.
# Run from the repository root with `.device` carried (tools/device/prepare.sh).
set -uo pipefail
source tools/device/setup.sh
timeout "${TESTS_TIMEOUT:-240}" python3 -m nox -s gpu-sm90 -- -k fused_gpu \
  --junitxml="$OUT/gpu-sm90-kernels-junit.xml" 2>&1 | tee "$OUT/gpu-sm90-kernels.log"
tests_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/layer.py --out "$OUT/layer.json" \
  --git-sha "${EPILORA_GIT_SHA:-}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/layer.log"
bench_rc=${PIPESTATUS[0]}
echo "kernel tests exit ${tests_rc}; layer benchmark exit ${bench_rc}"
exit $(( tests_rc || bench_rc ))
