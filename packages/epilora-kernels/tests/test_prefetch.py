"""`L2Prefetch`: which lines of the next weight the decode path's GEMM pulls into L2 (its
programs' loop run under the interpreter, recording instead of prefetching), that calls
carrying one launch through every entry point and give the results of calls without (the
interpreter issues no prefetch: the same bits there say nothing of the GPU's, which
tests/gpu/test_api_gpu.py checks; the sm_90 PTX is checked in test_compile_sm90.py), and clear
errors for a bad one."""

import pytest
import torch
import triton
import triton.language as tl

import epilora_kernels as ek
from epilora_kernels import _fused_kernels, fused
from epilora_kernels.prefetch import LINE_BYTES, kernel_args
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
def test_the_budget_is_spread_over_every_rows_lines(rows, columns, budget, lines):
    prefetch = ek.L2Prefetch(next_weight(rows, columns), budget)
    assert prefetch.geometry == (rows, columns, lines, columns // 2, columns)
    assert prefetch.nbytes == rows * lines * LINE_BYTES <= budget
    assert kernel_args(prefetch, torch.device("cpu")) == (
        None if lines == 0 else (1, *prefetch.geometry))
    early = ek.L2Prefetch(prefetch.tensor, budget, at="start")  # before the K loop: PREFETCH 2
    assert kernel_args(early, torch.device("cpu")) == (
        None if lines == 0 else (2, *prefetch.geometry))


def test_half_the_lines_start_where_a_two_way_split_of_k_starts():
    # K2's decode settings split K in one or two (down, and qkv at one token, on the H200's
    # table): the second split's programs start at K/2 rounded up to 256 (the K tiles), where
    # they find the other half of each row's lines. 3000 columns split at 1536.
    prefetch = ek.L2Prefetch(next_weight(2, 3000), 2 * 4 * LINE_BYTES)
    assert prefetch.split_at == 1536
    assert prefetch.nbytes == len(prefetch.offsets()) * LINE_BYTES
    assert prefetch.offsets() == [0, 1536, 128, 1664, 3000, 4536, 3128, 4664]
    whole = ek.L2Prefetch(next_weight(1, 3000), 1 << 20)  # the whole row's 23 whole lines
    assert whole.offsets() == [0, 1536, 128, 1664, 256, 1792, 384, 1920, 512, 2048, 640, 2176,
                               768, 2304, 896, 2432, 1024, 2560, 1152, 2688, 1280, 2816, 1408]
    # taken in turn from 0 and from 1536 (the part line at 2944 left out)
    assert whole.nbytes == 23 * LINE_BYTES


def test_the_geometry_is_in_bytes_for_wider_elements_and_strided_rows():
    padded = torch.zeros(8, 300, dtype=torch.bfloat16)[:, :256]  # rows 600 bytes apart
    prefetch = ek.L2Prefetch(padded, 8 * 512)  # 512-byte rows: too short for a split
    assert prefetch.geometry == (8, 600, 4, 256, 512)
    assert prefetch.offsets()[:4] == [0, 256, 128, 384]
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
    with pytest.raises(ValueError, match="at must be one of"):
        ek.L2Prefetch(torch.zeros(16, 32), 1024, at="middle")


@triton.jit
def _record_the_prefetch(base_ptr, record_ptr, rows, row_stride, row_lines, half, row_bytes,
                         BLOCK: tl.constexpr):
    # K2's prefetch as its programs run it, each line's offset stored instead of prefetched
    _fused_kernels._prefetch_next(base_ptr, rows, row_stride, row_lines, half, row_bytes, BLOCK,
                                  record_ptr=record_ptr)


@pytest.mark.parametrize(("grid", "shape", "budget"), [
    ((1, 1, 1), (37, 600), 37 * 512),
    ((2, 3, 2), (37, 600), 37 * 512),  # a K2 grid: row tiles, column tiles, K splits
    ((1, 16, 2), (37, 3584), 10**9),  # whole rows, their second halves shorter
    ((1, 128, 1), (24576, 4096), 24 << 20),  # o's grid pulling gate_up's 24 MiB
])
def test_the_grid_prefetches_every_chosen_line_and_nothing_else(grid, shape, budget):
    prefetch = ek.L2Prefetch(next_weight(*shape), budget)
    rows, row_stride, row_lines, half, row_bytes = prefetch.geometry
    recorded = torch.full((rows * row_lines,), -1, dtype=torch.int64)
    _record_the_prefetch[grid](prefetch.bytes_view(), recorded, rows, row_stride, row_lines,
                               half, row_bytes, BLOCK=128)
    assert recorded[recorded >= 0].tolist() == prefetch.offsets()
    assert max(prefetch.offsets()) < rows * row_stride


@pytest.mark.parametrize("at", ["end", "start"])
@pytest.mark.parametrize("codes_only", [False, True])
@pytest.mark.parametrize("tokens", [1, 9])
def test_a_call_that_prefetches_computes_the_same_bits(tokens, codes_only, at):
    x, weight, w_scale, lora, batch = make_problem(31, tokens, 64, (32, 16, 16), 16, 3,
                                                   "mixed_with_base")
    prefetch = ek.L2Prefetch(next_weight(48, 64), 48 * 128, at=at)
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

