"""EPILORA_DECODE_AFTER_PREVIOUS=1: the decode path's K1 launched as the programmatic dependent
of the kernel before it on the stream (on the GPU; the interpreter has no PDL and runs launches
in order, so this checks the setting's plumbing through every entry point, the results and the
counters, and test_compile_sm90.py the PTX's order)."""

import pytest

import epilora_kernels as ek
from epilora_testing import assert_bitwise_equal

from kernel_cases import make_problem


@pytest.mark.parametrize("operands", ["x", "x+codes", "codes"])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_k1_after_the_kernel_before_gives_the_same_bits_and_leaves_the_counters_at_rest(
        tokens, operands, monkeypatch):
    # The same bits as without, through lora_linear and a bound projection, and the counters
    # at rest after each call (a count left set would let the next call's K2 pass its wait
    # early).
    x, weight, w_scale, lora, batch = make_problem(33, tokens, 64, (32, 16, 16), 16, 3,
                                                   "mixed_with_base")
    quantized = None if operands == "x" else ek.quantize(x)
    given = None if operands == "codes" else x
    want = ek.decode_lora_fp8_linear(given, weight, w_scale, lora, batch, x_quantized=quantized)
    monkeypatch.setenv("EPILORA_DECODE_AFTER_PREVIOUS", "1")
    workspace = ek.Workspace.for_batches("cpu", max_tokens=64, max_out_features=64,
                                         max_rank=16, max_loras=3)
    got = ek.lora_linear(given, weight, w_scale, lora, batch, path="decode",
                         x_quantized=quantized, workspace=workspace)
    assert_bitwise_equal(got, want, name="K1 after the kernel before")
    assert workspace.is_clean()
    projection = ek.LoraProjection(weight, w_scale, lora, workspace=workspace)
    for _ in range(2):  # the second call finds the counters at rest, or its K2 passes early
        assert_bitwise_equal(projection(given, batch, path="decode", x_quantized=quantized),
                             want, name="projection, K1 after the kernel before")
        assert workspace.is_clean()
