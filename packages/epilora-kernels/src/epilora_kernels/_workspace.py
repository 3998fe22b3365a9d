"""The counters the kernels synchronize with: one int32 buffer per device and stream, zero at
rest.

Split-K tiles (K1's and K2's) count their arriving splits, and the decode path's K2 counts the
rows K1 has quantized (`READY` and `PASSED`, the first two entries). Every kernel leaves the
counters it used at zero (the last to arrive resets them), so no launch needs a memset before
it: the scheme of the lock workspace of vLLM's Marlin kernels. Ops on one stream run one after
another and a kernel touches tile counters only once the kernel before it is complete (K2 under
PDL: after its wait), so every launch starts at the same offset; a buffer per stream keeps two
streams' ops apart.
"""

import torch

READY = 0  # rows quantized by K1 (decode path)
PASSED = 1  # K2 programs past their wait on READY
TILES = 2  # first split-K tile counter

_MIN_SIZE = 4096
_buffers: dict[tuple[str, int | None, int], torch.Tensor] = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The zeroed counter buffer of `device` and its current stream, with room for `tiles`
    tile counters after READY and PASSED (grown, zeroed, when a launch needs more)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < TILES + tiles:
        buf = torch.zeros(max(_MIN_SIZE, 2 * (TILES + tiles)), dtype=torch.int32, device=device)
        _buffers[key] = buf
    return buf
