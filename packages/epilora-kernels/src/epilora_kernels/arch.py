"""What the device can run: the architecture gates of every path and feature.

* FP8 MMA (`tl.dot` of float8e4nv operands, and the FP8 -> bf16 widening of W8A16): sm_89+
  (Ada, Hopper). Older GPUs run none of the FP8 paths.
* PDL (programmatic dependent launch, `gdc_wait`) and TMA descriptors: sm_90 (Hopper). The
  decode path needs PDL (K2 runs beside K1); the fused path launches K2 plainly without it, and
  tiles read by pointer loads without TMA.
* Triton's CPU interpreter (`TRITON_INTERPRET=1`, tests): no PDL intrinsics (the decode path
  runs its launches one after the other, its counters still counted), TMA emulated.

`device_support(device)` answers for one device; the launchers and `epilora_kernels.supports`
ask it, so a path that cannot run is refused with its reason before any kernel launches.
"""

import functools
from dataclasses import dataclass

import torch

from epilora_kernels import _env


@dataclass(frozen=True)
class DeviceSupport:
    """The features of one device the kernels use."""

    name: str  # the device's name, or "triton-interpreter"
    capability: tuple[int, int] | None  # (major, minor); None under the interpreter
    fp8_mma: bool
    pdl: bool
    tma: bool
    interpreter: bool

    @property
    def arch(self) -> str:
        """`sm90`-style name, the key of the launch tables' architecture fallback."""
        if self.capability is None:
            return "interpreter"
        return f"sm{self.capability[0]}{self.capability[1]}"


INTERPRETER = DeviceSupport("triton-interpreter", None, fp8_mma=True, pdl=False, tma=True,
                            interpreter=True)


@functools.cache
def _cuda_support(index: int) -> DeviceSupport:
    # Asked on every call: the device's properties are fixed for the process.
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceSupport(torch.cuda.get_device_name(index), (major, minor),
                         fp8_mma=(major, minor) >= (8, 9), pdl=major >= 9, tma=major >= 9,
                         interpreter=False)


def device_support(device: torch.device | str | None = None) -> DeviceSupport:
    """The features of `device` (default: the current CUDA device, or the interpreter when
    there is none or TRITON_INTERPRET=1)."""
    if _env.triton_interpreter():
        return INTERPRETER
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
        return _cuda_support(device.index)  # a CUDA tensor's device: asked several times a call
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError("no CUDA device, and the Triton interpreter is off "
                                   "(TRITON_INTERPRET=1 runs the kernels on the CPU, slowly)")
        index = device.index if device is not None and device.index is not None \
            else torch.cuda.current_device()
        return _cuda_support(index)
    raise UnsupportedError(f"tensors on {device}: the kernels run on CUDA devices (or on the "
                           "CPU under TRITON_INTERPRET=1); the torch references in "
                           "epilora_kernels.reference run anywhere")


class UnsupportedError(ValueError):
    """A path, device or input the kernels cannot serve; the message says why."""
