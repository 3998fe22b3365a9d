"""`torch.ops.epilora_vllm.lora_linear(layer_name, output_size, x, codes, scales, bias)`: one
projection of a layer the plugin serves (`codes`, `scales`: x as vLLM quantized it, or None),
as one custom op (registered when this module is imported, which `register` does);
`lora_linear_codes(layer_name, output_size, codes, scales, bias)` the same from the codes alone
(EPILORA_VLLM_QUANTIZE=codes: the bf16 activations never reach the op, so the compiled graph
need not keep them); `w8a16_linear(x, weight, weight_scale, bias)` the matched mode's FP8
linear outside those layers (`epilora_vllm.matched_linear`).

`lora_linear` and `lora_linear_codes` find their layer by name in vLLM's forward context, as
vLLM's dual-stream LoRA op does (a layer registers itself in `static_forward_context` when it
is built), so its module state (weights, adapter buffers, Punica metadata) needs no arguments.
To torch.compile each op is one opaque node whose fake gives the output's shape; CUDA graphs
capture its kernels.

The caller passes the name as vLLM's `_encode_layer_name` gives it, as vLLM's attention
passes its own: a `LayerName` (torch 2.11's opaque value type; VLLM_USE_LAYERNAME=0 keeps the
string), which torch.compile lifts as a graph input instead of baking it in as a constant. As
constants, the names made every decoder layer's piece of vLLM's piecewise graph a graph of its
own to Inductor (vLLM's reason for `LayerName`; what it cost the plugin's start: docs/plugin.md,
Start time).
"""

import torch
from torch.library import Library
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name, direct_register_custom_op

import epilora_kernels as ek
from epilora_kernels import reference

_LIBRARY = Library("epilora_vllm", "FRAGMENT")  # kept alive at module scope


def _layer(layer_name: LayerNameType):
    return get_forward_context().no_compile_layers[_resolve_layer_name(layer_name)]


def lora_linear(layer_name: LayerNameType, output_size: int, x: torch.Tensor,
                codes: torch.Tensor | None, scales: torch.Tensor | None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    return _layer(layer_name).epilora(x, codes, scales, bias)


def lora_linear_fake(layer_name: LayerNameType, output_size: int, x: torch.Tensor,
                     codes: torch.Tensor | None, scales: torch.Tensor | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], output_size))


def lora_linear_codes(layer_name: LayerNameType, output_size: int, codes: torch.Tensor,
                      scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _layer(layer_name).epilora(None, codes, scales, bias)


def lora_linear_codes_fake(layer_name: LayerNameType, output_size: int, codes: torch.Tensor,
                           scales: torch.Tensor, bias: torch.Tensor | None = None
                           ) -> torch.Tensor:
    return codes.new_empty((codes.shape[0], output_size), dtype=torch.bfloat16)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    # The matched mode's FP8 linears outside the plugin's LoRA layers (`matched_linear`):
    # a function of its tensors alone, no layer to find.
    if x.device.type == "cpu":
        return reference.w8a16_gemm(x, weight, weight_scale, bias=bias)
    return ek.w8a16_gemm(x, weight, weight_scale, bias=bias)


def w8a16_linear_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


direct_register_custom_op(op_name="lora_linear", op_func=lora_linear, fake_impl=lora_linear_fake,
                          target_lib=_LIBRARY)
direct_register_custom_op(op_name="lora_linear_codes", op_func=lora_linear_codes,
                          fake_impl=lora_linear_codes_fake, target_lib=_LIBRARY)
direct_register_custom_op(op_name="w8a16_linear", op_func=w8a16_linear,
                          fake_impl=w8a16_linear_fake, target_lib=_LIBRARY)
