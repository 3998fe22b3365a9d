"""One call for a projection with every token's adapter: `lora_linear` picks the path.

Paths (`PATHS`): `decode` (K1, then K2 as its PDL dependent; sm_90), `fused` (K1 then K2),
`hybrid` (a vendor FP8 GEMM, then our shrink and expand), `w8a16` (the matched engine's
arithmetic: bf16 activations, FP8 weights widened in registers). `supports` says whether a
path can serve a case, and why not; `choose_path` is what `lora_linear` follows when it is
given no path: a rule by the batch's size and slots, and where the decode and fused paths are
close, the tuner's timed choice between them for the shape (an engine's timed dispatch, which
measures every candidate on the caller's shapes, belongs to the engine integration and
replaces it there).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epilora_kernels import _checks, _tiling, fused
from epilora_kernels.arch import DeviceSupport, UnsupportedError, device_support
from epilora_kernels.batch import MAX_SLICES, AdapterBatch, LoraWeights
from epilora_kernels.launch import DECODE_MAX_TOKENS_ONE_SLOT, tuned_path
from epilora_kernels.prefetch import L2Prefetch, kernel_args
from epilora_kernels.workspace import Workspace

PATHS = ("decode", "fused", "hybrid", "w8a16")
MAX_RANK = 128  # the largest rank tile K2's epilogue was compiled and tested with
SLICE_ALIGN = 16  # output slices start on a multiple of the narrowest K2 tile

# choose_path's thresholds. One adapter slot: the decode path was the fastest at 1-64 tokens
# (the layer benchmark on Qwen3-8B's shapes, layer.json of f715d55). Several: the decode path up
# to 32 tokens (was 8, read from 32 slots of rank 64 at f715d55): on an H100 at 103b6df, with
# no table and no cache, it took 0.90-0.95x the fused path's layer time at 16 and 32 tokens
# with 4 slots of rank 32, 0.92-0.97x with 32 of rank 64, and with 16 of rank 16 0.96x at 32
# tokens but 1.02-1.03x at 16, on the three models' shapes (docs/kernels-history.md, item 55).
# Where the choice is that close (several slots, DECODE_TIMED_MIN_TOKENS up to
# DECODE_MAX_TOKENS) the tuner times both paths and `choose_path` takes its choice. At
# 512-4096 tokens, with K1 and K2 in their prefill tiles, the fused path beat the hybrid path
# (CUTLASS, then our shrink and expand) in 35 of 36 cases on the three models' shapes and lost
# one by 2% (layer runs at 5c4e33e; docs/kernels.md, "Prefill"). (DECODE_MAX_TOKENS_ONE_SLOT,
# 64, is launch's: the decode path's K1 has settings of its own up to there.)
DECODE_MAX_TOKENS = 32
DECODE_TIMED_MIN_TOKENS = 9


@dataclass(frozen=True)
class Support:
    """Whether a path can serve a case; `reason` says why not. True in a boolean context when
    it can."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _refuse(reason: str) -> Support:
    return Support(False, reason)


def supports(path: str, *, in_features: int, output_slices: tuple[int, ...], max_rank: int,
             device: torch.device | str | None = None,
             weight_dtype: torch.dtype = torch.float8_e4m3fn,
             weight_scale_numel: int = 1) -> Support:
    """Whether `path` can compute a projection of `in_features` inputs into `output_slices`
    with adapters of `max_rank` on `device` (default: the current CUDA device), FP8 weights of
    `weight_dtype` with `weight_scale_numel` scales."""
    _check_path(path)
    try:
        support = device_support(device)
    except UnsupportedError as e:
        return _refuse(str(e))
    return _supports_on(support, path, in_features, tuple(output_slices), max_rank,
                        weight_dtype, weight_scale_numel)


def supports_shape(*, in_features: int, output_slices: tuple[int, ...],
                   max_rank: int) -> Support:
    """The shape rules every path and device shares (`supports` asks them too): an engine can
    ask them before it has a device or weights, when it decides which layers to serve."""
    output_slices = tuple(output_slices)
    if not 1 <= len(output_slices) <= MAX_SLICES:
        return _refuse(f"{len(output_slices)} output slices; 1..{MAX_SLICES} are served")
    if any(w < 1 for w in output_slices) or in_features < 1:
        return _refuse(f"empty projection: in_features={in_features}, slices={output_slices}")
    if any(w % SLICE_ALIGN for w in output_slices[:-1]):
        return _refuse(f"output slices {output_slices}: every slice but the last must be a "
                       f"multiple of {SLICE_ALIGN} wide (a K2 tile must not straddle two)")
    if not 1 <= max_rank <= MAX_RANK:
        return _refuse(f"max rank {max_rank}: ranks 1..{MAX_RANK} are served")
    return Support(True)


def _check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")


