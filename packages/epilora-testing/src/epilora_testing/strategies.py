"""Hypothesis strategies for quantizer inputs.

Small tensors are drawn element by element as raw bit patterns, so hypothesis can shrink a
failure down to the few elements that matter. Larger ones are built from a drawn seed and a
drawn value distribution (never from an ambient `torch.randn`), so every example replays.
Both paths mix in the named special cases of `corpora`.
"""

import hypothesis.strategies as st
import torch

from epilora_testing.corpora import SPECIAL_ACTIVATIONS

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BITS_DTYPE = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


_EXPONENT_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}


def finite_bit_patterns(dtype: torch.dtype) -> st.SearchStrategy[int]:
    """Raw bit patterns (as signed ints of the dtype's width) of finite values of `dtype`."""
    bits = torch.finfo(dtype).bits
    mask = _EXPONENT_MASK[dtype]
    # All-ones exponent is Inf or NaN; everything else is finite.
    return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1).filter(
        lambda pattern: pattern & mask != mask
    )


@st.composite
def shapes(
    draw: st.DrawFn,
    *,
    max_rows: int = 33,
    col_multiple: int = 16,
    max_col_blocks: int = 8,
) -> tuple[int, int]:
    """`(rows, cols)`: 1..max_rows rows (M not a multiple of anything), cols a multiple."""
    rows = draw(st.integers(1, max_rows))
    cols = col_multiple * draw(st.integers(1, max_col_blocks))
    return rows, cols


_DISTRIBUTIONS = ("normal", "lognormal", "uniform_bits", "sparse", "outlier_rows")


def _from_seed(
    seed: int, distribution: str, rows: int, cols: int, dtype: torch.dtype, scale_exp: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if distribution == "normal":
        x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    elif distribution == "lognormal":
        mag = torch.exp(4 * torch.randn(rows, cols, generator=gen, dtype=torch.float64))
        sign = torch.randint(0, 2, (rows, cols), generator=gen) * 2 - 1
        x = mag * sign
    elif distribution == "uniform_bits":
        bits = torch.finfo(dtype).bits
        raw = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (rows, cols), generator=gen)
        x = raw.to(_BITS_DTYPE[dtype]).view(dtype).double()
        x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
        return x.to(dtype)  # already spans the dtype's range; no rescale
    elif distribution == "sparse":
        x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
        x = x * (torch.rand(rows, cols, generator=gen) < 0.1)
    else:  # rows of very different magnitude: per-token scales must not leak across rows
        x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
        x = x * torch.exp2(torch.randint(-20, 21, (rows, 1), generator=gen).double())
    x = x * 2.0**scale_exp
    return x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)


@st.composite
def activations(
    draw: st.DrawFn,
    *,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    max_rows: int = 33,
    col_multiple: int = 16,
    max_col_blocks: int = 8,
) -> torch.Tensor:
    """A finite `[rows, cols]` float tensor: drawn bits, a seeded distribution or a corpus case.

    The draws (dtype, shape, source, seed, distribution or case name) are what hypothesis
    prints for a failing example, so it replays from the report alone.
    """
    dtype = draw(st.sampled_from(dtypes))
    rows, cols = draw(shapes(max_rows=max_rows, col_multiple=col_multiple,
                             max_col_blocks=max_col_blocks))
    source = draw(st.sampled_from(("bits", "seeded", "special")))
    if source == "bits":
        n = rows * cols
        if n > 256:  # keep element-wise draws small; hypothesis shrinks them best
            rows = max(1, 256 // cols)
            n = rows * cols
        pattern = draw(st.lists(finite_bit_patterns(dtype), min_size=n, max_size=n))
        return torch.tensor(pattern, dtype=_BITS_DTYPE[dtype]).view(dtype).reshape(rows, cols)
    if source == "seeded":
        seed = draw(st.integers(0, 2**32 - 1))
        distribution = draw(st.sampled_from(_DISTRIBUTIONS))
        scale_exp = draw(st.integers(-30, 20))
        return _from_seed(seed, distribution, rows, cols, dtype, scale_exp)
    name = draw(st.sampled_from(sorted(SPECIAL_ACTIVATIONS)))
    return SPECIAL_ACTIVATIONS[name](rows, cols, dtype)


def positive_fp32_scales(min_exp: int = -20, max_exp: int = 20) -> st.SearchStrategy[float]:
    """Finite positive fp32 scales over a range of binades, with arbitrary mantissas."""
    return st.floats(
        min_value=2.0**min_exp, max_value=2.0**max_exp, allow_nan=False, allow_infinity=False,
        width=32,
    )
