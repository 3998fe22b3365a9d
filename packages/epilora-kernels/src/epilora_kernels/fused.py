"""Multi-adapter LoRA on FP8 bases: the fused, decode, W8A16 and hybrid paths.

Every function here has a torch twin of the same name and positional signature in
`epilora_kernels.reference` (the launch-settings keywords are the kernels' own); tests run both.

* `quantize_and_shrink` (K1): per-token FP8 codes and scales, bit for bit what vLLM's compiled
  quantizer computes on the GPU (`epilora_quant` mode INDUCTOR), plus every adapter's
  `h = x A^T` over its tokens, `[1, S, T, R]` fp32 (split-K partials summed in K1, in a fixed
  order).
* `lora_fp8_gemm` (K2): the FP8 GEMM over adapter-sorted tokens whose epilogue adds
  `bf16(h) B^T` for each adapter in the tile; multi-slice outputs (qkv, gate_up) in one launch.
* `lora_w8a16_gemm`: the same with bf16 activations and the FP8 weight widened in registers.
* `lora_shrink`, `lora_expand`: the hybrid path's kernels, after a vendor GEMM.
* `fused_lora_fp8_linear`, `fused_lora_w8a16_linear`: K1 then K2 (the FP8 one launches K2 as
  K1's programmatic dependent, waiting for all of K1 before its K loop).
* `decode_lora_fp8_linear`: the decode path: K1, then K2 as K1's programmatic dependent (PDL):
  it waits for K1's quantized rows (a counter) before its K loop and for h only before its
  epilogue, so its weight stream overlaps the shrink.
* `quantize`, `fp8_gemm`, `fp8_gemm_from_bf16`: K1's quantization alone, K2 without adapters
  (our GEMM against CUTLASS), and the two in a row; `w8a16_gemm`: W8A16 K2 without adapters.

Weights are `[N, K]` float8_e4m3fn (row-major, K contiguous; vLLM keeps their transpose view)
with an fp32 scale, one element (per-tensor) or one per output channel (`[N]` or `[N, 1]`,
llm-compressor's FP8-dynamic checkpoints); activations `[T, K]` bf16.
"""

import dataclasses

import torch

from epilora_kernels import _checks, _env, _launchers, _tiling
from epilora_kernels._launchers import EXPAND, FP8, W8A16
from epilora_kernels.arch import DeviceSupport, UnsupportedError, device_support
from epilora_kernels.batch import AdapterBatch, LoraWeights
from epilora_kernels.launch import DECODE_SHRINK_MAX_TOKENS, SHARED_BYTES, LaunchConfig
from epilora_kernels.prefetch import L2Prefetch, kernel_args
from epilora_kernels.workspace import Workspace, default_workspace, normalized_device

Quantized = tuple[torch.Tensor, torch.Tensor]  # (codes [T, K] fp8, scales [T, 1] fp32)

# The decode path's K2 prefetches the first bytes of each of its weight rows into L2 before it
# spins on K1's count of quantized rows: 512 made the layer faster, or no slower, at every rank
# (16-128) and token count (1-16) measured; 2048 made the spin itself longer and the layer
# slower (decode_timeline_v1.json and decode_timeline.json of 0f3bdfb).
DECODE_WARM_L2 = 512


def _support(x: torch.Tensor, path: str) -> DeviceSupport:
    support = device_support(x.device)
    if not support.fp8_mma:
        raise UnsupportedError(f"the {path} path needs FP8 MMA (sm_89 or newer); "
                               f"{support.name} is {support.arch}")
    return support


def _workspace(workspace: Workspace | None, device: torch.device) -> Workspace:
    if workspace is None:
        return default_workspace(device)
    if workspace.device != normalized_device(device):
        raise ValueError(f"the workspace is on {workspace.device}, x on {device}")
    return workspace


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K1's quantization alone: `(codes [T, K] fp8, scales [T, 1] fp32)`, per-token FP8 bit for
    bit as vLLM's compiled quantizer (what vLLM runs before its CUTLASS GEMM)."""
    _checks.check_activations(x)
    _support(x, "quantize")
    return _launchers.launch_quantize(x)


