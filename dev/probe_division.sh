#!/usr/bin/env bash
# One device call: characterize Triton's fp32 division (dev/probe_gpu_division.py) and dump the
# Triton code Inductor generates for vLLM's compiled QuantFP8, into $OUT.
set -uo pipefail
source tools/device/setup.sh
python3 dev/probe_gpu_division.py --out "$OUT/gpu_division.json"
TORCH_LOGS=output_code python3 - > "$OUT/inductor_quant_fp8.log" 2>&1 <<'PY'
import torch
from epilora_testing import vllm_oracles as v
x = torch.randn(7, 256, device="cuda", dtype=torch.bfloat16)
v.quant_fp8_compiled(x, "token")
v.quant_fp8_compiled(x, "token", scale_ub=torch.tensor([0.5], device="cuda"))
v.quant_fp8_compiled(x, "tensor")
v.quant_fp8_compiled(x, "tensor", scale=torch.tensor([0.5], device="cuda"))
PY
grep -n "def triton_\|tl.store\|/ \|reciprocal\|0.00223\|maximum\|minimum\|to(tl.float8" "$OUT/inductor_quant_fp8.log" | head -80
