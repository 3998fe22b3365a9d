"""The approximate fp32 reciprocal of Triton-compiled code on Hopper GPUs, reproduced exactly.

Triton lowers fp32 `a / b` to PTX `div.full.f32`, and Inductor lowers `x.reciprocal()` to Triton
`1 / x`. On an H200 (sm_90), measured by dev/probe_gpu_division.py:

* `a / b` equals `fl32(a * r(b))` bit for bit, where r(b) is the hardware's `1 / b`;
* r(b) is within 1 ulp of the correctly rounded reciprocal: it differs for part of the 2^23
  mantissas (counts in benchmarks/results/h200/gpu_division.json), by -1 or +1 ulp, and depends
  on the mantissa only (the same in every binade whose result is a normal number).

So r(b) = (correctly rounded 1 / b) adjusted by a per-mantissa table of -1/0/+1 ulp, shipped as
`data/rcp_approx_sm90.bin.xz` (built by tools/build_rcp_table.py, loaded on first use). This is
what lets epilora-quant reproduce vLLM's default (compiled) FP8 quantizer on any device.
"""

import functools
import lzma
from importlib import resources

import torch

_MANTISSAS = 1 << 23
_MANTISSA_MASK = _MANTISSAS - 1
# |b| in [2^-126, 2^126): b and 1/b are both normal, where the table was measured to hold.
_MIN_NORMAL = 2.0**-126
_MAX_TABLE = 2.0**126


@functools.cache
def _ulp_adjustment_on(device: torch.device) -> torch.Tensor:
    # One copy per device: the table is 32 MiB as int32, too much to move on every call.
    return _ulp_adjustment().to(device)


@functools.cache
def _ulp_adjustment() -> torch.Tensor:
    """int32 `[2^23]`: the approximate reciprocal's offset in ulp from the rounded one."""
    raw = lzma.decompress(
        resources.files("epilora_quant").joinpath("data/rcp_approx_sm90.bin.xz").read_bytes()
    )
    packed = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(2, _MANTISSAS).to(torch.int32)
    return bits[1] - bits[0]  # +1 bitmap minus the -1 bitmap


def triton_reciprocal_sm90(b: torch.Tensor) -> torch.Tensor:
    """`1 / b` as Triton computes it on sm_90 (float32 in, float32 out, same device).

    Raises ValueError for |b| outside [2^-126, 2^126) or non-finite b, where the table was not
    measured (the reciprocal or b itself would be subnormal).
    """
    if b.dtype != torch.float32:
        raise TypeError(f"b.dtype must be torch.float32, got {b.dtype}")
    magnitude = b.abs()
    if not bool(((magnitude >= _MIN_NORMAL) & (magnitude < _MAX_TABLE)).all()):
        raise ValueError(
            "triton_reciprocal_sm90 is exact only for 2^-126 <= |b| < 2^126; got values "
            f"from {magnitude.min().item()!r} to {magnitude.max().item()!r}"
        )
    rounded = torch.reciprocal(b)  # correctly rounded on CPU and CUDA
    table = _ulp_adjustment_on(b.device)
    offset = table[(b.view(torch.int32) & _MANTISSA_MASK).long()]
    return (rounded.view(torch.int32) + offset).view(torch.float32)


def triton_divide_sm90(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a / b` as Triton computes it on sm_90: `a * (1 / b)` with the approximate reciprocal."""
    return a * triton_reciprocal_sm90(b)
