"""Operands of the training linear's tests (CPU and tests/gpu/): FP8 codes and scales,
activations and an adapter, random or integer-valued: with `integer`, every product and fp32
sum is exact and the results are small integers that bf16 holds exactly, so kernels and
references compare bitwise whatever their order of summation or rounding (Triton's interpreter
rounds fp32 to bf16 ties differently from torch)."""

import torch


def fp8_weight(n: int, k: int, *, per_channel: bool, seed: int, integer: bool = False,
               device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    if integer:  # small integers: exact in e4m3, power-of-two scales keep products exact
        codes = torch.randint(-2, 3, (n, k), generator=gen).float()
        scale = 2.0 ** torch.randint(0, 2, (n if per_channel else 1,), generator=gen).float()
    else:
        codes = torch.randn(n, k, generator=gen) * 64
        scale = torch.rand(n if per_channel else 1, generator=gen) * 0.01 + 0.001
    weight = codes.clamp(-448, 448).to(torch.float8_e4m3fn)
    return weight.to(device), scale.to(device)


def operands(t: int, k: int, n: int, r: int, *, seed: int, integer: bool = False,
             dtype=torch.bfloat16, device="cpu"):
    """x [T, K], lora_a [r, K], lora_b [N, r], grad_out [T, N]."""
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(*shape, std):
        if integer:
            return torch.randint(-1, 2, shape, generator=gen).to(dtype)
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    return (draw(t, k, std=1.0).to(device), draw(r, k, std=0.05).to(device),
            draw(n, r, std=0.05).to(device), draw(t, n, std=1.0).to(device))
