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
  (our GEMM against CUTLASS), and the two in a row.

Weights are `[N, K]` float8_e4m3fn (row-major, K contiguous; vLLM keeps their transpose view)
with a one-element fp32 scale; activations `[T, K]` bf16.
"""

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from epilora_kernels import _env, _workspace
from epilora_kernels._fused_kernels import _lora_gemm_kernel, _quantize_shrink_kernel
from epilora_kernels.batch import AdapterBatch, LoraWeights
from epilora_kernels.launch import DECODE_SHRINK_MAX_TOKENS, LaunchConfig, select_config


def _config(op: str, tokens: int, lora: LoraWeights, given: LaunchConfig | None,
            one_slot: bool = False):
    if given is not None:
        return given
    return _shape_config(op, tokens, lora.out_features, lora.in_features, lora.max_rank,
                         lora.output_slices, one_slot)


def _shape_config(op: str, tokens: int, n: int, k: int, rank: int, slices: tuple[int, ...],
                  one_slot: bool = False):
    on_gpu = torch.cuda.is_available() and not _env.triton_interpreter()
    return select_config(torch.cuda.get_device_name() if on_gpu else None, op, tokens, n, k,
                         rank, slices, one_slot)


def _check_activations(x: torch.Tensor) -> None:
    if x.ndim != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D bfloat16 with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)}")


def _check_inputs(x: torch.Tensor, lora: LoraWeights, batch: AdapterBatch) -> None:
    _check_activations(x)
    if x.shape[1] != lora.in_features:
        raise ValueError(f"x has {x.shape[1]} features, the adapters take {lora.in_features}")
    if batch.num_tokens != x.shape[0]:
        raise ValueError(f"batch maps {batch.num_tokens} tokens, x has {x.shape[0]}")
    if batch.max_loras != lora.max_loras:
        raise ValueError(f"batch has {batch.max_loras} slots, the adapters {lora.max_loras}")


def _check_weight(weight: torch.Tensor, weight_scale: torch.Tensor, k: int, n: int) -> None:
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (n, k):
        raise ValueError(f"weight must be float8_e4m3fn [{n}, {k}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous [N, K] (K-major)")
    if weight_scale.numel() != 1 or weight_scale.dtype != torch.float32:
        raise ValueError("weight_scale must be one fp32 value (per-tensor FP8 weights)")


def _slice_args(lora: LoraWeights) -> tuple:
    slices = list(lora.output_slices) + [0] * (3 - len(lora.output_slices))
    off1 = slices[0] if len(lora.output_slices) > 1 else lora.out_features
    off2 = slices[0] + slices[1] if len(lora.output_slices) > 2 else lora.out_features
    a = list(lora.lora_a) + [lora.lora_a[0]] * (3 - len(lora.lora_a))
    b = list(lora.lora_b) + [lora.lora_b[0]] * (3 - len(lora.lora_b))
    return a, b, off1, off2


def _trace_arg(trace: torch.Tensor | None, unused: torch.Tensor, programs: int) -> torch.Tensor:
    # `trace`: int64 [>= programs, 8] for the kernels' timestamps, a row per program
    # (benchmarks/decode_timeline.py; never under the interpreter, which has no clock);
    # otherwise any pointer, never written.
    if trace is None:
        return unused
    if (trace.dtype != torch.int64 or not trace.is_contiguous() or trace.ndim != 2
            or trace.shape[1] != 8 or trace.shape[0] < programs):
        raise ValueError(f"trace must be a contiguous int64 tensor [>= {programs}, 8], got "
                         f"{trace.dtype} {tuple(trace.shape)}")
    return trace


def _use_pdl(pdl: bool) -> bool:
    # The interpreter has no PDL intrinsics; the launch attribute alone it ignores. (The decode
    # path's count of quantized rows runs there too: K1 counts, K2 spins and resets.)
    return pdl and not _env.triton_interpreter()


def _shrink_programs(t: int, lora: LoraWeights, batch: AdapterBatch, cfg: LaunchConfig) -> int:
    # K1's shrink programs: one per (row tile of the entries' list, slice, rank tile, split).
    # The entries' row tiles number at most cdiv(T, block_m) + (entries with tokens) - 1, and
    # at most min(entries, T) entries have tokens.
    row_tiles = max(0, triton.cdiv(t, cfg.block_m) + min(batch.num_entries, t) - 1)
    return (row_tiles * triton.cdiv(lora.max_rank, cfg.block_r) * len(lora.output_slices)
            * cfg.split_k)


def _k1_tiles(t: int, lora: LoraWeights, batch: AdapterBatch, cfg: LaunchConfig) -> int:
    # K1's split-K tile counters, indexed by (entry, slice, row tile, rank tile): room for all.
    if cfg.split_k == 1:
        return 0
    return (batch.num_entries * triton.cdiv(t, cfg.block_m)
            * triton.cdiv(lora.max_rank, cfg.block_r) * len(lora.output_slices))


def _launch_k1(x, lora, batch, cfg: LaunchConfig, quantize: bool, pdl: bool = False,
               signal_codes: bool = False, trace: torch.Tensor | None = None,
               codes_sorted: bool = False, h_dtype: torch.dtype = torch.float32):
    t, k = x.shape
    s_count, rank = len(lora.output_slices), lora.max_rank
    # Split-K partials in fp32 planes, which K1 sums into h [1, S, T, R] of `h_dtype`: fp32 h
    # is plane 0 itself, bf16 h a buffer of its own.
    partials = torch.empty(cfg.split_k, s_count, t, rank, dtype=torch.float32, device=x.device)
    h = (partials[:1] if h_dtype == torch.float32 else
         torch.empty(1, s_count, t, rank, dtype=h_dtype, device=x.device))
    if quantize:
        codes = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    else:
        codes, scales = partials, partials  # unused
    a, _, _, _ = _slice_args(lora)
    entries = batch.num_entries
    counters = _workspace.counters(x.device, _k1_tiles(t, lora, batch, cfg))
    grid = ((t if quantize else 0) + _shrink_programs(t, lora, batch, cfg),)
    _quantize_shrink_kernel[grid](
        x, codes, scales, h, partials, a[0], a[1], a[2],
        batch.sorted_token_indices, batch.lora_ids, batch.num_tokens_per_lora,
        batch.lora_token_start, counters[_workspace.TILES:], counters,
        _trace_arg(trace, counters, grid[0]),
        t, k, rank, x.stride(0), entries,
        QUANTIZE=quantize, SIGNAL_CODES=signal_codes, CODES_SORTED=codes_sorted,
        NUM_SLICES=s_count, SPLIT_K=cfg.split_k,
        BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k,
        QUANT_BLOCK=_quant_block(k, 16384 if cfg.num_warps >= 8 else 4096),
        INTERPRETER=_env.triton_interpreter(), ENTRIES_BLOCK=triton.next_power_of_2(entries),
        USE_PDL=_use_pdl(pdl), TRACE=trace is not None, H_BF16=h_dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return codes, scales, h


def _quant_block(k: int, cap: int) -> int:
    # Row chunk of the quantizing programs. With 8 warps a row of up to 16384 features
    # (Qwen3-8B's widest input is 12288) stays in registers, 64 values a thread, and is read
    # once; with 4 warps beside the shrink's tiles in K1 a 16384 chunk spilled and made K1 ~10x
    # slower (benchmarks/results/h200/tune_v2.json), so there rows go in chunks of 4096, read
    # twice (the decode timeline shows the 12288-wide row's codes done last: K1 with 8 warps is
    # a tuning candidate for it).
    return min(triton.next_power_of_2(k), cap)


def _launch_quantize(x: torch.Tensor):
    """K1's quantizing programs alone: one per token."""
    t, k = x.shape
    codes = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    unused = torch.empty(1, dtype=torch.int32, device=x.device)  # the shrink's, never read
    _quantize_shrink_kernel[(t,)](
        x, codes, scales, scales, scales, x, x, x, unused, unused, unused, unused, unused, unused,
        unused,
        t, k, 1, x.stride(0), 1,
        QUANTIZE=True, SIGNAL_CODES=False, CODES_SORTED=False, NUM_SLICES=1, SPLIT_K=1,
        BLOCK_M=16, BLOCK_R=16,
        BLOCK_K=16, QUANT_BLOCK=_quant_block(k, 16384), INTERPRETER=_env.triton_interpreter(),
        ENTRIES_BLOCK=1,
        num_warps=8, num_stages=1,
    )
    return codes, scales


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K1's quantization alone: `(codes [T, K] fp8, scales [T, 1] fp32)`, per-token FP8 bit for
    bit as vLLM's compiled quantizer (what vLLM runs before its CUTLASS GEMM)."""
    _check_activations(x)
    return _launch_quantize(x)


