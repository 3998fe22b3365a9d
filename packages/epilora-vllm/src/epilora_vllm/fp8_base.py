"""What the kernels need from a vLLM linear layer's FP8 base, or why the layer cannot be served.

vLLM quantizes a linear's weight through its quant method (`quantization="fp8"` online,
`Fp8LinearMethod` for FP8 checkpoints, compressed-tensors' `W8A8Fp8` for llm-compressor's
FP8-dynamic checkpoints) and computes it with an FP8 scaled-MM kernel object, `fp8_linear`.
Whatever the method, the state after loading is the same: `weight` `[K, N]`, a column-major view
of the row-major `[N, K]` codes, and `weight_scale`, one fp32 value or one per output channel.
The kernels serve exactly that, with activations quantized dynamically per token; static or
per-tensor activation scales, block-quantized weights, Marlin (weight-only on older GPUs) and
padded weights are left to vLLM.
"""

from dataclasses import dataclass

import torch

# The FP8 scaled-MM kernels whose weight layout is the one above (vLLM 0.26's
# model_executor/kernels/linear/scaled_mm): CUTLASS on sm_89/90, torch._scaled_mm elsewhere,
# and the matched mode's (epilora_vllm.matched_linear).
SERVED_KERNELS = ("CutlassFP8ScaledMMLinearKernel", "PerTensorTorchFP8ScaledMMLinearKernel",
                  "ChannelWiseTorchFP8ScaledMMLinearKernel", "RowWiseTorchFP8ScaledMMLinearKernel",
                  "EpiloraW8A16LinearKernel")


@dataclass(frozen=True)
class Fp8Base:
    """A served FP8 base: the layer's `weight` and `weight_scale` parameter names and its
    output width; `weight(layer)` and `scale(layer)` read them at call time (a weight reload or
    a wake from sleep may replace the tensors)."""

    weight_name: str
    scale_name: str
    out_features: int
    in_features: int
    in_scheme: bool  # the kernel object is the scheme's (compressed-tensors), else the method's

    def weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """`[N, K]` float8_e4m3fn, row-major (the transpose of vLLM's column-major view)."""
        return getattr(layer, self.weight_name).t()

    def scale(self, layer: torch.nn.Module) -> torch.Tensor:
        return getattr(layer, self.scale_name)

    def kernel(self, layer: torch.nn.Module):
        """vLLM's FP8 scaled-MM kernel object of the layer (its `quant_fp8`, `apply_scaled_mm`)."""
        return (layer.scheme if self.in_scheme else layer.quant_method).fp8_linear

    def quantize(self, layer: torch.nn.Module, x: torch.Tensor):
        """x `[T, K]` quantized as vLLM's FP8 linear does it (`QuantFP8`, which vLLM's compiler
        fuses into the RMSNorm or SiLU before it): `(codes [T, K], scales [T, 1])`."""
        kernel = self.kernel(layer)
        _, _, x_scale, x_scale_ub = kernel._get_layer_params(layer)
        return kernel.quant_fp8(x, x_scale, x_scale_ub)

    def vendor_gemm(self, layer: torch.nn.Module, codes: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """vLLM's own FP8 GEMM (CUTLASS on Hopper) on already quantized activations."""
        kernel = self.kernel(layer)
        weight, weight_scale, _, _ = kernel._get_layer_params(layer)
        return kernel.apply_scaled_mm(A=codes, B=weight, out_dtype=out_dtype, As=scales,
                                      Bs=weight_scale, bias=bias,
                                      output_shape=[codes.shape[0], weight.shape[1]])


def _fp8_kernel(quant_method):
    # Online and checkpoint FP8 methods hold the kernel; compressed-tensors' method holds it in
    # the layer's scheme (its `apply` calls `layer.scheme.apply_weights`).
    return getattr(quant_method, "fp8_linear", None)


def inspect_fp8_base(layer: torch.nn.Module) -> Fp8Base | str:
    """The layer's FP8 base, or a sentence saying why the kernels cannot serve it."""
    method = getattr(layer, "quant_method", None)
    if method is None:
        return "no quant method"
    kernel = _fp8_kernel(method) or _fp8_kernel(getattr(layer, "scheme", None))
    method_name = type(method).__name__
    if kernel is None:
        return f"not an FP8 W8A8 linear ({method_name})"
    kernel_name = type(kernel).__name__
    if kernel_name not in SERVED_KERNELS:
        return f"FP8 kernel {kernel_name} ({method_name}) keeps another weight layout"
    config = getattr(kernel, "config", None)
    act = getattr(getattr(config, "activation_quant_key", None), "scale", None)
    if act is None or act.static:
        return f"static activation scales ({method_name}): the kernels quantize dynamically"
    if act.group_shape.is_per_tensor():
        # vLLM without CUTLASS FP8: its codes come with one scale for the batch (and its torch
        # kernels pad them to 17 rows eagerly), where the kernels take one scale a token.
        return (f"dynamic per-tensor activation scales ({method_name}): the kernels take one "
                "scale a token")
    if not act.group_shape.is_per_token():
        return f"activation groups {act.group_shape} ({method_name}): block-quantized"
    weight_name, scale_name = kernel.layer_param_names[:2]
    weight = getattr(layer, weight_name, None)
    scale = getattr(layer, scale_name, None)
    if weight is None or scale is None:
        return f"no {weight_name}/{scale_name} on the layer ({method_name})"
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        return f"weight is {weight.dtype} {tuple(weight.shape)}, not 2-D float8_e4m3fn"
    k, n = weight.shape
    if not weight.t().is_contiguous():
        return f"weight [{k}, {n}] is not the column-major view of row-major [N, K] codes"
    if scale.dtype != torch.float32 or scale.numel() not in (1, n):
        return (f"weight scale {scale.dtype} of {scale.numel()} elements for {n} outputs: "
                "per-tensor or per-channel fp32 scales are served, block scales are not")
    out = sum(getattr(layer, "output_partition_sizes", [n]))
    if n != out or k != getattr(layer, "input_size_per_partition", k):
        return (f"weight [{k}, {n}] is padded (logical [{layer.input_size_per_partition}, "
                f"{out}]) for the vendor GEMM")
    return Fp8Base(weight_name, scale_name, n, k, in_scheme=_fp8_kernel(method) is None)