def quantize_and_shrink(
    x: torch.Tensor, lora: LoraWeights, batch: AdapterBatch, *,
    config: LaunchConfig | None = None, workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K1: `(codes [T, K] fp8, scales [T, 1] fp32, h [1, S, T, R] fp32)`; split-K partials are
    summed in K1, in a fixed order."""
    _checks.check_inputs(x, lora, batch)
    support = _support(x, "fused")
    cfg = _tiling.config(support, "quantize_shrink", x.shape[0], lora, config,
                         _tiling.one_slot(batch))
    return _launchers.launch_k1(support, _workspace(workspace, x.device), x, lora, batch, cfg,
                                quantize=True)


def lora_shrink(
    x: torch.Tensor, lora: LoraWeights, batch: AdapterBatch, *,
    x_scales: torch.Tensor | None = None, config: LaunchConfig | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """The hybrid path's shrink: `h [1, S, T, R]` fp32, `x A_slot^T` per token and slice.
    With `x_scales` ([T, 1] fp32), x is per-token FP8 codes: `x_scales * (codes A_slot^T)`, the
    codes widened to bf16 (exact)."""
    if x_scales is None:
        _checks.check_inputs(x, lora, batch)
    else:
        _checks.check_quantized_inputs(x, x_scales, lora, batch)
    support = device_support(x.device)
    cfg = _tiling.config(support, "shrink", x.shape[0], lora, config, _tiling.one_slot(batch))
    return _launchers.launch_k1(support, _workspace(workspace, x.device), x, lora, batch, cfg,
                                quantize=False, x_scales=x_scales)[2]


def fp8_gemm(
    codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    *, config: LaunchConfig | None = None, workspace: Workspace | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """K2 without adapters: bf16 `[T, N]` = x_scale * (w_scale * codes @ weight^T) (+ `bias`,
    in fp32), the GEMM that competes with vLLM's CUTLASS."""
    _checks.check_codes(codes, scales, weight.shape[-1])
    _checks.check_weight(weight, weight_scale, codes.shape[1], weight.shape[0], codes.device)
    _checks.check_bias(bias, weight.shape[0], codes.device)
    return _k2_alone(_support(codes, "fp8_gemm"), FP8, codes, scales, weight, weight_scale,
                     config, workspace, bias)


def _k2_alone(support, mode, a, a_scale, weight, weight_scale, config, workspace, bias):
    # K2 without adapters (`fp8_gemm`, `w8a16_gemm`): the given settings, else the table's or
    # the heuristic's for the shape (those of W8A16 fitted to its bf16 operands).
    t, k = a.shape
    cfg = config or _tiling.shape_config(support, "lora_gemm", t, weight.shape[0], k, 16, (),
                                         one_slot=None)  # no adapters: no slot keys
    if config is None and mode == W8A16:
        cfg = _w8a16_tiles(cfg, _tiling.w_tma(support, weight, cfg))
    return _launchers.launch_gemm_only(support, _workspace(workspace, a.device), a, a_scale,
                                       weight, weight_scale, cfg, bias=bias, mode=mode)


def fp8_gemm_from_bf16(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
    config: LaunchConfig | None = None, workspace: Workspace | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`quantize` then `fp8_gemm`: the same two steps as vLLM's quantizer + CUTLASS."""
    _checks.check_activations(x)
    _checks.check_weight(weight, weight_scale, x.shape[1], weight.shape[0], x.device)
    codes, scales = quantize(x)
    return fp8_gemm(codes, scales, weight, weight_scale, config=config, workspace=workspace,
                    bias=bias)


def lora_fp8_gemm(
    codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    h: torch.Tensor, lora: LoraWeights, batch: AdapterBatch, *,
    config: LaunchConfig | None = None, pdl: bool = False, workspace: Workspace | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """K2: bf16 `[T, N]` = x_scale * (w_scale * codes @ weight^T) (+ `bias`, in fp32) +
    bf16(h) @ B_slot^T, the two terms rounded to bf16 before their sum is (vLLM's expand into
    its GEMM's output).

    `pdl=True` launches it as the programmatic dependent of the kernel before it, which it
    waits for only before its epilogue: that kernel may compute h, not the codes or scales."""
    t = codes.shape[0]
    _checks.check_codes(codes, scales, lora.in_features)
    _checks.check_lora(lora, codes.shape[1], codes.device)
    _checks.check_batch(batch, t, codes.device, lora.max_loras)
    _checks.check_weight(weight, weight_scale, lora.in_features, lora.out_features,
                         codes.device)
    _checks.check_h(h, lora, t, codes.device)
    _checks.check_bias(bias, lora.out_features, codes.device)
    support = _support(codes, "fused")
    y = torch.empty(t, lora.out_features, dtype=torch.bfloat16, device=codes.device)
    cfg = _k2_config(support, FP8, codes.dtype, weight, weight_scale, lora, batch, config,
                     pdl=pdl, has_bias=bias is not None)
    return _launchers.launch_k2(support, _workspace(workspace, codes.device), FP8, codes,
                                scales, weight, weight_scale, y, h, lora, batch, cfg, pdl=pdl,
                                bias=bias)


def lora_w8a16_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, h: torch.Tensor,
    lora: LoraWeights, batch: AdapterBatch, *,
    config: LaunchConfig | None = None, workspace: Workspace | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A16 K2: bf16 `[T, N]` = w_scale * (x @ bf16(weight)^T) (+ `bias`) + bf16(h) @ B_slot^T,
    rounded once (the trainer's arithmetic)."""
    _checks.check_inputs(x, lora, batch)
    _checks.check_weight(weight, weight_scale, lora.in_features, lora.out_features, x.device)
    _checks.check_h(h, lora, x.shape[0], x.device)
    _checks.check_bias(bias, lora.out_features, x.device)
    support = _support(x, "w8a16")
    y = torch.empty(x.shape[0], lora.out_features, dtype=torch.bfloat16, device=x.device)
    cfg = _k2_config(support, W8A16, x.dtype, weight, weight_scale, lora, batch, config,
                     pdl=False, has_bias=bias is not None)
    return _launchers.launch_k2(support, _workspace(workspace, x.device), W8A16, x,
                                weight_scale, weight, weight_scale, y, h, lora, batch, cfg,
                                bias=bias)


def w8a16_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
    config: LaunchConfig | None = None, workspace: Workspace | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A16 K2 without adapters: bf16 `[T, N]` = w_scale * (x @ bf16(weight)^T) (+ `bias`),
    rounded once: the matched engine's FP8 layers that have no LoRA."""
    _checks.check_activations(x)
    _checks.check_weight(weight, weight_scale, x.shape[1], weight.shape[0], x.device)
    _checks.check_bias(bias, weight.shape[0], x.device)
    support = _support(x, "w8a16")
    if x.shape[0] == 0:  # no program to launch (an engine's empty step)
        return x.new_empty((0, weight.shape[0]))
    return _k2_alone(support, W8A16, x, weight_scale, weight, weight_scale, config, workspace,
                     bias)


def _w8a16_tiles(cfg: LaunchConfig, w_by_tma: bool) -> LaunchConfig:
    # Settings sized for FP8 operands (the tables', the tuner's, the heuristic's), where W8A16
    # takes twice the activations' bytes. The prefill tile: its bf16 activations and the
    # widened weight would take ~256 KB of shared memory; 128-wide in 3 stages: ~176 KB.
    # Deeper decode pipelines (the tuner's swapped tiles, up to 8 stages) as deep as their
    # buffers fit. The same tiles: the same sums, the same bits.
    if cfg.block_m >= 128 and cfg.block_n > 128:
        return dataclasses.replace(cfg, block_n=128, num_stages=3)
    stages = cfg.num_stages
    while stages > 2 and _pipeline_bytes(cfg, stages, 2, w_by_tma) > SHARED_BYTES:
        stages -= 1
    return dataclasses.replace(cfg, num_stages=stages)


def _pipeline_bytes(cfg: LaunchConfig, stages: int, a_bytes: int, w_by_tma: bool) -> int:
    # K2's K-loop buffers as Triton 3.6 lays them out for sm_90: a TMA-loaded operand takes
    # `stages` buffers, an asynchronously copied one `stages - 1` (W8A16's 32 x 64 x 256 tiles
    # in 8 stages, the weight by TMA: 245,816 bytes; 32 x 32 x 1024 in 3, no TMA: 196,608).
    a = cfg.block_m * cfg.block_k * a_bytes * (stages - 1)
    return a + cfg.block_n * cfg.block_k * (stages if w_by_tma else stages - 1)


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, lora: LoraWeights, batch: AdapterBatch, *,
    config: LaunchConfig | None = None, workspace: Workspace | None = None,
) -> torch.Tensor:
    """The hybrid path's expand: y (bf16 `[T, N]`, a vendor GEMM's output) += bf16(bf16(h)
    B^T), in place, as vLLM's expand; returns y."""
    if not isinstance(y, torch.Tensor) or y.ndim != 2:
        raise ValueError(f"y must be a 2-D bf16 tensor [T, {lora.out_features}]")
    _checks.check_output(y, y.shape[0], lora.out_features)
    _checks.check_lora(lora, None, y.device)
    _checks.check_batch(batch, y.shape[0], y.device, lora.max_loras)
    _checks.check_h(h, lora, y.shape[0], y.device)
    support = device_support(y.device)
    return _launchers.launch_k2(support, _workspace(workspace, y.device), EXPAND, y, y, y, y, y,
                                h, lora, batch, _tiling.gemm_config(support, batch, lora,
                                                                    config))


def decode_lora_fp8_linear(
    x: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor, lora: LoraWeights,
    batch: AdapterBatch, *, k1_config: LaunchConfig | None = None,
    k2_config: LaunchConfig | None = None, pdl: bool = True,
    workspace: Workspace | None = None, x_quantized: Quantized | None = None,
    bias: torch.Tensor | None = None, prefetch: L2Prefetch | None = None,
) -> torch.Tensor:
    """The decode path: K1 (quantize + shrink), and K2 launched as K1's programmatic dependent
    while K1 runs. K2 waits for K1's quantizing programs (their count of finished rows, a spin
    on a counter they release; it prefetches the first `DECODE_WARM_L2` bytes of its weight rows
    into L2 meanwhile) before its K loop, and for the whole of K1 (`gdc_wait`, so h) only
    before its epilogue: its weight stream overlaps the shrink. `pdl=False` runs the same
    kernels serialized; both give the same bits, and the same bits as `fused_lora_fp8_linear`
    with equal configs. Needs PDL (sm_90) for `pdl=True`.

    `x_quantized`: `(codes [T, K] fp8, scales [T, 1] fp32)`, x already quantized per token by
    the caller (an engine whose compiler fuses the quantization into the kernel before, as
    vLLM's fuses it into RMSNorm): K1 then only shrinks, and K2 reads those codes from the
    start, waiting only for h before its epilogue. With x None the shrink reads the codes too,
    `h = s_t (q_t A^T)`: the caller need not keep bf16 activations (vLLM's compiler fuses the
    quantization into the RMSNorm only when nothing else reads the RMSNorm's output).

    `bias` (`[N]`, bf16 or fp32): added to the GEMM's fp32 result before it is rounded, as
    vLLM's CUTLASS epilogue adds a biased projection's (Qwen2's qkv); likewise in every path.

    `prefetch` (an `L2Prefetch` of the caller's next projection's weight): K2's programs pull
    it into L2 past their K loop or before it (its `at`), for the next GEMM (the same bits
    either way)."""
    return _linear(FP8, x, weight, weight_scale, lora, batch, k1_config, k2_config,
                   decode=True, pdl=pdl, workspace=workspace, x_quantized=x_quantized,
                   bias=bias, prefetch=prefetch)


def fused_lora_fp8_linear(
    x: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor, lora: LoraWeights,
    batch: AdapterBatch, *, k1_config: LaunchConfig | None = None,
    k2_config: LaunchConfig | None = None, pdl: bool = True,
    workspace: Workspace | None = None, x_quantized: Quantized | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused path: K1 then K2. With `pdl`, beyond 32 tokens (DECODE_SHRINK_MAX_TOKENS), K2
    is launched as K1's programmatic dependent, which hides its launch and its prologue; it
    waits for all of K1 before its K loop (the same bits as `pdl=False`). Without PDL on the
    device (sm_89) the two launch one after the other. `x_quantized` and `bias` as in
    `decode_lora_fp8_linear`."""
    rows = x if x is not None else x_quantized[0] if x_quantized is not None else None
    tokens = 0 if rows is None else rows.shape[0]  # no rows: _linear says what is missing
    return _linear(FP8, x, weight, weight_scale, lora, batch, k1_config, k2_config,
                   pdl=pdl and fused_pdl(tokens), wait_k1_first=True,
                   workspace=workspace, x_quantized=x_quantized, bias=bias)


def fused_pdl(tokens: int) -> bool:
    """Whether the fused path launches K2 as K1's programmatic dependent for `tokens` rows:
    only beyond the decode path's token counts (at 16-32 tokens PDL made the fused layer
    slower: layer.json of a1a405a against 80936cc's)."""
    return tokens > DECODE_SHRINK_MAX_TOKENS


def fused_lora_w8a16_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, lora: LoraWeights,
    batch: AdapterBatch, *, k1_config: LaunchConfig | None = None,
    k2_config: LaunchConfig | None = None, workspace: Workspace | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The matched engine's path: shrink, then the W8A16 GEMM with the up-projection (and
    `bias`, before the one rounding)."""
    return _linear(W8A16, x, weight, weight_scale, lora, batch, k1_config, k2_config,
                   workspace=workspace, bias=bias)


def one_launch(support, mode: int, tokens: int, batch: AdapterBatch, *, decode: bool,
               pdl: bool, quantize: bool, prefetch, enabled: bool | None = None) -> bool:
    """Whether a decode-path call runs as one launch (`enabled`, default
    EPILORA_DECODE_ONE_LAUNCH=1): K2 whose first programs are the shrink's
    (`_launchers.launch_lead`), for FP8 codes the caller made, one adapter slot, up to
    DECODE_SHRINK_MAX_TOKENS tokens, with PDL (where the two-launch path would use it) and no
    L2Prefetch (its lines are dealt to every program of a grid)."""
    return (decode and pdl and mode == FP8 and prefetch is None
            and one_launch_case(codes=not quantize, one_slot=_tiling.one_slot(batch),
                                tokens=tokens, enabled=enabled)
            and (support.pdl or support.interpreter))


def one_launch_case(*, codes: bool, one_slot: bool, tokens: int,
                    enabled: bool | None = None) -> bool:
    """`one_launch`'s conditions on the case alone (what the tuner knows of a cell): the
    caller's codes, one adapter slot, the decode path's token counts, and the setting
    (`enabled`, default EPILORA_DECODE_ONE_LAUNCH)."""
    if enabled is None:
        enabled = _env.decode_one_launch()
    return enabled and codes and one_slot and tokens <= DECODE_SHRINK_MAX_TOKENS


def _settings(support, mode, x, weight, weight_scale, lora, batch, k1_config, k2_config, *,
              decode, quantize, pdl, counted, warm_l2, wait_k1_first, has_bias=False,
              lead=False):
    # K1's and K2's launch settings: given, else the table's or the heuristic's (K2's fitted to
    # the device's waves: `_k2_config`). `lead`: the shrink's in K2's launch (`one_launch`).
    t = x.shape[0]
    if lead:
        op1 = "decode_lead_shrink"
    elif decode:  # on the caller's codes K2 does not wait for K1's: K1 tuned apart
        op1 = "decode_shrink" if quantize or mode != FP8 else "decode_shrink_codes"
    else:
        op1 = "quantize_shrink" if quantize else "shrink"
    cfg1 = _tiling.config(support, op1, t, lora, k1_config, one_slot=_tiling.one_slot(batch))
    if lead and cfg1.slices_together:  # the one launch's shrink programs take a slice each
        cfg1 = dataclasses.replace(cfg1, slices_together=False)
    cfg2 = _k2_config(support, mode, torch.float8_e4m3fn if mode == FP8 else x.dtype, weight,
                      weight_scale, lora, batch, k2_config, pdl=pdl, wait_codes=counted,
                      warm_l2=warm_l2, wait_k1_first=wait_k1_first, has_bias=has_bias)
    return cfg1, cfg2


# Each call's launch settings by what they are functions of (`_plan`): an eager prefill step
# calls a projection's shape layer after layer with one token count, and deriving them every
# call took the H200 host's eager 520-token call from 240 to 350-450 us (dev/op_overhead.py).
# Emptied with the launch tables they come from (`launch.clear_table_cache`).
_PLANS: dict[tuple, tuple] = {}
_MAX_PLANS = 1 << 16  # a process calling with ever new shapes starts over past this


def _plan(support, mode, x, weight, weight_scale, lora, batch, k1_config, k2_config, *,
          decode, quantize, pdl, counted, warm_l2, wait_k1_first, has_bias=False, lead=False):
    # (K1's and K2's settings, the counter tiles they need, whether K1 sorts the codes for
    # K2's TMA reads, h's dtype): functions of the call's shapes, dtypes, alignment and flags.
    # `lead`: one launch (`one_launch`), K1's settings the shrink's inside it, h fp32.
    key = (support, _tiling.table_of(support), mode, tuple(x.shape), x.dtype,
           tuple(weight.shape), weight.stride(), weight.dtype, weight.data_ptr() % 16,
           weight_scale.numel(), tuple(lora.output_slices), lora.max_rank, batch.num_entries,
           k1_config, k2_config, decode, quantize, pdl, counted, warm_l2, wait_k1_first,
           has_bias, lead)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    t = x.shape[0]
    cfg1, cfg2 = _settings(support, mode, x, weight, weight_scale, lora, batch, k1_config,
                           k2_config, decode=decode, quantize=quantize, pdl=pdl,
                           counted=counted, warm_l2=warm_l2, wait_k1_first=wait_k1_first,
                           has_bias=has_bias, lead=lead)
    _tiling.check_gemm_config(cfg2, lora)
    tiles = max(_tiling.k1_tiles(t, lora, batch, cfg1),
                _tiling.k2_tiles(mode, t, lora.out_features, cfg2))
    # K1 writes its codes in adapter order where K2 reads them by TMA (K1 allocates them
    # [T, K] contiguous: rows 16-byte aligned when K is a multiple of 16).
    a_sorted = quantize and _tiling.w_tma(support, weight, cfg2) and x.shape[1] % 16 == 0
    # h in bf16 for K2's tiles of 64 rows or more (their epilogue reads every row's h per output
    # tile; it rounds h to bf16 anyway): at 256 tokens, rank 128, bf16 h everywhere made the
    # layer ~1 us faster and the 16- and 32-row decode tiles slower (docs/kernels-history.md,
    # items 27 and 42).
    h_dtype = torch.bfloat16 if cfg2.block_m >= 64 and not lead else torch.float32
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _PLANS[key] = (cfg1, cfg2, tiles, a_sorted, h_dtype)
    return plan


def _k2_config(support, mode, a_dtype, weight, weight_scale, lora, batch, given, *, pdl,
               wait_codes=False, warm_l2=0, wait_k1_first=False, has_bias=False):
    # K2's settings: given, else the table's or the heuristic's; at the decode token counts
    # (16- and 32-row tiles) then fitted to the device's waves unless tuned on this very shape
    # (`_launchers.fit_k2_waves`, which loads the compiled candidates, in the variant that will
    # launch, on the weight's device; without an L2Prefetch, a few registers outside the K
    # loop: a call with one takes the same tiles, so the same bits, as one without). Every path
    # that launches K2 asks here, so K2 alone and inside a fused call take the same tiles and
    # give the same bits (the same compiled variant
    # is fitted up to 32 tokens, where the fused call launches without PDL; beyond, only a
    # tuner entry of 16- or 32-row tiles could be fitted differently). Swapped tiles are not
    # fitted: the tuner sized their pipelines to one wave (`launch.swap_candidates`), which
    # the fitting's 3-stage candidates would cut.
    cfg = _tiling.gemm_config(support, batch, lora, given)
    if given is None and mode == W8A16:
        cfg = _w8a16_tiles(cfg, _tiling.w_tma(support, weight, cfg))
    if (given is None and not support.interpreter and weight.is_cuda and cfg.block_m <= 32
            and not cfg.swap_ab and not _tiling.gemm_tuned_exactly(support, batch, lora)):
        cfg = _launchers.fit_k2_waves(
            support, mode, a_dtype, weight, weight_scale, torch.float32, lora, batch, cfg,
            pdl=_launchers.use_pdl(support, pdl), wait_codes=wait_codes, warm_l2=warm_l2,
            wait_k1_first=wait_k1_first, has_bias=has_bias)
    return cfg


def decode_settings(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    lora: LoraWeights, batch: AdapterBatch, *,
                    codes: bool = False) -> tuple[LaunchConfig, LaunchConfig]:
    """The launch settings (K1's, K2's) `decode_lora_fp8_linear` takes for this case when given
    none (the tuner starts from them); `codes`: called with `x_quantized` (x's shape and device
    are what count here)."""
    support = _support(x, "decode")
    lead = one_launch(support, FP8, x.shape[0], batch, decode=True, pdl=True,
                      quantize=not codes, prefetch=None)
    return _settings(support, FP8, x, weight, weight_scale, lora, batch, None, None,
                     decode=True, quantize=not codes, pdl=True, counted=not codes,
                     warm_l2=DECODE_WARM_L2, wait_k1_first=False, lead=lead)


def _linear(mode, x, weight, weight_scale, lora, batch, k1_config, k2_config, *,
            decode=False, pdl=False, warm_l2=DECODE_WARM_L2, traces=(None, None),
            wait_k1_first=False, workspace=None, x_quantized=None, bias=None, prefetch=None):
    # MODE FP8: K1 (quantize + shrink) then K2; MODE W8A16: the shrink then the W8A16 K2.
    # `decode`: the decode path's launch settings. With `pdl` K2 is launched as K1's
    # programmatic dependent, waiting for K1's count of quantized rows before its K loop, or
    # with `wait_k1_first` (the fused path) for all of K1.
    path = "decode" if decode else "fused" if mode == FP8 else "w8a16"
    shrink_codes = x is None  # the shrink reads the caller's codes (x_quantized)
    if shrink_codes:
        if x_quantized is None or mode != FP8:
            raise ValueError(f"x is None: the {path} path needs x_quantized, the codes and "
                             "scales its shrink and GEMM read")
        _checks.check_quantized_inputs(*x_quantized, lora, batch)
        x = x_quantized[0]  # the rows' count, device and features from here on
    else:
        _checks.check_inputs(x, lora, batch)
    _checks.check_weight(weight, weight_scale, lora.in_features, lora.out_features, x.device)
    if x_quantized is not None and not shrink_codes:
        _checks.check_codes_beside(x, *x_quantized)
    _checks.check_bias(bias, lora.out_features, x.device)
    kernel_args(prefetch, x.device)  # refused before K1 launches, not after
    _env.delta_kernel()  # (launch_k2 reads them) bad values refused before K1 launches too
    _env.epilogue_early()
    quantize = mode == FP8 and x_quantized is None  # K1 quantizes
    support = _support(x, path)
    if decode and pdl and not (support.pdl or support.interpreter):
        raise UnsupportedError(f"the decode path needs PDL (sm_90); {support.name} is "
                               f"{support.arch}: use fused_lora_fp8_linear or pdl=False")
    workspace = _workspace(workspace, x.device)
    t = x.shape[0]
    # EPILORA_DECODE_AFTER_PREVIOUS: K1 launched as the programmatic dependent of the kernel
    # before it (which it waits for before triggering K2).
    after_previous = decode and pdl and _env.decode_after_previous()
    # Only a quantizing K1 counts rows: a K2 waiting for a count nobody makes would spin forever.
    counted = pdl and quantize and not wait_k1_first
    lead = one_launch(support, mode, t, batch, decode=decode, pdl=pdl, quantize=quantize,
                      prefetch=prefetch)
    cfg1, cfg2, tiles, a_sorted, h_dtype = _plan(
        support, mode, x, weight, weight_scale, lora, batch, k1_config, k2_config,
        decode=decode, quantize=quantize, pdl=pdl, counted=counted, warm_l2=warm_l2,
        wait_k1_first=wait_k1_first, has_bias=bias is not None, lead=lead)
    # Everything K2 needs is checked and sized before K1 launches: a K2 that failed after it
    # would leave K1's count of quantized rows set, and a counter buffer grown between the
    # launches would put a fill kernel between K1 and its dependent and free K1's counters
    # while K1 runs.
    counters = workspace.counters(tiles)  # K1's and K2's, asked once
    y = torch.empty(t, lora.out_features, dtype=torch.bfloat16, device=x.device)
    if lead:
        return _launchers.launch_lead(
            support, workspace, x, x_quantized[1] if shrink_codes else None, *x_quantized,
            weight, weight_scale, y, lora, batch, cfg1, cfg2, counters=counters,
            trace=traces[1], bias=bias)
    codes, scales, h = _launchers.launch_k1(support, workspace, x, lora, batch, cfg1,
                                            quantize=quantize, pdl=pdl,
                                            signal_codes=counted, trace=traces[0],
                                            codes_sorted=a_sorted, h_dtype=h_dtype,
                                            x_scales=x_quantized[1] if shrink_codes else None,
                                            counters=counters, after_previous=after_previous)
    a, a_scale = ((codes, scales) if quantize else x_quantized if mode == FP8
                  else (x, weight_scale))
    try:
        return _launchers.launch_k2(support, workspace, mode, a, a_scale, weight, weight_scale,
                                    y, h, lora, batch, cfg2, pdl=pdl, wait_codes=counted,
                                    warm_l2=warm_l2, trace=traces[1],
                                    wait_k1_first=wait_k1_first, a_sorted=a_sorted,
                                    counters=counters, bias=bias, prefetch=prefetch)
    except BaseException:
        # K2 did not launch (a compile error, an interrupt): K1's counts would make the next
        # K2 on this workspace pass its wait early. Zeroed in stream order, after K1 (under
        # compile_only K1 counted nothing, and another thread may be between its K1 and K2).
        if not _launchers.compiling_only():
            workspace.reset()
        raise
