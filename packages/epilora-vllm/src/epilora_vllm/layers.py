"""vLLM's LoRA linear layers on FP8 bases, computed by epilora-kernels.

Each class subclasses the vLLM 0.26 class it replaces and overrides `can_replace_layer` (vLLM's
own check, then whether the kernels can serve the base) and `apply`, plus `__init__` (the
layer registered for the custom op) and `create_lora_weights` (vLLM's, then the kernels
readied): vLLM's adapter
buffers (`lora_a_stacked`, `lora_b_stacked`), their loading (`set_lora`, `reset_lora`, TP
slicing), its Punica metadata and its dummy adapters for graph capture are used as they are,
nothing copied. `apply` is one custom op per projection (`epilora_vllm.ops`), which CUDA graphs
and torch.compile capture whole.

A layer the kernels cannot serve keeps vLLM's class: `register` puts ours first in vLLM's list,
and ours decline. Either way, one log line per kind of layer says which and why.
"""

import logging

import torch
from vllm.config import get_current_vllm_config, get_current_vllm_config_or_none
from vllm.forward_context import is_forward_context_available
from vllm.lora.layers import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from vllm.model_executor.custom_op import maybe_get_oot_by_class
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.utils.torch_utils import _encode_layer_name

import epilora_kernels as ek
from epilora_vllm import _env
from epilora_vllm.forward import EpiloraForward
from epilora_vllm.fp8_base import Fp8Base, inspect_fp8_base

logger = logging.getLogger("vllm.epilora_vllm")  # a child of vLLM's logger: its handlers, format
_logged: set[tuple] = set()


def log_once(key: tuple, message: str, *args, level: int = logging.INFO) -> None:
    # Once per engine (each has its own VllmConfig): a second engine in the process says it too
    # (with no config current: once per process).
    key = (id(get_current_vllm_config_or_none()), *key)
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message, *args)


def key_compiled_graphs(quantize: str | None = None) -> None:
    """Put what the plugin changes in the traced graph into the current VllmConfig's
    `additional_config`, which vLLM hashes into its torch.compile cache key: our environment is
    not in that key, so without this an engine would load a graph compiled with the plugin in
    another mode (EPILORA_VLLM_QUANTIZE puts vLLM's QuantFP8 in the graph or not, and the op's
    inputs differ; EPILORA_VLLM_MATCHED gives vLLM's own FP8 linears our kernel) or, from its
    AOT cache, with the plugin where it is now off. `quantize`: the served layers' mode (None
    from the matched mode's kernel, which keys the mode alone; a served layer adds its own)."""
    from importlib.metadata import version

    config = get_current_vllm_config()
    if isinstance(config.additional_config, dict):
        key = config.additional_config.get("epilora_vllm")
        if key is None:  # the first layer of the engine (the version: a metadata read)
            key = config.additional_config["epilora_vllm"] = {"version": version("epilora-vllm")}
        key["matched"] = _env.matched()
        if quantize is not None:
            key["quantize"] = quantize
    else:  # another plugin's hashable object: vLLM hashes it, we cannot add to it
        log_once(("compile-key",), "epilora: additional_config is a %s, not a dict: vLLM's "
                  "compile cache cannot tell the plugin's modes apart; set "
                  "VLLM_DISABLE_COMPILE_CACHE=1 when switching them",
                  type(config.additional_config).__name__)


def refusal(source_layer: torch.nn.Module, lora_config) -> str | None:
    """Why the kernels cannot serve `source_layer` (vLLM's check already passed), or None."""
    exact = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
             RowParallelLinear)
    if type(source_layer) not in tuple(maybe_get_oot_by_class(c) for c in exact):
        return f"{type(source_layer).__name__} is a subclass with its own forward"
    if lora_config.fully_sharded_loras:
        return "fully_sharded_loras is not served"
    dtype = getattr(getattr(get_current_vllm_config(), "model_config", None), "dtype", None)
    if lora_config.lora_dtype not in (torch.bfloat16, "bfloat16") or (
            dtype is not None and dtype != torch.bfloat16):
        return f"model dtype {dtype}, LoRA dtype {lora_config.lora_dtype}: bf16 only"
    if lora_config.max_lora_rank > 128:
        return f"max_lora_rank {lora_config.max_lora_rank}: ranks up to 128 are served"
    base = inspect_fp8_base(source_layer)
    if isinstance(base, str):
        return base
    # This rank's shard, as the kernels will see it (a merged projection's slices each
    # sharded): CUTLASS takes any N that is a multiple of 16, the kernels' slices must align.
    shape = ek.supports_shape(in_features=base.in_features,
                              output_slices=tuple(source_layer.output_partition_sizes),
                              max_rank=lora_config.max_lora_rank)
    return None if shape else shape.reason


