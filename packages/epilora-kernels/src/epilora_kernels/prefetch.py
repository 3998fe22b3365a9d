"""`L2Prefetch`: the weight of the caller's next projection, which the decode path's GEMM (K2)
pulls into L2 once its own weight stream is over.

Why: at decode sizes an engine's FP8 GEMMs stream their weights from HBM, and between two of
them the engine runs work that moves few bytes (attention over a short context, a norm, the
SiLU and its quantization), so HBM idles there. The next projection's weight depends on nothing
the engine computes, so K2's programs, past their K loop, issue `prefetch.global.L2` for it (an
instruction a 128-byte line, nothing written, nothing waited for), and the next GEMM finds in L2
what the budget covered. It is a hint: the results are the same bits with or without it.

Which bytes: as many lines of every row as `max_bytes` allows spread over the rows, taken in
turn from the row's start and from its middle (`split_at`). Each program of the next GEMM
streams its rows along K, from the row's start or, where its K loop is split in two (the
decode settings split K in one or two), from the second split's start: so every program starts
its K loop from L2. Whole rows for some programs would leave the others, from HBM, setting the
kernel's end. (In the plugin's default mode the next GEMM warms nothing itself: its own
`DECODE_WARM_L2` prefetch runs only while it waits for K1's codes.)

When: `at="end"`, past this GEMM's K loop, so that HBM works during the engine's kernels
between the two GEMMs (their loads may then wait behind the prefetches); `at="start"`, before
the K loop, so that the prefetches share this GEMM's stream: at decode sizes the small
projections' GEMMs are latency-bound (qkv's and o's at about 2 TB/s on the H200, of the ~3.7
gate_up reaches) and leave HBM room. Those lines are marked evicted last
(`prefetch.global.L2::evict_last`), so that the GEMM's own lines, read once, make the room.

Timed at layer level on the H200 (no gain: docs/kernels-history.md, item 59), its engine step
not; the vLLM plugin uses it only where asked (`EPILORA_VLLM_PREFETCH_MIB`,
`EPILORA_VLLM_PREFETCH_AT`).
"""

import dataclasses

import torch

LINE_BYTES = 128  # what one `prefetch.global.L2` brings in
WHEN = {"end": 1, "start": 2}  # the kernel's PREFETCH
SPLIT_ALIGN = 256  # K2's decode K tiles (256 or 512 deep) put a 2-way split's start on this
# many columns (`_lora_gemm_kernel`: each split `cdiv(cdiv(K, 2), BLOCK_K) * BLOCK_K` deep)


@dataclasses.dataclass(frozen=True, eq=False)
class L2Prefetch:
    """Pull up to `max_bytes` of `tensor` (the next projection's weight `[N, K]`, rows
    contiguous) into L2 after this projection's weight stream: `max_bytes // N` bytes of every
    row in whole 128-byte lines, half from the row's start and half from `split_at`; `at`:
    past this GEMM's K loop (`end`) or before it (`start`)."""

    tensor: torch.Tensor
    max_bytes: int
    at: str = "end"

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
        if self.at not in WHEN:
            raise ValueError(f"at must be one of {tuple(WHEN)}, got {self.at!r}")

    @property
    def row_bytes(self) -> int:
        return self.tensor.shape[1] * self.tensor.element_size()

    @property
    def split_at(self) -> int:
        """Where in a row the second half of its lines start: where a GEMM whose K loop is
        split in two starts its second split (`K/2` rounded up to K2's K tiles); in rows too
        short for a split, their middle line."""
        half = -(-self.tensor.shape[1] // 2)
        split = -(-half // SPLIT_ALIGN) * SPLIT_ALIGN * self.tensor.element_size()
        if split + LINE_BYTES > self.row_bytes:
            return self.row_bytes // 2 // LINE_BYTES * LINE_BYTES
        return split

    @property
    def geometry(self) -> tuple[int, int, int, int, int]:
        """(rows, bytes from one row's start to the next's, lines pulled from each row, where
        the second half of them start, the row's bytes): the kernel's `PF_*` arguments. No
        lines where the budget does not reach one line a row."""
        rows = self.tensor.shape[0]
        row_bytes = self.row_bytes
        per_row = min(row_bytes, self.max_bytes // rows) if rows else 0
        return (rows, self.tensor.stride(0) * self.tensor.element_size(),
                per_row // LINE_BYTES, self.split_at, row_bytes)

    def _row_offsets(self) -> list[int]:
        # The pulled lines' offsets within a row, in the kernel's order (`_next_lines`).
        _, _, lines, half, row_bytes = self.geometry
        return [offset for line in range(lines)
                if (offset := (line % 2) * half + (line // 2) * LINE_BYTES) < row_bytes]

    def offsets(self) -> list[int]:
        """Each pulled line's byte offset in the tensor, in the kernel's numbering (what its
        tests compare the kernel's with)."""
        rows, stride = self.tensor.shape[0], self.geometry[1]
        in_row = self._row_offsets()
        return [row * stride + offset for row in range(rows) for offset in in_row]

    @property
    def nbytes(self) -> int:
        """The bytes it pulls in."""
        return self.tensor.shape[0] * len(self._row_offsets()) * LINE_BYTES

    def bytes_view(self) -> torch.Tensor:
        """The tensor as bytes: what the kernel addresses, a byte at a time."""
        return self.tensor.view(torch.uint8)


def kernel_args(prefetch: "L2Prefetch | None", device: torch.device
                ) -> tuple[int, int, int, int, int, int] | None:
    """K2's `PREFETCH` and `PF_*` arguments for `prefetch` (when, then its geometry) where it
    pulls in anything, else None; a tensor on another device than the projection's is
    refused."""
    if prefetch is None:
        return None
    if not isinstance(prefetch, L2Prefetch):
        raise ValueError(f"prefetch must be an epilora_kernels.L2Prefetch, got "
                         f"{type(prefetch).__name__}")
    if prefetch.tensor.device != device:
        raise ValueError(f"the prefetch's tensor is on {prefetch.tensor.device}, the "
                         f"projection on {device}")
    geometry = prefetch.geometry
    return (WHEN[prefetch.at], *geometry) if geometry[0] and geometry[2] else None
