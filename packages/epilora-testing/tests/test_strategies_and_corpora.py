import torch
from hypothesis import given

from epilora_testing.corpora import SPECIAL_ACTIVATIONS, fp8_grid_neighbours, fp8_ties
from epilora_testing.strategies import FLOAT_DTYPES, activations, finite_bit_patterns, shapes


@given(x=activations())
def test_activations_are_finite_2d_float_tensors_with_block_columns(x):
    assert x.ndim == 2 and x.shape[0] >= 1 and x.shape[1] % 16 == 0
    assert x.dtype in FLOAT_DTYPES
    assert bool(torch.isfinite(x).all())


@given(rows_cols=shapes(max_rows=5, col_multiple=128, max_col_blocks=2))
def test_shapes_respect_bounds(rows_cols):
    rows, cols = rows_cols
    assert 1 <= rows <= 5 and cols in (128, 256)


@given(pattern=finite_bit_patterns(torch.bfloat16))
def test_bit_patterns_are_finite(pattern):
    value = torch.tensor([pattern], dtype=torch.int16).view(torch.bfloat16)
    assert bool(torch.isfinite(value).all())


def test_every_corpus_case_is_finite_in_every_dtype():
    for dtype in FLOAT_DTYPES:
        for name, build in SPECIAL_ACTIVATIONS.items():
            x = build(3, 64, dtype)
            assert x.shape == (3, 64) and x.dtype == dtype, name
            assert bool(torch.isfinite(x).all()), (name, dtype)


def test_fp8_ties_are_exact_midpoints_of_the_e4m3_grid():
    x = fp8_ties(2, 64, torch.float32)[:, :-1].flatten().abs()
    down = x.to(torch.float8_e4m3fn).float()
    # each value is halfway between two neighbouring e4m3 values, one of which it rounds to
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    lower = grid[torch.searchsorted(grid, x) - 1]
    upper = grid[torch.searchsorted(grid, x)]
    assert bool(((lower + upper) / 2 == x).all())
    assert bool(((down == lower) | (down == upper)).all())


def test_grid_neighbours_pin_the_row_scale_to_one():
    x = fp8_grid_neighbours(3, 64, torch.bfloat16)
    assert bool((x.abs().amax(dim=1).float() == 448.0).all())
