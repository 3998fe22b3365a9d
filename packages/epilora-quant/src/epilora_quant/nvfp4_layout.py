"""NVFP4 storage layouts: e2m1 codes packed two per byte, and the swizzled block-scale tiles.

* Codes: element 2j is the low nibble and 2j+1 the high nibble of byte j (vLLM's
  `break_fp4_bytes`); within a nibble bit 3 is the sign and bits 0-2 index
  `formats.E2M1_GRID`.
* Scales (`swizzle_blockscale`): the `[M, K/16]` e4m3 scales are zero-padded to
  `[round_up(M, 128), round_up(K/16, 4)]` and stored tile by tile, 128 rows x 4 columns per 512-byte
  tile, row r of a tile at byte `(r % 32) * 16 + (r // 32) * 4 + column`. Tiles are ordered
  row-tile major. This is the layout CUTLASS's FP4 GEMMs and `scaled_fp4_quant` use.
"""

import torch

from epilora_quant.formats import E2M1_GRID, NVFP4_SCALE_TILE_COLS, NVFP4_SCALE_TILE_ROWS

_SIGN = 0x8


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of float32 values that lie exactly on the signed e2m1 grid."""
    magnitude = values.abs()
    grid = torch.tensor(E2M1_GRID, dtype=values.dtype, device=values.device)
    index = torch.searchsorted(grid, magnitude.contiguous())
    if bool((index >= len(E2M1_GRID)).any()) or not bool(
        (grid[index.clamp(max=len(E2M1_GRID) - 1)] == magnitude).all()
    ):
        raise ValueError("values must lie on the e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (signed)")
    return (index | (torch.signbit(values).to(index.dtype) * _SIGN)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 codes (uint8, 0..15); code 8 decodes to -0.0."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    magnitude = grid[(codes & 0x7).long()]
    return torch.where((codes & _SIGN) != 0, -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack `[M, K]` codes (uint8, 0..15, K even) into `[M, K/2]` bytes, even element low."""
    if codes.dtype != torch.uint8 or codes.ndim != 2 or codes.shape[1] % 2:
        raise ValueError(f"codes must be 2-D uint8 with an even last dim, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if bool((codes > 0xF).any()):
        raise ValueError("codes must be 4-bit values (0..15)")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack `[M, K/2]` bytes into `[M, K]` codes (uint8, 0..15)."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(f"packed must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def swizzled_scale_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Shape of the swizzled scale tensor for `[rows, scale_cols]` linear scales."""
    tr, tc = NVFP4_SCALE_TILE_ROWS, NVFP4_SCALE_TILE_COLS
    return -(-rows // tr) * tr, -(-scale_cols // tc) * tc


def swizzle_nvfp4_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear `[M, K/16]` e4m3 scales to vLLM's swizzled, zero-padded layout (same device)."""
    if scales.dtype != torch.float8_e4m3fn or scales.ndim != 2:
        raise ValueError(
            f"scales must be 2-D float8_e4m3fn, got {scales.dtype} {tuple(scales.shape)}"
        )
    rows, cols = scales.shape
    rows_p, cols_p = swizzled_scale_shape(rows, cols)
    padded = torch.zeros((rows_p, cols_p), dtype=scales.dtype, device=scales.device)
    padded[:rows, :cols] = scales
    tiles = padded.view(rows_p // 128, 4, 32, cols_p // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(rows_p, cols_p)


def unswizzle_nvfp4_scales(swizzled: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of `swizzle_nvfp4_scales`: the `[rows, scale_cols]` linear scales."""
    rows_p, cols_p = swizzled_scale_shape(rows, scale_cols)
    if swizzled.ndim != 2 or tuple(swizzled.shape) != (rows_p, cols_p):
        raise ValueError(
            f"swizzled scales for {rows} x {scale_cols} must have shape {(rows_p, cols_p)}, "
            f"got {tuple(swizzled.shape)}"
        )
    tiles = swizzled.reshape(rows_p // 128, cols_p // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rows_p, cols_p)[:rows, :scale_cols]
