"""The training linear on the CPU: its backward's formulas by gradcheck in float64, its forward
as the matched engine's W8A16 arithmetic, and the kernels (in Triton's interpreter) against the
torch references, bitwise on integer-valued operands."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from linear_cases import fp8_weight, operands  # noqa: E402

from epilora_rl import Fp8LoraLinear, fp8_lora_linear, kernels, reference  # noqa: E402
from epilora_testing import assert_bitwise_equal  # noqa: E402


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_the_backward_passes_gradcheck_in_float64(per_channel):
    weight, scale = fp8_weight(12, 10, per_channel=per_channel, seed=0)
    x, a, b, _ = operands(3, 10, 12, 4, seed=0, dtype=torch.float64)
    b = b * 10  # B away from zero, so A's gradient is not trivially zero
    x, a, b = (t.clone().requires_grad_() for t in (x, a, b))

    def f(x, a, b):
        return fp8_lora_linear(x, weight, scale, a, b, scaling=2.0, impl="reference")

    assert torch.autograd.gradcheck(f, (x, a, b))


def test_the_forward_is_the_matched_engines_w8a16_arithmetic():
    import epilora_kernels as ek
    from epilora_kernels import reference as ek_reference

    weight, scale = fp8_weight(96, 64, per_channel=True, seed=1)
    x, a, b, _ = operands(5, 64, 96, 8, seed=1)
    lora = ek.LoraWeights((a[None, None],), (b[None, None],), (96,))
    batch = ek.AdapterBatch.from_token_mapping(torch.zeros(5, dtype=torch.int32), 1)
    assert_bitwise_equal(reference.w8a16_lora_forward(x, weight, scale, a, b),
                   ek_reference.fused_lora_w8a16_linear(x, weight, scale, lora, batch))


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_the_kernels_equal_the_references_bitwise_on_integer_operands(per_channel):
    # T, K, N, r not multiples of the kernels' tiles: the masks are exercised.
    t, k, n, r = 70, 136, 72, 5
    weight, scale = fp8_weight(n, k, per_channel=per_channel, seed=2, integer=True)
    x, a, b, g = operands(t, k, n, r, seed=2, integer=True)
    grad_h = g.float() @ b.float()
    for got, want in ((kernels.w8a16_lora_forward(x, weight, scale, a, b),
                       reference.w8a16_lora_forward(x, weight, scale, a, b)),
                      (kernels.w8a16_lora_grad_input(g, weight, scale, grad_h, a),
                       reference.w8a16_lora_grad_input(g, weight, scale, grad_h, a))):
        assert 0 < want.abs().max() <= 256 and (want == want.round()).all()  # exact in bf16
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize("impl", ["kernels", "reference"])
def test_bf16_gradients_are_close_to_float64(impl):
    weight, scale = fp8_weight(80, 48, per_channel=True, seed=3)
    x, a, b, g = operands(6, 48, 80, 8, seed=3)
    b = b * 4

    def grads(dtype, impl):
        leaves = [t.to(dtype).requires_grad_() for t in (x, a, b)]
        y = fp8_lora_linear(*leaves[:1], weight, scale, *leaves[1:], scaling=0.5, impl=impl)
        y.backward(g.to(dtype))
        return [y.detach()] + [t.grad for t in leaves]

    want = grads(torch.float64, "reference")
    for name, got, exact in zip(("y", "dx", "dA", "dB"), grads(torch.bfloat16, impl), want,
                                strict=True):
        err = (got.double() - exact).norm() / exact.norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


def test_the_module_holds_only_the_adapter_and_starts_as_the_base():
    weight, scale = fp8_weight(40, 32, per_channel=False, seed=4)
    layer = Fp8LoraLinear(weight, scale, rank=8, alpha=16, impl="reference")
    assert set(layer.state_dict()) == {"lora_A", "lora_B"}
    assert layer.weight.data_ptr() == weight.data_ptr()  # the caller's codes, not a copy
    assert layer.scaling == 2.0 and layer.lora_A.abs().sum() > 0 and layer.lora_B.abs().sum() == 0
    x = operands(3, 32, 40, 8, seed=4)[0]
    zero = torch.zeros(8, 32)
    assert_bitwise_equal(layer(x), reference.w8a16_lora_forward(x, weight, scale, zero.bfloat16(),
                                                          torch.zeros(40, 8).bfloat16()))
    layer(x).sum().backward()
    assert layer.lora_B.grad.abs().sum() > 0  # B's gradient flows even while B is zero


def test_bad_operands_are_refused_with_what_was_expected():
    weight, scale = fp8_weight(16, 16, per_channel=False, seed=5)
    x, a, b, g = operands(2, 16, 16, 4, seed=5)
    grad_h = g.float() @ b.float()
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernels.w8a16_lora_grad_input(g, weight.float(), scale, grad_h, a)
    with pytest.raises(ValueError, match="weight_scale"):
        kernels.w8a16_lora_grad_input(g, weight, scale.repeat(3), grad_h, a)
    with pytest.raises(ValueError, match="grad_h"):
        kernels.w8a16_lora_grad_input(g, weight, scale, grad_h.bfloat16(), a)
    with pytest.raises(ValueError, match="impl"):
        fp8_lora_linear(x, weight, scale, a, b, 1.0, impl="cuda")
    with pytest.raises(ValueError, match="rank"):
        Fp8LoraLinear(weight, scale, rank=0, alpha=1)