def quantize_and_shrink(
    x: torch.Tensor, lora: LoraWeights, batch: AdapterBatch, *, config: LaunchConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K1: `(codes [T, K] fp8, scales [T, 1] fp32, h [1, S, T, R] fp32)`; split-K partials are
    summed in K1, in a fixed order."""
    _check_inputs(x, lora, batch)
    cfg = _config("quantize_shrink", x.shape[0], lora, config)
    return _launch_k1(x, lora, batch, cfg, quantize=True)


def lora_shrink(
    x: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The hybrid path's shrink: `h [1, S, T, R]` fp32, `x A_slot^T` per token and slice."""
    _check_inputs(x, lora, batch)
    cfg = _config("shrink", x.shape[0], lora, config)
    return _launch_k1(x, lora, batch, cfg, quantize=False)[2]


def _split_k(mode: int, cfg: LaunchConfig) -> int:
    return 1 if mode == 2 else cfg.split_k  # the expand has no K loop to split


def _gemm_grid(mode: int, t: int, n: int, cfg: LaunchConfig) -> tuple[int, int, int]:
    return (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n), _split_k(mode, cfg))


def _k2_tiles(mode: int, t: int, n: int, cfg: LaunchConfig) -> int:
    # K2's split-K tile counters, one per output tile.
    grid = _gemm_grid(mode, t, n, cfg)
    return 0 if grid[2] == 1 else grid[0] * grid[1]


