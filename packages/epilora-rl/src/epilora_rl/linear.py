"""The training linear: a projection on an FP8 weight the engine owns, plus a trainable LoRA.

Forward: the matched engine's W8A16 arithmetic (`reference.w8a16_lora_forward`). Backward: the
input's gradient through the frozen FP8 codes and the adapter in one kernel, and the adapter's
gradients `dA = (g B_eff)^T x`, `dB = scaling * g^T h` from small dense products. The base is
never widened into a copy: forward and backward read the codes, and autograd saves only x.
"""

import math

import torch

from epilora_rl import reference

IMPLEMENTATIONS = ("auto", "kernels", "reference")


def _ops(impl: str, device: torch.device):
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLEMENTATIONS}")
    if impl == "kernels" or (impl == "auto" and device.type == "cuda"):
        from epilora_rl import kernels

        return kernels
    return reference


class _Fp8LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, weight_scale, lora_a, lora_b, scaling, impl):
        ops = _ops(impl, x.device)
        a = lora_a.to(x.dtype)
        b_eff = lora_b.to(x.dtype) * scaling  # rounded once, as vLLM folds alpha / r into B
        x2 = x.reshape(-1, x.shape[-1])
        y = ops.w8a16_lora_forward(x2, weight, weight_scale, a, b_eff)
        ctx.save_for_backward(x2, weight, weight_scale, a, b_eff)
        ctx.scaling, ctx.ops = scaling, ops
        ctx.dtypes = (lora_a.dtype, lora_b.dtype)
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight, weight_scale, a, b_eff = ctx.saved_tensors
        acc = torch.float64 if x2.dtype == torch.float64 else torch.float32
        g = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
        grad_h = g.to(acc) @ b_eff.to(acc)  # [T, r]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.ops.w8a16_lora_grad_input(g, weight, weight_scale, grad_h, a)
            grad_x = grad_x.reshape(ctx.x_shape)
        # h as the forward's epilogue read it (rounded to x's dtype); recomputed, not saved.
        h = (x2.to(acc) @ a.to(acc).T).to(x2.dtype).to(acc)
        grad_a = (grad_h.T @ x2.to(acc)).to(ctx.dtypes[0])
        grad_b = (ctx.scaling * (g.to(acc).T @ h)).to(ctx.dtypes[1])
        return grad_x, None, None, grad_a, grad_b, None, None


def fp8_lora_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                    *, impl: str = "auto") -> torch.Tensor:
    """`x W^T + scaling * (x A^T) B^T` with W an FP8 weight (`[N, K]` float8_e4m3fn codes,
    fp32 `weight_scale`, one or one per output channel), differentiable in x, A (`[r, K]`) and
    B (`[N, r]`; PEFT's `lora_A.weight` and `lora_B.weight`, any float dtype: the master copy).

    x is bf16 (float64 for gradient checks, where nothing is rounded); `impl`: `kernels` (GPU,
    or Triton's interpreter), `reference` (torch), `auto` (kernels on CUDA tensors)."""
    return _Fp8LoraLinear.apply(x, weight, weight_scale, lora_a, lora_b, float(scaling), impl)


class LoraLinear(torch.nn.Module):
    """A linear layer over a base weight it does not own (the engine's, or a slice of one of
    vLLM's fused projections) with a trainable LoRA adapter in PEFT's layout and initialization
    (A Kaiming-uniform, B zero: the adapter starts as the identity). The base is a plain
    attribute, not a parameter or buffer: `state_dict` holds the adapter only, and moving the
    module never copies the base. Subclasses compute it (`Fp8LoraLinear`, `Bf16LoraLinear`)."""

    def __init__(self, weight: torch.Tensor, *, rank: int, alpha: float,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if weight.ndim != 2:
            raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
        if rank < 1:
            raise ValueError(f"rank must be at least 1, got {rank}")
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_A = torch.nn.Parameter(torch.empty(rank, self.in_features, dtype=dtype,
                                                     device=weight.device))
        self.lora_B = torch.nn.Parameter(torch.zeros(self.out_features, rank, dtype=dtype,
                                                     device=weight.device))
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, alpha={self.alpha}")


class Fp8LoraLinear(LoraLinear):
    """`LoraLinear` over FP8 codes and their fp32 scale(s), computed by `fp8_lora_linear`."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, *, rank: int,
                 alpha: float, bias: torch.Tensor | None = None, impl: str = "auto",
                 dtype: torch.dtype = torch.float32) -> None:
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight must be float8_e4m3fn [N, K], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        super().__init__(weight, rank=rank, alpha=alpha, bias=bias, dtype=dtype)
        self.weight_scale, self.impl = weight_scale, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_lora_linear(x, self.weight, self.weight_scale, self.lora_A, self.lora_B,
                            self.scaling, impl=self.impl)
        return y if self.bias is None else y + self.bias


class Bf16LoraLinear(LoraLinear):
    """`LoraLinear` over a bf16 weight (the reference pair: a bf16 engine and its trainer),
    computed by torch: `x W^T + scaling * (x A^T) B^T`, the adapter cast to x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return y + (x @ a.T) @ (b.T * self.scaling)
