#!/usr/bin/env bash
# One device call: the GPU test session (gpu-sm90) and the vLLM-paths survey, on the H200.
# Run from the repository root on the GPU machine, with `.device` carried (vLLM bundle, nox
# wheels and our wheels from tools/device/prepare.sh). Everything it produces lands in $OUT.
set -uo pipefail
source tools/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout -s INT -k 30 "${TESTS_TIMEOUT:-400}" python3 -m nox -s gpu-sm90 -- "$@" 2>&1 | tee "$OUT/gpu-sm90.log"
tests_rc=${PIPESTATUS[0]}
timeout "${PATHS_TIMEOUT:-150}" python3 tools/vllm_quant_paths.py --out "$OUT/quant_paths.json" \
  --git-sha "${EPILORA_GIT_SHA:-}" 2>&1 | tee "$OUT/quant_paths.log"
paths_rc=${PIPESTATUS[0]}
echo "gpu-sm90 exit ${tests_rc}; vllm_quant_paths exit ${paths_rc}"
exit $(( tests_rc || paths_rc ))
