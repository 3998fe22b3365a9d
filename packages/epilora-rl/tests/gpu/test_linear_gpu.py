"""The training linear on the H200 at model shapes: the kernels bit for bit with the torch
references on integer-valued operands, bf16 gradients close to float64's, and no bf16 copy of
the weight at any moment of a forward and backward (peak memory)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from linear_cases import fp8_weight, operands  # noqa: E402

from epilora_rl import fp8_lora_linear, kernels, reference  # noqa: E402
from epilora_testing import assert_bitwise_equal  # noqa: E402

CUDA = "cuda"
# Qwen3-8B's q slice of qkv, o_proj and down_proj (K, N), and a token count past every tile.
SHAPES = [(4096, 4096), (12288, 4096), (4096, 1024)]


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_the_kernels_equal_the_references_bitwise_on_integer_operands(k, n, per_channel):
    weight, scale = fp8_weight(n, k, per_channel=per_channel, seed=k + n, integer=True,
                               device=CUDA)
    x, a, b, g = operands(300, k, n, 64, seed=k, integer=True, device=CUDA)
    # Sums of thousands of terms: sparse operands keep every result a small integer that bf16
    # holds (asserted below), whatever the order of summation.
    x, g, a = (t * (torch.rand(t.shape, device=CUDA) < density)
               for t, density in ((x, 0.01), (g, 0.02), (a, 0.1)))
    grad_h = g.float() @ b.float()
    pairs = {"forward": (kernels.w8a16_lora_forward(x, weight, scale, a, b),
                         reference.w8a16_lora_forward(x, weight, scale, a, b)),
             "grad_input": (kernels.w8a16_lora_grad_input(g, weight, scale, grad_h, a),
                            reference.w8a16_lora_grad_input(g, weight, scale, grad_h, a))}
    for name, (got, want) in pairs.items():
        assert 0 < want.abs().max() <= 256 and (want == want.round()).all(), name
        assert_bitwise_equal(got, want, name=name)


@pytest.mark.parametrize("k,n", SHAPES)
def test_bf16_gradients_are_close_to_float64_at_model_shapes(k, n):
    weight, scale = fp8_weight(n, k, per_channel=True, seed=n, device=CUDA)
    x, a, b, g = operands(512, k, n, 64, seed=n, device=CUDA)
    b = b * 4

    def grads(dtype, impl):
        leaves = [t.to(dtype).requires_grad_() for t in (x, a, b)]
        y = fp8_lora_linear(leaves[0], weight, scale, leaves[1], leaves[2], scaling=2.0,
                            impl=impl)
        y.backward(g.to(dtype))
        return [y.detach()] + [t.grad for t in leaves]

    want = grads(torch.float64, "reference")
    for name, got, exact in zip(("y", "dx", "dA", "dB"), grads(torch.bfloat16, "kernels"),
                                want, strict=True):
        err = ((got.double() - exact).norm() / exact.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


def test_forward_and_backward_never_widen_the_weight():
    # Llama-3.1-8B's gate_up: a bf16 copy would be 224 MiB; activations here are < 8 MiB.
    k, n, t = 4096, 28672, 64
    weight, scale = fp8_weight(n, k, per_channel=True, seed=0, device=CUDA)
    x, a, b, g = operands(t, k, n, 64, seed=0, device=CUDA)
    leaves = [x.requires_grad_(), a.float().requires_grad_(), b.float().requires_grad_()]
    fp8_lora_linear(leaves[0], weight, scale, *leaves[1:], scaling=1.0).backward(g)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = fp8_lora_linear(leaves[0], weight, scale, *leaves[1:], scaling=1.0)
    y.backward(g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    bf16_copy = n * k * 2
    assert peak < bf16_copy / 8, f"peak {peak / 2**20:.1f} MiB over the start"