class _Epilora:
    """The behaviour every class below adds to its vLLM parent."""

    _base: Fp8Base

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None,
                          **kwargs) -> bool:
        if not super().can_replace_layer(source_layer=source_layer, lora_config=lora_config,
                                         packed_modules_list=packed_modules_list,
                                         model_config=model_config, **kwargs):
            return False
        parent = cls.__mro__[2].__name__  # the vLLM class (after _Epilora)
        kind = type(source_layer).__name__
        why = refusal(source_layer, lora_config)
        if why is not None:
            log_once((kind, why), "epilora: %s layers keep vLLM's %s: %s", kind, parent, why)
            return False
        method = type(source_layer.quant_method).__name__
        log_once((kind, method), "epilora: serving %s layers (%s) with the fused kernels "
                  "(EPILORA_VLLM_QUANTIZE=%s)", kind, method, _env.quantize())
        return True

    def __init__(self, base_layer) -> None:
        super().__init__(base_layer)
        self._base = inspect_fp8_base(base_layer)
        self.epilora = EpiloraForward(self)
        # The custom op finds the layer by name in vLLM's forward context (as vLLM's own
        # dual-stream LoRA op does); the prefix makes it unique.
        self.epilora_name = base_layer.prefix + ".epilora"
        context = get_current_vllm_config().compilation_config.static_forward_context
        if self.epilora_name in context:
            raise ValueError(f"duplicate layer name {self.epilora_name}")
        context[self.epilora_name] = self

    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        super().create_lora_weights(max_loras, lora_config, model_config)
        self.epilora.adapters_created(matched=_env.matched(), path=_env.path(),
                                      quantize=_env.quantize(),
                                      timed=_env.dispatch() == "timed")
        key_compiled_graphs(self.epilora.mode.quantize)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        codes = scales = None
        mode = self.epilora.mode
        if mode.shrink_codes:
            # The op takes the codes alone: nothing else reads x, so vLLM's compiler fuses vLLM's
            # quantization into the kernel that made x (RMSNorm, SiLU), as without LoRA. (On a
            # CPU, where vLLM's FP8 quantization is a stub, epilora-quant's in vLLM's CPU
            # arithmetic.)
            x2 = x.reshape(-1, x.shape[-1])
            codes, scales = (self._base.quantize(self.base_layer, x2) if x.is_cuda
                             else self.epilora.quantize_on_cpu(x2))
            # vLLM's torch FP8 kernels pad the codes and scales to 17 rows outside its
            # compiled mode (`get_output_padding`): the op computes x's rows only.
            codes, scales = codes[: x2.shape[0]], scales.reshape(-1, 1)[: x2.shape[0]]
            out = sum(self.output_slices)
            y = (torch.ops.epilora_vllm.lora_linear_codes(_encode_layer_name(self.epilora_name),
                                                          out, codes, scales, bias)
                 if is_forward_context_available() else self.epilora(None, codes, scales, bias))
            return y.reshape(*x.shape[:-1], out)
        if x.is_cuda and mode.vllm_quantizes:
            # vLLM's own per-token quantization, outside the op (EPILORA_VLLM_QUANTIZE=vllm): the
            # kernels' K1 then only shrinks.
            codes, scales = self._base.quantize(self.base_layer, x.reshape(-1, x.shape[-1]))
        if not is_forward_context_available():  # e.g. a call outside a model step
            return self.epilora(x, codes, scales, bias)
        # encoded here, as vLLM's attention does in its forward: torch.compile lifts the name
        # as a graph input (epilora_vllm.ops)
        return torch.ops.epilora_vllm.lora_linear(_encode_layer_name(self.epilora_name),
                                                   sum(self.output_slices), x, codes, scales, bias)


class EpiloraColumnParallelLinearWithLoRA(_Epilora, ColumnParallelLinearWithLoRA):
    pass


class EpiloraMergedColumnParallelLinearWithLoRA(_Epilora, MergedColumnParallelLinearWithLoRA):
    pass


class EpiloraQKVParallelLinearWithLoRA(_Epilora, QKVParallelLinearWithLoRA):
    pass


class EpiloraMergedQKVParallelLinearWithLoRA(_Epilora, MergedQKVParallelLinearWithLoRA):
    pass


class EpiloraRowParallelLinearWithLoRA(_Epilora, RowParallelLinearWithLoRA):
    pass


# In vLLM's order (`vllm.lora.utils._all_lora_classes`): each one's check is that of the class
# it replaces, so the first match is the same layer kind as without the plugin.
LAYER_CLASSES = (
    EpiloraColumnParallelLinearWithLoRA,
    EpiloraMergedColumnParallelLinearWithLoRA,
    EpiloraQKVParallelLinearWithLoRA,
    EpiloraMergedQKVParallelLinearWithLoRA,
    EpiloraRowParallelLinearWithLoRA,
)
