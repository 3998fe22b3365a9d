"""The matched mode's FP8 linears outside the plugin's LoRA layers: an FP8 kernel for vLLM's
kernel selection that computes W8A16 (bf16 activations, the FP8 weight widened in registers,
fp32 accumulation, one rounding) through epilora-kernels' `w8a16_gemm`.

With EPILORA_VLLM_MATCHED=1 every FP8 linear of the engine then computes the RL trainer's
arithmetic: those the plugin's LoRA layers serve (their own W8A16 path, with the adapters),
those vLLM's own LoRA classes keep (their base layer calls this kernel, then vLLM's Punica
kernels add the adapter), and every one of an engine without LoRA.

vLLM gives an FP8 linear its kernel object when it creates the layer's weights: the first class
in `_POSSIBLE_FP8_KERNELS[platform]` that is supported and can implement the layer
(`vllm.model_executor.kernels.linear.choose_scaled_mm_linear_kernel`). vLLM's own registration,
`register_linear_kernel`, appends a class behind CUTLASS, which would always be picked first,
so `install` puts this one at the front. It declines (`is_supported`) unless the matched mode
is on, so that otherwise vLLM picks what it picks without the plugin.

What the matched mode does not reach: a layer this kernel declines (an fp16 model, block
scales) keeps vLLM's W8A8 kernel, said once per reason in the log; block-FP8 layers and MoE
experts take kernels from other lists and never ask it; `--linear-backend` (vLLM's filter of
its kernel lists by name) leaves it out of every choice; and with VLLM_BATCH_INVARIANT=1
vLLM's `quantization="fp8"` methods (`Fp8LinearMethod`, the online ones) compute their
per-tensor and per-channel layers without their kernel object, on a bf16-dequantized weight
(logged; compressed-tensors checkpoints still call it).
"""

import logging

import torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearKernel,
    FP8ScaledMMLinearLayerConfig,
)
from vllm.platforms import PlatformEnum, current_platform

from epilora_vllm import _env
from epilora_vllm.layers import key_compiled_graphs, log_once


class EpiloraW8A16LinearKernel(FP8ScaledMMLinearKernel):
    """vLLM's FP8 linear kernel interface, computed W8A16 (`torch.ops.epilora_vllm.w8a16_linear`).
    The weight stays as vLLM keeps it (`[K, N]`, the column-major view of the `[N, K]` codes),
    with one fp32 scale or one per output channel; activation scales are not read."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not _env.matched():
            return False, "computes the matched mode only (EPILORA_VLLM_MATCHED=1)"
        from vllm import envs

        if envs.VLLM_BATCH_INVARIANT:
            _warn("with VLLM_BATCH_INVARIANT=1 vLLM's quantization='fp8' methods (FP8 "
                  "checkpoints' and online) compute on a bf16-dequantized weight, not through "
                  "the matched mode's kernel (compressed-tensors checkpoints still call it)")
        if current_platform.is_cpu():
            return True, None  # the kernels' torch twin
        if not current_platform.is_cuda():
            return False, "requires CUDA or the CPU"
        if compute_capability is not None and compute_capability < 89:
            return False, "requires compute capability 89 or above (the kernels' FP8 MMA)"
        return True, None

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        weights = c.weight_quant_key.scale.group_shape
        # One scale per output channel: (-1, 1), or (1, -1) where FBGEMM's and ModelOpt's
        # per-channel checkpoints label it as their activations' per-token scales.
        if not (weights.is_per_tensor() or weights.is_per_channel() or weights.is_per_token()):
            return _declined(f"weight scales in groups {weights} (the kernels take one scale "
                             "or one per output channel)")
        if c.input_dtype != torch.bfloat16 or c.out_dtype not in (None, torch.bfloat16):
            return _declined(f"{c.input_dtype} activations and {c.out_dtype} outputs (the "
                             "kernels compute bf16)")
        return True, None

    def __init__(self, c: FP8ScaledMMLinearLayerConfig, layer_param_names) -> None:
        super().__init__(c, layer_param_names)
        # While vLLM builds the model (its config is current): the compile cache's key, and
        # the split-K counters every batch the engine schedules can need, sized before any
        # CUDA-graph capture (a weight reload later runs with no config current).
        key_compiled_graphs()
        if current_platform.is_cuda():
            from epilora_vllm.forward import size_workspace

            size_workspace(torch.device("cuda", torch.cuda.current_device()),
                           out_features=max(c.weight_shape))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # the kernels take any N and K: no padding, as CUTLASS's

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        weight, weight_scale, _, _ = self._get_layer_params(layer)
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.epilora_vllm.w8a16_linear(rows, weight.t(), weight_scale, bias)
        return y.view(*x.shape[:-1], weight.shape[1])

    def apply_scaled_mm(self, *, A, B, out_dtype, As, Bs, bias, output_shape) -> torch.Tensor:
        # vLLM hands quantized activations only to kernels whose `input_quant_key` names a
        # format: this one names none, as it reads the bf16 activations.
        raise NotImplementedError(f"{type(self).__name__} computes W8A16 from bf16 "
                                  "activations (apply_weights), not FP8 codes")


def _warn(message: str) -> None:
    log_once(("matched", message), "epilora: %s", message, level=logging.WARNING)


def _declined(why: str) -> tuple[bool, str]:
    _warn(f"the matched mode leaves to vLLM's W8A8 kernels the FP8 linears with {why}")
    return False, why


def _kernel_lists() -> list[list]:
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_KERNELS

    return [_POSSIBLE_FP8_KERNELS.setdefault(platform, [])
            for platform in (PlatformEnum.CUDA, PlatformEnum.CPU)]


def install() -> None:
    """Put the kernel first in vLLM's FP8 kernel lists for CUDA and the CPU (once)."""
    for kernels in _kernel_lists():
        if EpiloraW8A16LinearKernel not in kernels:
            kernels.insert(0, EpiloraW8A16LinearKernel)


def installed() -> bool:
    return all(kernels[:1] == [EpiloraW8A16LinearKernel] for kernels in _kernel_lists())
