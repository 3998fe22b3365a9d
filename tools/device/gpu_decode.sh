#!/usr/bin/env bash
# One device call: the decode path's GPU tests, then benchmarks/decode.py, on the H200, into $OUT.
set -uo pipefail
source tools/device/setup.sh
timeout "${TESTS_TIMEOUT:-90}" python3 -m nox -s gpu-sm90 -- -k decode_gpu \
  --junitxml="$OUT/gpu-sm90-decode-junit.xml" 2>&1 | tee "$OUT/gpu-sm90-decode.log"
tests_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/decode.py --out "$OUT/decode.json" \
  --git-sha "${EPILORA_GIT_SHA:-}" 2>&1 | tee "$OUT/decode.log"
bench_rc=${PIPESTATUS[0]}
echo "decode tests exit ${tests_rc}; decode benchmark exit ${bench_rc}"
exit $(( tests_rc || bench_rc ))
