"""`L2Prefetch`: which lines of the next weight the decode path's GEMM pulls into L2, that the
calls carrying one compute the same bits as those without (the interpreter issues no prefetch,
so this checks the plumbing and the results; the sm_90 PTX is checked in
test_compile_sm90.py), and clear errors for a bad one."""

import pytest
import torch
import triton
import triton.language as tl

import epilora_kernels as ek
from epilora_kernels import _fused_kernels, fused
from epilora_kernels.prefetch import LINE_BYTES, active_geometry
from epilora_testing import assert_bitwise_equal

from kernel_cases import make_problem


def next_weight(rows: int, columns: int, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    return torch.zeros(rows, columns, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize(("rows", "columns", "budget", "lines"), [
    (64, 4096, 64 * 4096, 32),  # the whole weight
    (64, 4096, 10**9, 32),  # a budget past the weight: the whole weight
    (64, 4096, 64 * 1000, 7),  # 1000 bytes a row: 7 whole lines
    (64, 4096, 64 * 127, 0),  # under a line a row: nothing
    (24576, 4096, 24 << 20, 8),  # gate_up's 96 MiB under a 24 MiB budget: 1 KiB a row
])
def test_the_budget_is_spread_over_every_rows_first_lines(rows, columns, budget, lines):
    prefetch = ek.L2Prefetch(next_weight(rows, columns), budget)
    assert prefetch.geometry == (rows, columns, lines)
    assert prefetch.nbytes == rows * lines * LINE_BYTES <= budget
    assert active_geometry(prefetch, torch.device("cpu")) == (
        None if lines == 0 else (rows, columns, lines))


def test_the_geometry_is_in_bytes_for_wider_elements_and_strided_rows():
    padded = torch.zeros(8, 300, dtype=torch.bfloat16)[:, :256]  # rows 600 bytes apart
    prefetch = ek.L2Prefetch(padded, 8 * 512)
    assert prefetch.geometry == (8, 600, 4)
    assert prefetch.bytes_view().shape == (8, 512) and prefetch.bytes_view().dtype == torch.uint8


@pytest.mark.parametrize(("tensor", "budget", "message"), [
    (torch.zeros(16), 1024, "a 2-D tensor"),
    (torch.zeros(16, 32).t(), 1024, "rows must be contiguous"),
    (torch.zeros(16, 32), -1, "non-negative int"),
    (torch.zeros(16, 32), True, "non-negative int"),
    (torch.zeros(16, 32), 1.5, "non-negative int"),
])
def test_a_bad_prefetch_is_a_clear_error(tensor, budget, message):
    with pytest.raises(ValueError, match=message):
        ek.L2Prefetch(tensor, budget)


@triton.jit
def _lines_of_every_program(out_ptr, seen_ptr, base_ptr, rows, row_stride, row_lines,
                            BLOCK: tl.constexpr):
    # What `_prefetch_next` would prefetch, stored instead: each line's offset from the
    # tensor's start, at the line's number, and how many programs reached that number.
    programs = tl.num_programs(0)
    for first in range(tl.program_id(0) * BLOCK, rows * row_lines, programs * BLOCK):
        ptrs, inside = _fused_kernels._next_lines(base_ptr, first, rows, row_stride, row_lines,
                                                  BLOCK)
        i = first + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, ptrs.to(tl.int64) - base_ptr.to(tl.int64), mask=inside)
        tl.atomic_add(seen_ptr + i, 1, mask=inside)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_the_grid_prefetches_every_chosen_line_once_and_nothing_else(programs):
    rows, row_stride, row_lines, block = 37, 600, 4, 32
    base = torch.zeros(rows * row_stride, dtype=torch.uint8)
    out = torch.full((rows * row_lines,), -1, dtype=torch.int64)
    seen = torch.zeros(rows * row_lines, dtype=torch.int32)
    _lines_of_every_program[(programs,)](out, seen, base, rows, row_stride, row_lines,
                                         BLOCK=block)
    want = torch.tensor([r * row_stride + line * LINE_BYTES for r in range(rows)
                         for line in range(row_lines)])
    assert torch.equal(out, want)
    assert torch.equal(seen, torch.ones_like(seen))


@pytest.mark.parametrize("codes_only", [False, True])
@pytest.mark.parametrize("tokens", [1, 9])
def test_a_call_that_prefetches_computes_the_same_bits(tokens, codes_only):
    x, weight, w_scale, lora, batch = make_problem(31, tokens, 64, (32, 16, 16), 16, 3,
                                                   "mixed_with_base")
    prefetch = ek.L2Prefetch(next_weight(48, 64), 48 * 128)
    quantized = ek.quantize(x)
    given = None if codes_only else x
    want = ek.decode_lora_fp8_linear(given, weight, w_scale, lora, batch, x_quantized=quantized)
    got = ek.decode_lora_fp8_linear(given, weight, w_scale, lora, batch, x_quantized=quantized,
                                    prefetch=prefetch)
    assert_bitwise_equal(got, want, name="decode with a prefetch")
    for path in ("decode", "fused", None):
        assert_bitwise_equal(
            ek.lora_linear(given, weight, w_scale, lora, batch, path=path,
                           x_quantized=quantized, prefetch=prefetch),
            ek.lora_linear(given, weight, w_scale, lora, batch, path=path,
                           x_quantized=quantized), name=f"{path} with a prefetch")
    projection = ek.LoraProjection(weight, w_scale, lora, prefetch=prefetch)
    assert_bitwise_equal(projection(given, batch, path="decode", x_quantized=quantized), want,
                         name="projection with a prefetch")


def test_a_prefetch_on_another_device_is_refused_before_any_launch(monkeypatch):
    x, weight, w_scale, lora, batch = make_problem(32, 4, 64, (32,), 16, 2, "one_adapter")
    elsewhere = ek.L2Prefetch(torch.empty(32, 64, dtype=torch.float8_e4m3fn, device="meta"),
                              4096)
    launched = []
    monkeypatch.setattr(fused._launchers, "launch_k1", lambda *a, **k: launched.append(a))
    for call in (lambda: ek.decode_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                   prefetch=elsewhere),
                 lambda: ek.lora_linear(x, weight, w_scale, lora, batch, path="fused",
                                        prefetch=elsewhere),
                 lambda: ek.LoraProjection(weight, w_scale, lora, prefetch=elsewhere)):
        with pytest.raises(ValueError, match="the prefetch's tensor is on meta"):
            call()
    with pytest.raises(ValueError, match="must be an epilora_kernels.L2Prefetch"):
        ek.lora_linear(x, weight, w_scale, lora, batch, prefetch=weight)
    assert not launched