def _gemm_workspace(mode, t, n, cfg: LaunchConfig, device):
    """The grid, the split-K partials (None without split-K) and the counter buffer."""
    grid = _gemm_grid(mode, t, n, cfg)
    if grid[2] == 1:
        return grid, None, _workspace.counters(device, 0)
    partial = torch.empty(grid[2], grid[0] * cfg.block_m, n, dtype=torch.float32, device=device)
    return grid, partial, _workspace.counters(device, _k2_tiles(mode, t, n, cfg))


def _launch_k2(mode, a, a_scale, weight, weight_scale, y, h, lora, batch, cfg: LaunchConfig,
               pdl: bool = False, wait_codes: bool = False, warm_l2: int = 0,
               trace: torch.Tensor | None = None, wait_k1_first: bool = False,
               a_sorted: bool = False):
    t, n = y.shape
    k = lora.in_features
    _, b, off1, off2 = _slice_args(lora)
    if any(w % cfg.block_n for w in lora.output_slices[:-1]):
        raise ValueError(f"block_n={cfg.block_n} must divide the slice widths "
                         f"{lora.output_slices[:-1]} (a tile must not straddle two slices)")
    if cfg.block_r < lora.max_rank:
        raise ValueError(f"block_r={cfg.block_r} must cover the adapters' max rank "
                         f"{lora.max_rank}: K2's epilogue reads all of h in one tile")
    grid, partial, counters = _gemm_workspace(mode, t, n, cfg, y.device)
    entries = batch.num_entries
    w_operand = _w_operand(weight, cfg)
    _lora_gemm_kernel[grid](
        a, _a_desc(a, cfg) if a_sorted else a, a_scale, weight, w_operand, weight_scale, y, h,
        b[0], b[1], b[2],
        batch.sorted_token_indices, batch.lora_ids, batch.lora_token_start,
        y if partial is None else partial, counters[_workspace.TILES:], counters,
        _trace_arg(trace, counters, grid[0] * grid[1] * grid[2]), t, n, k, lora.max_rank,
        entries,
        a.stride(0), y.stride(0), off1, off2,
        MODE=mode, HAS_LORA=True, NUM_SLICES=len(lora.output_slices), H_PLANES=h.shape[0],
        SPLIT_K=grid[2], ENTRIES_BLOCK=triton.next_power_of_2(entries),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r,
        INTERPRETER=_env.triton_interpreter(), USE_PDL=_use_pdl(pdl),
        WAIT_CODES=wait_codes, WARM_L2=warm_l2 if wait_codes else 0, TRACE=trace is not None,
        B_IN_REGS=_b_in_registers(cfg), R_CHUNK=_epilogue_rank_chunk(cfg),
        W_TMA=w_operand is not weight, WAIT_K1_FIRST=wait_k1_first and _use_pdl(pdl),
        A_TMA=a_sorted,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=_use_pdl(pdl),
    )
    return y


