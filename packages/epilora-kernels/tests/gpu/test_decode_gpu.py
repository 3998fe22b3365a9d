"""The decode path on the H200: shrink first, K2 as its programmatic dependent (PDL). Its output
must equal the same kernels serialized and the fused path bit for bit, run to run, and inside a
CUDA graph (where the launch becomes a programmatic edge)."""

import pytest
import torch

from epilora_kernels import fused, reference
from epilora_testing import assert_bitwise_equal
from epilora_testing.cuda_graphs import capture

from kernel_cases import make_problem, relative_error

CASES = [  # (tokens, K, slices, rank, max_loras)
    (1, 4096, (4096, 1024, 1024), 64, 4),
    (4, 4096, (4096,), 16, 4),
    (16, 4096, (2048, 2048), 128, 4),
    (32, 2048, (1024,), 64, 32),
]


@pytest.mark.parametrize("shape", CASES, ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}")
def test_decode_equals_serialized_and_fused_bitwise(shape):
    t, k, slices, rank, max_loras = shape
    x, weight, w_scale, lora, batch = make_problem(0, t, k, slices, rank, max_loras,
                                                   "one_token_each", device="cuda")
    decode = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=True)
    serialized = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=False)
    fused_y = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert_bitwise_equal(decode, serialized, name="decode vs serialized")
    assert_bitwise_equal(decode, fused_y, name="decode vs fused")
    for _ in range(3):
        again = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=True)
        assert_bitwise_equal(again, decode, name="repeat")
    want = reference.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert relative_error(decode, want) < 1e-2


def test_decode_in_a_cuda_graph_equals_eager():
    x, weight, w_scale, lora, batch = make_problem(1, 8, 4096, (4096, 1024, 1024), 64, 4,
                                                   "mixed_with_base", device="cuda")
    eager = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    graph, out = capture(lambda: fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch))
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, eager, name="graph replay")
