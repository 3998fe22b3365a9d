"""Named special-value inputs for quantizer tests: the cases random data rarely hits.

Each builder returns a `[rows, cols]` tensor of the requested float dtype, all finite, designed
against the FP8 (e4m3fn, max 448) and NVFP4 (e2m1 x e4m3) grids. `special_activations(dtype)`
returns them all by name. Values are built on the fp32 grid of the target so that, after the
dtype cast, they still hit what the name says (a tie or a grid point +-1 ulp); where the cast
moves a value off its target the case is still valid input, only less sharp.
"""

import torch

FP8_MAX = 448.0
# e4m3fn magnitudes 2^-9 .. 448, each code's value (all 126 finite nonzero positive codes).
_E4M3_POSITIVE = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _ulp_neighbours(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    v = v.to(dtype)
    up = torch.nextafter(v, torch.full_like(v, float("inf")))
    down = torch.nextafter(v, torch.full_like(v, -float("inf")))
    return torch.stack((down, v, up), dim=-1).flatten()


def zero_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """All zeros: the scale floors at 1/(448*512), every code must be +0."""
    return torch.zeros(rows, cols, dtype=dtype)


def signed_zeros(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """+0.0 and -0.0 interleaved beside one 1.0 per row: sign bits of zero codes must match."""
    t = torch.zeros(rows, cols, dtype=dtype)
    t[:, 1::2] = -0.0
    t[:, 0] = 1.0
    return t


def subnormal_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the input dtype's subnormals (and its smallest normal): the scale floor's domain."""
    info = torch.finfo(dtype)
    tiny = torch.tensor(info.tiny, dtype=dtype)
    smallest = torch.nextafter(torch.tensor(0.0, dtype=dtype), tiny)
    steps = torch.linspace(1, 2 ** (info.bits - 8), cols, dtype=torch.float64)  # spread over them
    row = (smallest.double() * steps.round()).to(dtype)
    row[0] = tiny
    signs = torch.where(torch.arange(cols) % 3 == 0, -1.0, 1.0).to(dtype)
    return (row * signs).repeat(rows, 1)


def fp8_grid_neighbours(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Each row's max is 448 (scale exactly 1) and the rest are e4m3 grid points +-1 input ulp."""
    values = _ulp_neighbours(_E4M3_POSITIVE, dtype)
    values = values[values.abs() <= FP8_MAX]
    out = torch.empty(rows, cols, dtype=dtype)
    for r in range(rows):
        take = values[(torch.arange(cols) * (r + 1) * 7) % values.numel()]
        out[r] = take * torch.where(torch.arange(cols) % 2 == 0, 1.0, -1.0).to(dtype)
        out[r, 0] = FP8_MAX
    return out


def fp8_ties(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Midpoints between adjacent e4m3 values, with max 448 so the scale is 1: ties to even."""
    mids = (_E4M3_POSITIVE[:-1] + _E4M3_POSITIVE[1:]) / 2
    mids = mids[mids.to(dtype).float() == mids]  # keep ties the input dtype holds exactly
    out = torch.empty(rows, cols, dtype=dtype)
    for r in range(rows):
        out[r] = mids[(torch.arange(cols) + 3 * r) % mids.numel()].to(dtype)
        out[r, -1] = -FP8_MAX
    return out


def scaled_grid(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose max is not 448: x / scale lands near, not on, grid points and ties."""
    base = fp8_ties(rows, cols, dtype).float()
    factors = torch.tensor([3.0, 1e-3, 0.7, 123.456, 2.0**-10, 7e3])
    scaled = base * factors[torch.arange(rows) % factors.numel(), None]
    big = torch.finfo(dtype).max  # fp16 tops out at 65504: keep every case finite
    return scaled.clamp(-big, big).to(dtype)


def dtype_max_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows holding the input dtype's largest finite value, positive and negative."""
    big = torch.finfo(dtype).max
    out = torch.linspace(-1, 1, cols).repeat(rows, 1).to(dtype)
    out[:, 0] = big
    out[::2, -1] = -big
    return out


def one_huge_value(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Small values with one huge outlier per row: everything else rounds to zero or subnormal."""
    out = (torch.linspace(-1, 1, cols).repeat(rows, 1) * 1e-2).to(dtype)
    for r in range(rows):
        out[r, (r * 5) % cols] = (1e4 if dtype == torch.float16 else 1e30) * (-1) ** r
    return out


def e2m1_ties(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """NVFP4 rounding boundaries: with block max 6 a block scale is exact, values sit on ties."""
    pattern = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                            -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.1])
    return pattern.repeat(rows, -(-cols // 16))[:, :cols].to(dtype)


SPECIAL_ACTIVATIONS = {
    "zero_rows": zero_rows,
    "signed_zeros": signed_zeros,
    "subnormal_rows": subnormal_rows,
    "fp8_grid_neighbours": fp8_grid_neighbours,
    "fp8_ties": fp8_ties,
    "scaled_grid": scaled_grid,
    "dtype_max_rows": dtype_max_rows,
    "one_huge_value": one_huge_value,
    "e2m1_ties": e2m1_ties,
}


def special_activations(
    dtype: torch.dtype, rows: int = 4, cols: int = 64
) -> dict[str, torch.Tensor]:
    """Every named special case as a `[rows, cols]` tensor of `dtype` (cols a multiple of 16)."""
    return {name: build(rows, cols, dtype) for name, build in SPECIAL_ACTIVATIONS.items()}