def _w_tma(weight: torch.Tensor, cfg: LaunchConfig) -> bool:
    # Prefill tiles (64 rows or more, wgmma) read the weight tile by TMA, which needs 16-byte
    # aligned rows: 1x128 at 256 tokens 187.4 -> 183.6 us. The 16- and 32-row decode tiles
    # (MMAv2) were slower with it (results/h200/layer_1x128_tma_hbf16_ab_*.json and
    # layer_decode_tma_ab_*.json).
    return cfg.block_m >= 64 and weight.stride(0) % 16 == 0 and weight.data_ptr() % 16 == 0


def _a_tma(a: torch.Tensor, weight: torch.Tensor, cfg: LaunchConfig) -> bool:
    # FP8 codes read by TMA where the weight is (tiles of 64 rows or more), rows 16-byte
    # aligned; K1 then writes them in adapter order (CODES_SORTED), so each row tile is a
    # contiguous block of rows.
    return (_w_tma(weight, cfg) and a.stride(1) == 1 and a.stride(0) % 16 == 0
            and a.data_ptr() % 16 == 0)


def _a_desc(a: torch.Tensor, cfg: LaunchConfig):
    return TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])


def _w_operand(weight: torch.Tensor, cfg: LaunchConfig):
    # K2's weight operand: a TMA descriptor of its [block_n, block_k] tiles (W_TMA), or the
    # weight itself for pointer loads.
    if _w_tma(weight, cfg):
        return TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    return weight


def _b_fits_registers(cfg: LaunchConfig) -> bool:
    # The first adapter segment's slice of B (block_n x block_r bf16) is at most 32 values a
    # thread (at rank 128, 64 a thread cost gate_up's 16-row K2 a third of its blocks per SM:
    # results/cpu/sm90_occupancy.json of f2cbeef, in git history).
    return cfg.block_n * cfg.block_r <= 32 * 32 * cfg.num_warps


def _b_in_registers(cfg: LaunchConfig) -> bool:
    # Whether K2 loads that slice before its K loop and holds it there. A 16-row tile (decode,
    # 1-16 tokens) whose slice does not fit only warms L2 with it and loads it after the wait:
    # the rank-128 decode layer got faster at 1-16 tokens. At 32 tokens (32-row tiles) the
    # decode layer got slower that way (results/h200/decode_ed9125f.json against
    # decode_993031f.json), so those hold it whatever its size. Larger tiles with one slot
    # step through the rank instead (_epilogue_rank_chunk); with several slots none is loaded
    # early.
    return _b_fits_registers(cfg) or cfg.block_m == 32


def _epilogue_rank_chunk(cfg: LaunchConfig) -> int:
    # Prefill tiles (64 rows or more) whose slice of B is too big to hold in registers add
    # h B^T in 32-wide rank steps, pipelined loops: whole, h and B took K2 past 200 registers
    # at rank 128 (results/cpu/sm90_occupancy_b_first_l2.json; with the steps,
    # sm90_occupancy.json), and stepping made the rank-128 layer faster at 64-256 tokens
    # (results/h200/layer.json against layer_run4_b_first_l2_1x128.json). Stepping every tile
    # of 64 rows or more (results/h200/layer_run5_rank_steps_everywhere.json) was slower where
    # B fits (rank 64 in 64-wide tiles) and with several slots, where that loop reloaded h for
    # every segment and step; several slots now load each step of h once (32 adapters at 128
    # tokens faster: results/h200/compare_branches_32x64.md).
    # 0: the whole rank.
    return 32 if cfg.block_m >= 64 and not _b_fits_registers(cfg) else 0


def _one_slot(batch: AdapterBatch) -> bool:
    # One slot (and the entry for tokens without one): K2 compiles its one-slot epilogue
    # (ENTRIES_BLOCK 2), which the table's one-slot entries were tuned on; K1's row tiles grow
    # with the slots (rank 64's one-slot 4-token K1 entries made the 32-adapter layer at 4
    # tokens 5.5 us slower as plain rank entries: results/h200/layer_32x64_k1_r64_4_plain.json).
    return batch.num_entries <= 2


def _gemm_config(batch, lora, config):
    return _config("lora_gemm", batch.num_tokens, lora, config, one_slot=_one_slot(batch))


