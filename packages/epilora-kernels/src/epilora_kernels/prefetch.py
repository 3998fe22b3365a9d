"""`L2Prefetch`: the weight of the caller's next projection, which the decode path's GEMM (K2)
pulls into L2 once its own weight stream is over.

Why: at decode sizes an engine's FP8 GEMMs stream their weights from HBM, and between two of
them the engine runs work that moves few bytes (attention over a short context, a norm, the
SiLU and its quantization), so HBM idles there. The next projection's weight depends on nothing
the engine computes, so K2's programs, past their K loop, issue `prefetch.global.L2` for it (an
instruction a 128-byte line, nothing written, nothing waited for), and the next GEMM finds in L2
what the budget covered. It is a hint: the results are the same bits with or without it.

Which bytes: the first lines of every row, as many as `max_bytes` allows spread over the rows.
Each program of the next GEMM streams whole rows along K, so every program then starts its K
loop from L2; whole rows for some programs would leave the others, from HBM, setting the
kernel's end.

Untimed so far (no GPU in the session that built it); the vLLM plugin uses it only where asked
(`EPILORA_VLLM_PREFETCH_MIB`).
"""

import dataclasses

import torch

LINE_BYTES = 128  # what one `prefetch.global.L2` brings in


@dataclasses.dataclass(frozen=True, eq=False)
class L2Prefetch:
    """Pull up to `max_bytes` of `tensor` (the next projection's weight `[N, K]`, rows
    contiguous) into L2 after this projection's weight stream: the first
    `max_bytes // N` bytes of every row, in whole 128-byte lines."""

    tensor: torch.Tensor
    max_bytes: int

    def __post_init__(self) -> None:
        tensor, budget = self.tensor, self.max_bytes
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2:
            raise ValueError("L2Prefetch takes the next projection's weight, a 2-D tensor; got "
                             f"{type(tensor).__name__} of shape {getattr(tensor, 'shape', '?')}")
        if tensor.stride(1) != 1:
            raise ValueError(f"L2Prefetch reads whole rows: the tensor's rows must be contiguous "
                             f"(strides {tuple(tensor.stride())})")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"max_bytes must be a non-negative int, got {budget!r}")

    @property
    def geometry(self) -> tuple[int, int, int]:
        """(rows, bytes from one row's start to the next's, lines pulled from each row's
        start); no lines where the budget does not reach one line a row."""
        rows, columns = self.tensor.shape
        size = self.tensor.element_size()
        per_row = min(columns * size, self.max_bytes // rows) if rows else 0
        return rows, self.tensor.stride(0) * size, per_row // LINE_BYTES

    @property
    def nbytes(self) -> int:
        """The bytes it pulls in."""
        rows, _, lines = self.geometry
        return rows * lines * LINE_BYTES

    def bytes_view(self) -> torch.Tensor:
        """The tensor as bytes: what the kernel addresses, a byte at a time."""
        return self.tensor.view(torch.uint8)


def active_geometry(prefetch: "L2Prefetch | None", device: torch.device
                    ) -> tuple[int, int, int] | None:
    """`prefetch`'s geometry where it pulls in anything, else None; a tensor on another device
    than the projection's is refused."""
    if prefetch is None:
        return None
    if not isinstance(prefetch, L2Prefetch):
        raise ValueError(f"prefetch must be an epilora_kernels.L2Prefetch, got "
                         f"{type(prefetch).__name__}")
    if prefetch.tensor.device != device:
        raise ValueError(f"the prefetch's tensor is on {prefetch.tensor.device}, the "
                         f"projection on {device}")
    geometry = prefetch.geometry
    return geometry if geometry[0] and geometry[2] else None
