"""Format constants shared by every quantizer, each with the value vLLM 0.26.0 uses.

Provenance: `vllm/model_executor/layers/quantization/input_quant_fp8.py` (`_FP8_MAX`,
`_FP8_MIN_SCALING_FACTOR`), `utils/nvfp4_emulation_utils.py` (`FLOAT4_E2M1_MAX`, the e2m1 grid),
`utils/nvfp4_utils.py` (the 128x4 scale tile). Only OCP e4m3fn is covered: ROCm's e4m3fnuz
(max 224 in vLLM) is out of scope.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max: 0x7E = 1.75 * 2^8
FP8_MIN = -448.0
# Floor of every dynamic FP8 scale vLLM computes per token (both its native and CUDA paths):
# 1 / (448 * 512), about 4.36e-6, so an all-zero row gets a finite, nonzero scale.
FP8_MIN_SCALING_FACTOR = 1.0 / (FP8_MAX * 512.0)

E2M1_MAX = 6.0  # largest e2m1 magnitude: 1.5 * 2^2
# fp32(1/6) = 0x3E2AAAAB: vLLM multiplies by this rather than dividing by 6.
E2M1_MAX_RECIPROCAL = 1.0 / E2M1_MAX
# Magnitudes of the 8 e2m1 codes 0..7 (bit 3 is the sign).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

NVFP4_BLOCK_SIZE = 16  # elements per e4m3 block scale
# Swizzled NVFP4 scales come in tiles of 128 rows x 4 scale columns (512 bytes).
NVFP4_SCALE_TILE_ROWS = 128
NVFP4_SCALE_TILE_COLS = 4

FP8_WEIGHT_BLOCK = (128, 128)  # the block shape of vLLM's block-FP8 weights
