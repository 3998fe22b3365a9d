"""Input checks of the public launchers: every bad input is a ValueError naming the value, before
any kernel launches (a kernel given a wrong stride or dtype reads garbage, it does not fail)."""

import torch

from epilora_kernels.batch import AdapterBatch, LoraWeights


def _shape(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def check_device(where: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != where:
            raise ValueError(f"{name} is on {t.device}, x on {where}: every tensor of a call "
                             "must be on one device")


def check_activations(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a tensor, got {type(x).__name__}")
    if x.ndim != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D bfloat16 with contiguous rows, got {_shape(x)} "
                         f"strides {x.stride()}")


# check_batch's fields: name -> shape as a function of (tokens, entries).
_BATCH_FIELDS = (("token_lora_mapping", lambda t, e: (t,)),
                 ("sorted_token_indices", lambda t, e: (t,)),
                 ("lora_ids", lambda t, e: (e,)),
                 ("num_tokens_per_lora", lambda t, e: (e,)),
                 ("lora_token_start", lambda t, e: (e + 1,)))


def check_batch(batch: AdapterBatch, tokens: int, device: torch.device, slots: int) -> None:
    """The batch's tensors for `tokens` tokens on `device`, and its slot count the adapters'
    (`slots`: a slot id past the adapters' would index past their buffers)."""
    if batch.num_tokens != tokens:
        raise ValueError(f"batch maps {batch.num_tokens} tokens, x has {tokens}")
    if batch.max_loras != slots:
        raise ValueError(f"batch has {batch.max_loras} slots, the adapters {slots}")
    entries = batch.num_entries
    for name, shape_of in _BATCH_FIELDS:
        t, shape = getattr(batch, name), shape_of(tokens, entries)
        if t.dtype != torch.int32 or t.shape != shape or not t.is_contiguous():
            raise ValueError(f"batch.{name} must be contiguous int32 {list(shape)}, got "
                             f"{_shape(t)}")
        if t.device != device:
            check_device(device, **{f"batch.{name}": t})  # raises, naming it


def check_lora(lora: LoraWeights, features: int | None, device: torch.device) -> None:
    """The adapters' dtype and device, and (given the input's `features`) their input width."""
    if features is not None and features != lora.in_features:
        raise ValueError(f"x has {features} features, the adapters take {lora.in_features}")
    for s, (a, b) in enumerate(zip(lora.lora_a, lora.lora_b, strict=True)):
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            raise ValueError(f"slice {s}: lora_a and lora_b must be bfloat16, got {a.dtype} "
                             f"and {b.dtype}")
        if a.device != device or b.device != device:
            check_device(device, **{f"lora_a[{s}]": a, f"lora_b[{s}]": b})  # raises


def check_inputs(x: torch.Tensor, lora: LoraWeights, batch: AdapterBatch) -> None:
    check_activations(x)
    _check_rows(x, lora, batch)


def check_quantized_inputs(codes: torch.Tensor, scales: torch.Tensor, lora: LoraWeights,
                           batch: AdapterBatch) -> None:
    """`check_inputs` for activations given only as per-token codes and scales."""
    check_codes(codes, scales, codes.shape[-1])
    _check_rows(codes, lora, batch)


def _check_rows(x: torch.Tensor, lora: LoraWeights, batch: AdapterBatch) -> None:
    check_lora(lora, x.shape[1], x.device)
    check_batch(batch, x.shape[0], x.device, lora.max_loras)


def check_weight(weight: torch.Tensor, weight_scale: torch.Tensor, k: int, n: int,
                 device: torch.device) -> None:
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (n, k):
        raise ValueError(f"weight must be float8_e4m3fn [{n}, {k}], got {_shape(weight)}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [N, K] (K-major), got strides "
                         f"{weight.stride()} (vLLM keeps W^T: pass layer.weight.t())")
    per_tensor = weight_scale.numel() == 1
    per_channel = tuple(weight_scale.shape) in ((n,), (n, 1)) and weight_scale.is_contiguous()
    if weight_scale.dtype != torch.float32 or not (per_tensor or per_channel):
        raise ValueError(f"weight_scale must be fp32, one value (per-tensor) or one per output "
                         f"channel ([{n}] or [{n}, 1], contiguous), got {_shape(weight_scale)}")
    check_device(device, weight=weight, weight_scale=weight_scale)


def check_codes(codes: torch.Tensor, scales: torch.Tensor, k: int) -> None:
    if codes.ndim != 2 or codes.dtype != torch.float8_e4m3fn or codes.shape[1] != k \
            or codes.stride(1) != 1:
        raise ValueError(f"codes must be float8_e4m3fn [T, {k}] with contiguous rows, got "
                         f"{_shape(codes)} strides {codes.stride()}")
    want = (codes.shape[0], 1)
    if scales.dtype != torch.float32 or tuple(scales.shape) != want or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous fp32 {list(want)} (one per token), got "
                         f"{_shape(scales)}")
    check_device(codes.device, scales=scales)


def check_codes_beside(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The caller's codes and scales of x (`x_quantized` given with x): one row per row of x."""
    check_codes(codes, scales, x.shape[1])
    if codes.shape[0] != x.shape[0]:
        raise ValueError(f"x_quantized has {codes.shape[0]} rows, x {x.shape[0]}")
    check_device(x.device, codes=codes, scales=scales)


def check_h(h: torch.Tensor, lora: LoraWeights, tokens: int, device: torch.device) -> None:
    want = (len(lora.output_slices), tokens, lora.max_rank)
    if (h.ndim != 4 or tuple(h.shape[1:]) != want or h.shape[0] < 1
            or h.dtype not in (torch.float32, torch.bfloat16) or not h.is_contiguous()):
        raise ValueError(f"h must be contiguous fp32 or bf16 [planes, {', '.join(map(str, want))}]"
                         f" (split-K planes, slices, tokens, max rank), got {_shape(h)}")
    check_device(device, h=h)


def check_output(y: torch.Tensor, tokens: int, n: int) -> None:
    if (y.dtype != torch.bfloat16 or tuple(y.shape) != (tokens, n) or y.stride(1) != 1):
        raise ValueError(f"y must be bf16 [{tokens}, {n}] with contiguous rows, got {_shape(y)}"
                         f" strides {y.stride()}")


def check_bias(bias: torch.Tensor | None, n: int, device: torch.device) -> None:
    """The projection's bias, added in fp32 before the output is rounded: `[N]` bf16 or fp32."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise ValueError(f"bias must be a tensor or None, got {type(bias).__name__}")
    if (bias.dtype not in (torch.bfloat16, torch.float32) or tuple(bias.shape) != (n,)
            or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous bf16 or fp32 [{n}], got {_shape(bias)}")
    check_device(device, bias=bias)