def _launch_gemm_only(mode, a, a_scale, weight, weight_scale, cfg: LaunchConfig | None,
                      trace: torch.Tensor | None = None):
    t, k = a.shape
    n = weight.shape[0]
    cfg = cfg or _shape_config("lora_gemm", t, n, k, 16, ())
    a_tma = mode == 0 and _a_tma(a, weight, cfg)  # rows in their own order: no sorting needed
    y = torch.empty(t, n, dtype=torch.bfloat16, device=a.device)
    unused = torch.empty(1, dtype=torch.int32, device=a.device)  # the epilogue's, never read
    grid, partial, counters = _gemm_workspace(mode, t, n, cfg, a.device)
    w_operand = _w_operand(weight, cfg)
    _lora_gemm_kernel[grid](
        a, _a_desc(a, cfg) if a_tma else a, a_scale, weight, w_operand, weight_scale, y,
        weight_scale, weight, weight, weight,
        unused, unused, unused, y if partial is None else partial,
        counters[_workspace.TILES:], counters,
        _trace_arg(trace, unused, grid[0] * grid[1] * grid[2]),
        t, n, k, 1, 0, a.stride(0), y.stride(0), n, n,
        MODE=mode, HAS_LORA=False, NUM_SLICES=1, H_PLANES=1, SPLIT_K=grid[2], ENTRIES_BLOCK=16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=16,
        INTERPRETER=_env.triton_interpreter(), W_TMA=w_operand is not weight, A_TMA=a_tma,
        TRACE=trace is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def fp8_gemm(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """K2 without adapters: bf16 `[T, N]` = x_scale * (w_scale * codes @ weight^T), the GEMM
    that competes with vLLM's CUTLASS."""
    _check_weight(weight, weight_scale, codes.shape[1], weight.shape[0])
    return _launch_gemm_only(0, codes, scales, weight, weight_scale, config)


def fp8_gemm_from_bf16(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """`quantize` then `fp8_gemm`: the same two steps as vLLM's quantizer + CUTLASS."""
    _check_activations(x)
    _check_weight(weight, weight_scale, x.shape[1], weight.shape[0])
    codes, scales = _launch_quantize(x)
    return _launch_gemm_only(0, codes, scales, weight, weight_scale, config)


def lora_fp8_gemm(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    h: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    config: LaunchConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """K2: bf16 `[T, N]` = x_scale * (w_scale * codes @ weight^T) + bf16(h) @ B_slot^T.

    `pdl=True` launches it as the programmatic dependent of the kernel before it, which it
    waits for only before its epilogue: that kernel may compute h, not the codes or scales."""
    _check_weight(weight, weight_scale, lora.in_features, lora.out_features)
    y = torch.empty(codes.shape[0], lora.out_features, dtype=torch.bfloat16, device=codes.device)
    return _launch_k2(0, codes, scales, weight, weight_scale, y, h, lora, batch,
                      _gemm_config(batch, lora, config), pdl=pdl)


def lora_w8a16_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    h: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """W8A16 K2: bf16 `[T, N]` = w_scale * (x @ bf16(weight)^T) + bf16(h) @ B_slot^T."""
    _check_inputs(x, lora, batch)
    _check_weight(weight, weight_scale, lora.in_features, lora.out_features)
    y = torch.empty(x.shape[0], lora.out_features, dtype=torch.bfloat16, device=x.device)
    return _launch_k2(1, x, weight_scale, weight, weight_scale, y, h, lora, batch,
                      _gemm_config(batch, lora, config))


def decode_lora_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    k1_config: LaunchConfig | None = None,
    k2_config: LaunchConfig | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """The decode path: K1 (quantize + shrink), and K2 launched as K1's programmatic dependent
    while K1 runs. K2 waits for K1's quantizing programs (their count of finished rows, a spin
    on a counter they release; it prefetches the first `DECODE_WARM_L2` bytes of its weight rows
    into L2 meanwhile) before its K loop, and for the whole of K1 (`gdc_wait`, so h) only
    before its epilogue: its weight stream overlaps the shrink. `pdl=False` runs the same
    kernels serialized; both give the same bits, and the same bits as `fused_lora_fp8_linear`
    with equal configs."""
    return _linear(0, x, weight, weight_scale, lora, batch, k1_config, k2_config,
                   decode=True, pdl=pdl)


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The hybrid path's expand: y (bf16 `[T, N]`, a vendor GEMM's output) += bf16(h) B^T."""
    if y.dtype != torch.bfloat16 or y.ndim != 2 or y.shape[1] != lora.out_features:
        raise ValueError(f"y must be bf16 [T, {lora.out_features}], got {y.dtype} "
                         f"{tuple(y.shape)}")
    return _launch_k2(2, y, y, y, y, y, h, lora, batch, _gemm_config(batch, lora, config))


def fused_lora_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    k1_config: LaunchConfig | None = None,
    k2_config: LaunchConfig | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """The fused path: K1 then K2. With `pdl`, beyond 32 tokens (DECODE_SHRINK_MAX_TOKENS), K2
    is launched as K1's programmatic dependent, which hides its launch and its prologue; it
    waits for all of K1 before its K loop (the same bits as `pdl=False`)."""
    # Only beyond the decode path's token counts: at 16-32 tokens PDL made the fused layer
    # slower (benchmarks/results/h200/layer.json of a1a405a against 80936cc's).
    return _linear(0, x, weight, weight_scale, lora, batch, k1_config, k2_config,
                   pdl=pdl and x.shape[0] > DECODE_SHRINK_MAX_TOKENS, wait_k1_first=True)


def fused_lora_w8a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    k1_config: LaunchConfig | None = None,
    k2_config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The matched engine's path: shrink, then the W8A16 GEMM with the up-projection."""
    return _linear(1, x, weight, weight_scale, lora, batch, k1_config, k2_config)


# The decode path's K2 prefetches the first bytes of each of its weight rows into L2 before it
# spins on K1's count of quantized rows: 512 made the layer faster, or no slower, at every rank
# (16-128) and token count (1-16) measured; 2048 made the spin itself longer and the layer
# slower (benchmarks/results/h200/decode_timeline_v1.json, decode_timeline.json).
DECODE_WARM_L2 = 512


def _linear(mode, x, weight, weight_scale, lora, batch, k1_config, k2_config, *,
            decode=False, pdl=False, warm_l2=DECODE_WARM_L2, traces=(None, None),
            wait_k1_first=False):
    # MODE 0: K1 (quantize + shrink) then K2; MODE 1: the shrink then the W8A16 K2. `decode`:
    # the decode path's launch settings. With `pdl` K2 is launched as K1's programmatic
    # dependent, waiting for K1's count of quantized rows before its K loop, or with
    # `wait_k1_first` (the fused path) for all of K1.
    _check_inputs(x, lora, batch)
    _check_weight(weight, weight_scale, lora.in_features, lora.out_features)
    op1 = "decode_shrink" if decode else "quantize_shrink" if mode == 0 else "shrink"
    cfg1 = _config(op1, x.shape[0], lora, k1_config, one_slot=_one_slot(batch))
    cfg2 = _gemm_config(batch, lora, k2_config)
    y = torch.empty(x.shape[0], lora.out_features, dtype=torch.bfloat16, device=x.device)
    # The counter buffer, grown (if at all) before K1: grown between the launches, it would put
    # a fill kernel between K1 and its dependent K2 and free K1's counters while K1 runs.
    _workspace.counters(x.device, max(_k1_tiles(x.shape[0], lora, batch, cfg1),
                                      _k2_tiles(mode, x.shape[0], lora.out_features, cfg2)))
    # Only a quantizing K1 counts rows: a K2 waiting for a count nobody makes would spin forever.
    counted = pdl and mode == 0 and not wait_k1_first
    # K1 writes its codes in adapter order where K2 reads them by TMA (K1 allocates them
    # [T, K] contiguous: rows 16-byte aligned when K is a multiple of 16).
    a_sorted = mode == 0 and _w_tma(weight, cfg2) and x.shape[1] % 16 == 0
    # h in bf16 for K2's tiles of 64 rows or more (their epilogue reads every row's h per output
    # tile; it rounds h to bf16 anyway): at 256 tokens, rank 128, bf16 h everywhere made the
    # layer ~1 us faster and the 16- and 32-row decode tiles slower (docs/kernels.md, item 27);
    # here, on top of the one-slot epilogue, the rank-128 layer at 64-256 tokens 1-3 us faster
    # (results/h200/compare_one_slot_epilogue.md, item 42).
    h_dtype = torch.bfloat16 if cfg2.block_m >= 64 else torch.float32
    codes, scales, h = _launch_k1(x, lora, batch, cfg1, quantize=mode == 0, pdl=pdl,
                                  signal_codes=counted, trace=traces[0], codes_sorted=a_sorted,
                                  h_dtype=h_dtype)
    a, a_scale = (codes, scales) if mode == 0 else (x, weight_scale)
    return _launch_k2(mode, a, a_scale, weight, weight_scale, y, h, lora, batch, cfg2, pdl=pdl,
                      wait_codes=counted, warm_l2=warm_l2, trace=traces[1],
                      wait_k1_first=wait_k1_first, a_sorted=a_sorted)
