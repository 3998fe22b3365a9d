"""The multi-adapter linears as torch custom ops: `torch.ops.epilora.lora_linear` (the
dispatcher; `path` None picks one), `decode_lora_fp8_linear`, `fused_lora_fp8_linear` and
`fused_lora_w8a16_linear`, registered when this module is imported. The ops take no workspace:
they use their device's default, which an engine sets with
`epilora_kernels.set_default_workspace` (sized before capture).

An op is one opaque node to torch.compile (vLLM compiles its models with it): Dynamo does not
trace into the Triton launchers, and a fake implementation gives the output's shape and dtype
without running a kernel, so a compiled model and CUDA-graph capture keep the two launches (K1,
then K2 as its programmatic dependent) as one call. The arguments are the fields of
`LoraWeights` and `AdapterBatch` (custom ops take tensors and plain values, not dataclasses);
`decode_lora_fp8_linear` etc. below take the dataclasses and call the ops. Launch settings come
from the device's table as in `epilora_kernels.fused`.

    import epilora_kernels.ops as ops
    y = ops.decode_lora_fp8_linear(x, weight, weight_scale, lora, batch)
"""

import torch

from epilora_kernels import dispatch, fused
from epilora_kernels.batch import AdapterBatch, LoraWeights


def _unpack(lora_a, lora_b, output_slices, token_lora_mapping, sorted_token_indices, lora_ids,
            num_tokens_per_lora, lora_token_start) -> tuple[LoraWeights, AdapterBatch]:
    lora = LoraWeights(tuple(lora_a), tuple(lora_b), tuple(output_slices))
    batch = AdapterBatch(token_lora_mapping, sorted_token_indices, lora_ids,
                         num_tokens_per_lora, lora_token_start)
    return lora, batch


def _output(x: torch.Tensor, output_slices: list[int]) -> torch.Tensor:
    # What every path returns: [T, sum of the slices] bf16 on x's device.
    return x.new_empty((x.shape[0], sum(output_slices)), dtype=torch.bfloat16)


# The ops' arguments: `LoraWeights` and `AdapterBatch` field by field, then the path's options.
_SCHEMA = ("(Tensor x, Tensor weight, Tensor weight_scale, Tensor[] lora_a, Tensor[] lora_b, "
           "int[] output_slices, Tensor token_lora_mapping, Tensor sorted_token_indices, "
           "Tensor lora_ids, Tensor num_tokens_per_lora, Tensor lora_token_start{options}) "
           "-> Tensor")


def _register(name: str, function, options: str = "") -> None:
    """`function` (a path of `epilora_kernels.fused`) as the op `epilora::name`, with a fake
    implementation (the output's shape and dtype, no kernel)."""

    def run(x, weight, weight_scale, lora_a, lora_b, output_slices, *batch, **kwargs):
        lora, adapters = _unpack(lora_a, lora_b, output_slices, *batch)
        return function(x, weight, weight_scale, lora, adapters, **kwargs)

    op = torch.library.custom_op(f"epilora::{name}", run, mutates_args=(),
                                 schema=_SCHEMA.format(options=options))
    op.register_fake(lambda x, weight, weight_scale, lora_a, lora_b, output_slices, *batch,
                     **kwargs: _output(x, output_slices))


_register("lora_linear", dispatch.lora_linear, ", *, str? path=None")
_register("decode_lora_fp8_linear", fused.decode_lora_fp8_linear, ", *, bool pdl=True")
_register("fused_lora_fp8_linear", fused.fused_lora_fp8_linear, ", *, bool pdl=True")
_register("fused_lora_w8a16_linear", fused.fused_lora_w8a16_linear)


def _args(x, weight, weight_scale, lora: LoraWeights, batch: AdapterBatch) -> tuple:
    return (x, weight, weight_scale, list(lora.lora_a), list(lora.lora_b),
            list(lora.output_slices), batch.token_lora_mapping, batch.sorted_token_indices,
            batch.lora_ids, batch.num_tokens_per_lora, batch.lora_token_start)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                lora: LoraWeights, batch: AdapterBatch, *, path: str | None = None) -> torch.Tensor:
    """`epilora_kernels.lora_linear` through its op (the default workspace, the default base
    GEMM of the hybrid path)."""
    return torch.ops.epilora.lora_linear(*_args(x, weight, weight_scale, lora, batch), path=path)


def decode_lora_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           lora: LoraWeights, batch: AdapterBatch, *,
                           pdl: bool = True) -> torch.Tensor:
    """`fused.decode_lora_fp8_linear` through its op (the table's launch settings)."""
    return torch.ops.epilora.decode_lora_fp8_linear(*_args(x, weight, weight_scale, lora, batch),
                                                    pdl=pdl)


def fused_lora_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          lora: LoraWeights, batch: AdapterBatch, *,
                          pdl: bool = True) -> torch.Tensor:
    """`fused.fused_lora_fp8_linear` through its op (the table's launch settings)."""
    return torch.ops.epilora.fused_lora_fp8_linear(*_args(x, weight, weight_scale, lora, batch),
                                                   pdl=pdl)


def fused_lora_w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            lora: LoraWeights, batch: AdapterBatch) -> torch.Tensor:
    """`fused.fused_lora_w8a16_linear` through its op (the table's launch settings)."""
    return torch.ops.epilora.fused_lora_w8a16_linear(*_args(x, weight, weight_scale, lora,
                                                            batch))