@functools.lru_cache(maxsize=4096)  # asked on every call of lora_linear, by value
def _supports_on(support: DeviceSupport, path: str, in_features: int,
                 output_slices: tuple[int, ...], max_rank: int, weight_dtype: torch.dtype,
                 weight_scale_numel: int) -> Support:
    if not support.fp8_mma:
        return _refuse(f"FP8 MMA needs sm_89 or newer; {support.name} is {support.arch}")
    if path == "decode" and not (support.pdl or support.interpreter):
        return _refuse(f"the decode path needs PDL (sm_90); {support.name} is {support.arch}")
    if weight_dtype != torch.float8_e4m3fn:
        return _refuse(f"weights must be float8_e4m3fn, got {weight_dtype}")
    shape = supports_shape(in_features=in_features, output_slices=output_slices,
                           max_rank=max_rank)
    if not shape:
        return shape
    if path == "hybrid" and (in_features % 16 or sum(output_slices) % 16):
        return _refuse(f"the hybrid path's vendor FP8 GEMM needs K and N multiples of 16, got "
                       f"K={in_features}, N={sum(output_slices)}")
    if weight_scale_numel not in (1, sum(output_slices)):
        return _refuse(f"{weight_scale_numel} weight scales for {sum(output_slices)} outputs: "
                       "per-tensor (one) and per-channel (one per output) FP8 weights are "
                       "served; block scales are not")
    return Support(True)


def choose_path(tokens: int, batch: AdapterBatch, support: DeviceSupport,
                lora: LoraWeights | None = None, codes: bool = False) -> str:
    """The path `lora_linear` takes without one given: where the tuner timed the decode and
    fused paths for the projection (`lora` gives its shape, rank and slots; `codes`: called
    with the codes given) at a bucket covering the batch (`timed_choice`: several slots at
    9-32 tokens), the faster (`launch.tuned_path`); else the rule's (`rule_path`: the decode
    path for small batches where PDL exists, more tokens with one adapter slot, whose K2
    epilogue is cheapest; the fused path beyond). The hybrid path is for callers that choose
    it (an engine timing its own GEMM against ours)."""
    if (lora is not None and support.pdl and timed_choice(tokens, batch, support)
            and (table := _tiling.table_of(support)) is not None):
        timed = tuned_path(table, tokens, lora.out_features, lora.in_features, lora.max_rank,
                           lora.max_loras, codes, cache_device=support.name)
        if timed is not None:
            return timed
    return rule_path(tokens, batch, support)


def timed_choice(tokens: int, batch: AdapterBatch, support: DeviceSupport) -> bool:
    """Whether the tuner times the fused path beside the decode path for a batch, and
    `choose_path` takes its choice: several adapter slots at DECODE_TIMED_MIN_TOKENS to
    DECODE_MAX_TOKENS tokens, where the decode path runs (PDL, or the interpreter) and the
    faster of the two depends on the shapes and slots (see DECODE_MAX_TOKENS)."""
    return ((support.pdl or support.interpreter) and not _tiling.one_slot(batch)
            and DECODE_TIMED_MIN_TOKENS <= tokens <= DECODE_MAX_TOKENS)


def rule_path(tokens: int, batch: AdapterBatch, support: DeviceSupport) -> str:
    """`choose_path`'s rule where the tuner timed no choice: the decode path up to
    DECODE_MAX_TOKENS_ONE_SLOT tokens with one adapter slot, DECODE_MAX_TOKENS with several,
    where PDL exists; else the fused path."""
    if (support.pdl or support.interpreter) and tokens <= decode_max_tokens(
            _tiling.one_slot(batch)):
        return "decode"
    return "fused"


def decode_max_tokens(one_slot: bool) -> int:
    """The largest batch `rule_path` gives the decode path: DECODE_MAX_TOKENS_ONE_SLOT with one
    adapter slot, DECODE_MAX_TOKENS with several."""
    return DECODE_MAX_TOKENS_ONE_SLOT if one_slot else DECODE_MAX_TOKENS


BaseGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_no_bias_beside(base_gemm: BaseGemm | None, bias: torch.Tensor | None) -> None:
    if base_gemm is not None and bias is not None:
        raise ValueError("bias with a base_gemm: the caller's base GEMM adds the bias (as "
                         "vLLM's CUTLASS does in its epilogue); pass it there")


def vendor_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The hybrid path's default base GEMM: our per-token quantizer (vLLM's codes, bit for bit)
    and cuBLASLt's FP8 GEMM (`torch._scaled_mm`, row-wise scales; a `bias` in bf16, the only
    dtype it adds to a bf16 output); under the interpreter, our FP8 GEMM. Engines pass their
    own (vLLM's CUTLASS) as `base_gemm`."""
    codes, scales = fused.quantize(x)
    if device_support(x.device).interpreter:
        return fused.fp8_gemm(codes, scales, weight, weight_scale, bias=bias)
    w_scales = weight_scale.float().reshape(1, -1).expand(1, weight.shape[0]).contiguous()
    return torch._scaled_mm(codes, weight.t(), scale_a=scales, scale_b=w_scales,
                            bias=None if bias is None else bias.to(torch.bfloat16),
                            out_dtype=torch.bfloat16)


def hybrid_lora_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           lora: LoraWeights, batch: AdapterBatch, *,
                           base_gemm: BaseGemm | None = None,
                           workspace: Workspace | None = None,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The hybrid path: `base_gemm(x, weight, weight_scale)` (default `vendor_fp8_gemm`, which
    adds `bias`; a caller's base GEMM adds its own), then our shrink and expand
    (`y += bf16(x A^T) B^T`) over every token's adapter."""
    _checks.check_inputs(x, lora, batch)
    _checks.check_weight(weight, weight_scale, lora.in_features, lora.out_features, x.device)
    _checks.check_bias(bias, lora.out_features, x.device)
    _check_no_bias_beside(base_gemm, bias)
    y = (base_gemm(x, weight, weight_scale) if base_gemm is not None
         else vendor_fp8_gemm(x, weight, weight_scale, bias))
    _checks.check_output(y, x.shape[0], lora.out_features)
    h = fused.lora_shrink(x, lora, batch, workspace=workspace)
    return fused.lora_expand(y, h, lora, batch, workspace=workspace)


def lora_linear(x: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
                lora: LoraWeights, batch: AdapterBatch, *, path: str | None = None,
                workspace: Workspace | None = None,
                base_gemm: BaseGemm | None = None,
                x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                bias: torch.Tensor | None = None,
                prefetch: L2Prefetch | None = None) -> torch.Tensor:
    """bf16 `[T, N]` = x W^T (per-token FP8 activations, FP8 weight) + every token's adapter,
    `bf16(x A_slot^T) B_slot^T` (none for slot -1), by `path` or the one `choose_path` picks.

    x: `[T, K]` bf16; weight: `[N, K]` float8_e4m3fn with an fp32 `weight_scale` of one element
    (per-tensor) or one per output channel (`[N]` or `[N, 1]`);
    `lora`, `batch`: the adapters and the token-to-slot metadata (vLLM's layouts). With
    `path="w8a16"` the activations stay bf16 (the matched engine). No host synchronization:
    the choice depends on shapes only, so the call can be captured in a CUDA graph (with a
    `workspace` sized before capture). `x_quantized`: x's per-token codes and scales, made by
    the caller (the decode and fused paths then skip their own quantization; the hybrid path
    leaves them to its `base_gemm`, the W8A16 path refuses them). x may be None where
    `x_quantized` is given, on the decode and fused paths: their shrink then reads the codes,
    `h = s_t (q_t A^T)`. `bias` (`[N]`, bf16 or fp32): the projection's, added to x W^T in
    fp32 before it is rounded, as vLLM's CUTLASS epilogue adds it (the hybrid path: by its
    default base GEMM; a caller's `base_gemm` adds its own). `prefetch` (`L2Prefetch`): the
    caller's next projection's weight, pulled into L2 by the decode path's GEMM (a hint the
    other paths ignore; the same bits either way)."""
    _check_no_bias_beside(base_gemm, bias)  # on every path: the answer is the same
    if x is None:
        if x_quantized is None:
            raise ValueError("x is None: give x_quantized, the codes the paths then read")
        rows = x_quantized[0]
        _checks.check_codes(*x_quantized, lora.in_features)
    else:
        rows = x
        _checks.check_activations(x)  # the path checks the rest
    kernel_args(prefetch, rows.device)  # checked on every path, acted on by one
    support = device_support(rows.device)
    if path is None:
        path = choose_path(rows.shape[0], batch, support, lora, codes=x_quantized is not None)
    if x is None and path not in ("decode", "fused"):
        raise ValueError(f"the {path} path computes on bf16 activations: x is None (codes "
                         "only) is for the decode and fused paths")
    _check_path(path)
    ok = _supports_on(support, path, lora.in_features, tuple(lora.output_slices),
                      lora.max_rank, weight.dtype, weight_scale.numel())
    if not ok:
        raise UnsupportedError(f"{path} path: {ok.reason}")
    if rows.shape[0] == 0:  # no program to launch, so no path's checks
        if x is None:
            _checks.check_quantized_inputs(*x_quantized, lora, batch)
        else:
            _checks.check_inputs(x, lora, batch)
        _checks.check_weight(weight, weight_scale, lora.in_features, lora.out_features,
                             rows.device)
        _checks.check_bias(bias, lora.out_features, rows.device)
        return torch.empty((0, lora.out_features), dtype=torch.bfloat16, device=rows.device)
    if path == "decode":
        return fused.decode_lora_fp8_linear(x, weight, weight_scale, lora, batch,
                                            workspace=workspace, x_quantized=x_quantized,
                                            bias=bias, prefetch=prefetch)
    if path == "fused":
        return fused.fused_lora_fp8_linear(x, weight, weight_scale, lora, batch,
                                           workspace=workspace, x_quantized=x_quantized,
                                           bias=bias)
    if path == "w8a16":
        if x_quantized is not None:
            raise ValueError("the w8a16 path computes on bf16 activations: x_quantized is for "
                             "the FP8 paths")
        return fused.fused_lora_w8a16_linear(x, weight, weight_scale, lora, batch,
                                             workspace=workspace, bias=bias)
    return hybrid_lora_fp8_linear(x, weight, weight_scale, lora, batch, base_gemm=base_gemm,
                                  workspace=workspace, bias=bias)
