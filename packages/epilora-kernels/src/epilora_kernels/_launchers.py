"""The kernels' launches, every argument named: inputs checked and settings chosen by the
callers (`epilora_kernels.fused`); here only the buffers, the grid and the compile-time flags.

A pointer a launch does not use is passed as `unused` (any tensor of the device, never read or
written: its flag compiles the access out)."""

import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError
from triton.runtime.jit import MockTensor
from triton.tools.tensor_descriptor import TensorDescriptor

from epilora_kernels import _env, _fast_launch, _tiling
from epilora_kernels._fused_kernels import (
    _lora_gemm_kernel,
    _quantize_shrink_kernel,
    _segment_delta_kernel,
)
from epilora_kernels.arch import DeviceSupport
from epilora_kernels.batch import MAX_SLICES, AdapterBatch, LoraWeights
from epilora_kernels.launch import LaunchConfig, fit_slices, rank_block
from epilora_kernels.prefetch import L2Prefetch, kernel_args
from epilora_kernels.workspace import TILES, Workspace

try:  # compile_only's threads: Triton's asynchronous compiles, a private module (Triton 3.6)
    from triton.runtime import _async_compile as _async
except ImportError:  # another Triton: compile_only compiles in the calling thread
    _async = None

TRACE_EVENTS = 8  # int64 slots per program in a trace buffer (dev/decode_timeline.py)

_THREAD = threading.local()  # compile_only's flag: per thread, so other threads launch


class CompileCount:
    """The kernels a `compile_only` block's calls have met so far (its value)."""

    def __init__(self) -> None:
        self.kernels: dict[int, object] = {}  # id -> Triton's kernel (or its future compile)

    @property
    def variants(self) -> int:
        """Distinct kernels the block's calls would have launched so far."""
        return len(self.kernels)


@contextlib.contextmanager
def compile_only(threads: int = 1):
    """Inside, the calls this thread makes compile the kernels they would launch, with the
    launches' own arguments (Triton's `warmup`: the same in-memory and disk cache entries), and
    launch nothing: their outputs are left unwritten, the workspace's counters untouched. For
    an engine that knows its batch sizes, before CUDA-graph capture or in a thread beside other
    start-up work; other threads launch as usual. Under the interpreter nothing compiles.

    `threads` > 1: the compiles run in that many threads (Triton's compiler and ptxas release
    the GIL: a third to half off on two cores); leaving the block waits for them all and raises
    the first compile's error, if any (none while another exception leaves it). Inside an
    outer `compile_only` with threads, the outer one's threads compile and its exit waits.

    The block's value is a `CompileCount`: `variants` is how many distinct kernels the calls
    in the block so far would have launched (each compiled, loaded from Triton's disk cache or
    found in memory), so that a caller can tell which of its calls met kernels new to the
    block."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    previous, previous_count = compiling_only(), getattr(_THREAD, "compile_count", None)
    _THREAD.compile_only = True
    count = _THREAD.compile_count = CompileCount()
    pool = mode = None
    if (threads > 1 and _async is not None and not _env.triton_interpreter()
            and _async.active_mode.get() is None):
        pool = ThreadPoolExecutor(threads, thread_name_prefix="epilora-compile")
        mode = _async.AsyncCompileMode(pool)
        token = _async.active_mode.set(mode)  # this thread's (a context variable)
    failed = True
    try:
        yield count
        failed = False
    finally:
        _THREAD.compile_only, _THREAD.compile_count = previous, previous_count
        if mode is not None:
            _async.active_mode.reset(token)
            try:  # each compile's kernel into its JIT cache, as Triton's own mode's exit does
                for future in as_completed(mode.raw_futures):
                    mode.future_kernels[future._key].result(ignore_errors=failed)
            finally:
                pool.shutdown()


@contextlib.contextmanager
def _compiling_in_this_thread():
    # Compiles that the caller needs at once (and whose errors it handles) bypass
    # compile_only's threads.
    if _async is None:
        yield
        return
    token = _async.active_mode.set(None)
    try:
        yield
    finally:
        _async.active_mode.reset(token)


def compiling_only() -> bool:
    """Whether this thread is inside `compile_only`."""
    return getattr(_THREAD, "compile_only", False)


def _start(kernel, grid: tuple, **arguments) -> None:
    # Every launch goes through here: on a GPU by the compiled kernel's launcher once Triton has
    # launched it with arguments that specialize the same (`_fast_launch`); in compile_only,
    # Triton's `warmup` (the same compile and cache entry as the launch, no run); the
    # interpreter compiles nothing.
    interpreter = _env.triton_interpreter()
    if not compiling_only():
        if interpreter:
            kernel[grid](**arguments)
        else:
            _fast_launch.launch(kernel, grid, arguments)
    elif not interpreter:
        # Triton's kernel for these arguments: the same object for every call that specializes
        # the same within the block (in memory, or the one future of an asynchronous compile).
        compiled = kernel.warmup(grid=grid, **arguments)
        _THREAD.compile_count.kernels.setdefault(id(compiled), compiled)


def _start_template(support: DeviceSupport, template: _fast_launch.Template, grid: tuple,
                    tensors: tuple) -> None:
    # `_start` of a template's launch: on a GPU through the template (its tensors alone
    # specialized), in compile_only and under the interpreter by name (`support.interpreter`:
    # TRITON_INTERPRET as the call found it, read once a call rather than once a launch).
    if compiling_only() or support.interpreter:
        _start(template.kernel, grid, **template.arguments(tensors))
    else:
        template.launch(grid, tensors)


# K1's and K2's launch templates, by everything their fixed arguments are functions of (shapes,
# strides, settings, flags) but the token count, a slot: an eager prefill step launches each
# projection shape layer after layer, and building and specializing every argument by name took
# most of a call's host time (docs/plugin.md, "Status"); an engine's eager steps come with ever
# new token counts (prompts plus the running decodes), which find their templates made.
_K1_TEMPLATES: dict[tuple, _fast_launch.Template] = {}
_K2_TEMPLATES: dict[tuple, _fast_launch.Template] = {}
_MAX_TEMPLATES = 1 << 12  # a process launching ever new shapes starts over past this
_K1_SLOTS = ("T", "x_ptr", "codes_ptr", "scales_ptr", "h_ptr", "partial_ptr", "a0_ptr", "a1_ptr",
             "a2_ptr", "sorted_ptr", "lora_ids_ptr", "counts_ptr", "start_ptr", "counter_ptr",
             "ready_ptr", "trace_ptr")
_K2_SLOTS = ("T", "a_ptr", "a_desc", "a_scale_ptr", "w_ptr", "w_desc", "w_scale_ptr",
             "bias_ptr", "y_ptr", "h_ptr", "b0_ptr", "b1_ptr", "b2_ptr", "sorted_ptr",
             "lora_ids_ptr", "start_ptr", "partial_ptr", "counter_ptr", "ready_ptr", "trace_ptr",
             "pf_ptr")
# K2 with the shrink's programs first (LEAD_SHRINK): K1's inputs besides
_K2_LEAD_SLOTS = _K2_SLOTS[:-1] + ("x_ptr", "x_scales_ptr", "counts_ptr", "a0_ptr", "a1_ptr",
                                   "a2_ptr")


def _keep_template(templates: dict, key: tuple,
                   template: _fast_launch.Template) -> _fast_launch.Template:
    if len(templates) >= _MAX_TEMPLATES:
        templates.clear()
    templates[key] = template
    return template


# Mode of K2: the FP8 GEMM, the W8A16 GEMM, or no GEMM (the hybrid path's expand).
FP8, W8A16, EXPAND = 0, 1, 2
# Swapped FP8 tiles promote each K tile's wgmma sum to fp32 (the kernel's SWAP_PROMOTE): the
# sums near the unswapped tiles' at a wait for the tile's MMAs. Not a setting: a constant that
# dev/launch_variants.py's `swap-ab-fast-acc` turns off to time what the promotion costs.
SWAP_AB_PROMOTE = True


def trace_arg(trace: torch.Tensor | None, unused: torch.Tensor, programs: int) -> torch.Tensor:
    # `trace`: int64 [>= programs, 8] for the kernels' timestamps, a row per program
    # (dev/decode_timeline.py; never under the interpreter, which has no clock).
    if trace is None:
        return unused
    if (trace.dtype != torch.int64 or not trace.is_contiguous() or trace.ndim != 2
            or trace.shape[1] != TRACE_EVENTS or trace.shape[0] < programs):
        raise ValueError(f"trace must be a contiguous int64 tensor [>= {programs}, "
                         f"{TRACE_EVENTS}], got {trace.dtype} {tuple(trace.shape)}")
    return trace


def use_pdl(support: DeviceSupport, pdl: bool) -> bool:
    # The interpreter has no PDL intrinsics; the launch attribute alone it ignores. (The decode
    # path's count of quantized rows runs there too: K1 counts, K2 spins and resets.)
    return pdl and support.pdl


def _slices(lora: LoraWeights) -> tuple[list, list, int, int]:
    # Per-slice A and B pointers padded to MAX_SLICES, and the output offsets of slices 1 and 2
    # (N where a slice is absent: no column reaches it).
    n, widths = lora.out_features, lora.output_slices
    pad = MAX_SLICES - len(widths)
    off1 = widths[0] if len(widths) > 1 else n
    off2 = widths[0] + widths[1] if len(widths) > 2 else n
    return (list(lora.lora_a) + [lora.lora_a[0]] * pad,
            list(lora.lora_b) + [lora.lora_b[0]] * pad, off1, off2)


def k1_buffers(t: int, k: int, lora: LoraWeights, cfg: LaunchConfig, *, quantize: bool,
               h_dtype: torch.dtype, device) -> tuple:
    """K1's outputs for `t` rows: `(partials, h, codes, scales)` (codes and scales None without
    `quantize`). Split-K partials in fp32 planes, which K1 sums into h [1, S, T, R] of
    `h_dtype`: fp32 h is plane 0 itself, bf16 h a buffer of its own."""
    s_count, rank = len(lora.output_slices), lora.max_rank
    partials = torch.empty(cfg.split_k, s_count, t, rank, dtype=torch.float32, device=device)
    h = (partials[:1] if h_dtype == torch.float32 else
         torch.empty(1, s_count, t, rank, dtype=h_dtype, device=device))
    if not quantize:
        return partials, h, None, None
    return (partials, h, torch.empty(t, k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(t, 1, dtype=torch.float32, device=device))


def k1_template(support: DeviceSupport, lora: LoraWeights, num_entries: int, cfg: LaunchConfig,
                *, stride_x: int, quantize: bool, signal_codes: bool, codes_sorted: bool,
                pdl: bool, traced: bool, h_dtype: torch.dtype,
                x_codes: bool, after_previous: bool = False) -> _fast_launch.Template:
    """K1's launch template (slots `_K1_SLOTS`) for these settings, made once.
    `after_previous`: launched as the programmatic dependent of the kernel before it, which
    it waits for before anything else, K2's trigger included (EPILORA_DECODE_AFTER_PREVIOUS)."""
    k, rank, s_count = lora.in_features, lora.max_rank, len(lora.output_slices)
    interpreter = support.interpreter
    after_previous = after_previous and use_pdl(support, pdl)  # the interpreter: in order
    key = (k, stride_x, rank, s_count, num_entries, cfg, quantize, signal_codes,
           codes_sorted, use_pdl(support, pdl), traced, h_dtype, x_codes, interpreter,
           after_previous)
    template = _K1_TEMPLATES.get(key)
    if template is None:
        fixed = dict(
            K=k, R=rank, stride_x=stride_x, NUM_ENTRIES=num_entries,
            QUANTIZE=quantize, SIGNAL_CODES=signal_codes, CODES_SORTED=codes_sorted,
            NUM_SLICES=s_count, SPLIT_K=cfg.split_k,
            BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k,
            QUANT_BLOCK=_tiling.quant_block(k, 16384 if cfg.num_warps >= 8 else 4096),
            INTERPRETER=interpreter,
            ENTRIES_BLOCK=_tiling.next_power_of_2(num_entries),
            USE_PDL=use_pdl(support, pdl), TRACE=traced,
            H_BF16=h_dtype == torch.bfloat16, X_CODES=x_codes,
            AFTER_PREVIOUS=after_previous, NUM_STAGES=cfg.num_stages,
            SLICES_TOGETHER=_tiling.slices_together(cfg, lora),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if after_previous:
            fixed["launch_pdl"] = True
        template = _keep_template(_K1_TEMPLATES, key, _fast_launch.Template(
            _quantize_shrink_kernel, fixed, _K1_SLOTS))
    return template


def k1_grid(t: int, lora: LoraWeights, batch: AdapterBatch, cfg: LaunchConfig, *,
            quantize: bool) -> tuple[int]:
    """K1's programs: one per row where it quantizes, then the shrink's."""
    return ((t if quantize else 0) + _tiling.shrink_programs(t, lora, batch, cfg),)


def launch_k1(support: DeviceSupport, workspace: Workspace, x, lora: LoraWeights,
              batch: AdapterBatch, cfg: LaunchConfig, *, quantize: bool, pdl: bool = False,
              signal_codes: bool = False, trace: torch.Tensor | None = None,
              codes_sorted: bool = False, h_dtype: torch.dtype = torch.float32,
              x_scales: torch.Tensor | None = None, counters: torch.Tensor | None = None,
              after_previous: bool = False):
    """K1: `(codes, scales, h)` (codes and scales None without `quantize`). With `x_scales`,
    x is per-token FP8 codes and those their scales: the shrink reads them (no quantizing).
    `counters`: the workspace's buffer, where the caller already asked it for this launch's
    tiles (`Workspace.counters`). `after_previous`: as `k1_template` takes it."""
    if x_scales is not None and quantize:
        raise ValueError("K1 quantizes bf16 activations: codes (x_scales given) need none")
    t, k = x.shape
    partials, h, codes, scales = k1_buffers(t, k, lora, cfg, quantize=quantize,
                                            h_dtype=h_dtype, device=x.device)
    template = k1_template(support, lora, batch.num_entries, cfg, stride_x=x.stride(0),
                           quantize=quantize, signal_codes=signal_codes,
                           codes_sorted=codes_sorted, pdl=pdl, traced=trace is not None,
                           h_dtype=h_dtype, x_codes=x_scales is not None,
                           after_previous=after_previous)
    grid = k1_grid(t, lora, batch, cfg, quantize=quantize)
    a, _, _, _ = _slices(lora)
    if counters is None:
        counters = workspace.counters(_tiling.k1_tiles(t, lora, batch, cfg))
    _start_template(support, template, grid, (
        t, x, partials if codes is None else codes,
        scales if quantize else partials if x_scales is None else x_scales,
        h, partials, a[0], a[1], a[2],
        batch.sorted_token_indices, batch.lora_ids, batch.num_tokens_per_lora,
        batch.lora_token_start, workspace.tile_counters(counters), counters,
        trace_arg(trace, counters, grid[0])))
    return codes, scales, h


def launch_quantize(x: torch.Tensor):
    """K1's quantizing programs alone: one per token."""
    t, k = x.shape
    codes = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    unused = torch.empty(1, dtype=torch.int32, device=x.device)
    _start(
        _quantize_shrink_kernel, (t,),
        x_ptr=x, codes_ptr=codes, scales_ptr=scales, h_ptr=scales, partial_ptr=scales,
        a0_ptr=x, a1_ptr=x, a2_ptr=x, sorted_ptr=unused, lora_ids_ptr=unused,
        counts_ptr=unused, start_ptr=unused, counter_ptr=unused, ready_ptr=unused,
        trace_ptr=unused, T=t, K=k, R=1, stride_x=x.stride(0), NUM_ENTRIES=1,
        QUANTIZE=True, SIGNAL_CODES=False, CODES_SORTED=False, NUM_SLICES=1, SPLIT_K=1,
        BLOCK_M=16, BLOCK_R=16, BLOCK_K=16, QUANT_BLOCK=_tiling.quant_block(k, 16384),
        INTERPRETER=_env.triton_interpreter(), ENTRIES_BLOCK=1, NUM_STAGES=1,
        num_warps=8, num_stages=1,
    )
    return codes, scales


def gemm_partial_shape(grid: tuple[int, int, int], n: int, cfg: LaunchConfig) -> tuple:
    """K2's split-K partials for its `grid`: a plane per split of every row tile's rows."""
    return (grid[2], grid[0] * cfg.block_m, n)


def _gemm_buffers(workspace: Workspace, mode: int, t: int, n: int, cfg: LaunchConfig, device,
                  counters: torch.Tensor | None = None):
    """The grid, the split-K partials (None without split-K) and the counter buffer (`counters`
    where the caller already asked the workspace for this launch's tiles)."""
    grid = _tiling.gemm_grid(mode, t, n, cfg)
    if grid[2] == 1:
        return grid, None, workspace.counters(0) if counters is None else counters
    partial = torch.empty(gemm_partial_shape(grid, n, cfg), dtype=torch.float32, device=device)
    if counters is None:
        counters = workspace.counters(_tiling.k2_tiles(mode, t, n, cfg))
    return grid, partial, counters


def _w_operand(support: DeviceSupport, weight: torch.Tensor, cfg: LaunchConfig):
    # K2's weight operand: a TMA descriptor of its [block_n, block_k] tiles, or the weight
    # itself for pointer loads.
    if _tiling.w_tma(support, weight, cfg):
        return TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    return weight


def _k2_arguments(mode: int, lora: LoraWeights, num_entries: int, cfg: LaunchConfig, *,
                  n: int, stride_a: int, stride_y: int, h_planes: int, split: int, w_tma: bool,
                  per_channel: bool, traced: bool, pdl: bool, wait_codes: bool, warm_l2: int,
                  wait_k1_first: bool, a_sorted: bool, interpreter: bool, has_bias: bool,
                  prefetch: tuple[int, ...] | None = None, tokens: int = 0,
                  delta_in_y: bool = False, early_setting: str | None = None,
                  **pointers) -> dict:
    # K2's arguments with adapters, by name: what launch_k2's templates launch (their
    # pointers in slots, none given here) and k2_blocks_per_sm compiles (with MockTensors).
    # `prefetch`: an L2Prefetch's `prefetch.kernel_args`, or None; `tokens`: the batch's
    # (`_tiling.epilogue_halves` asks); `delta_in_y`: the delta kernel wrote the several-slot
    # delta into y (only where the delta goes first: `delta_first`); `early_setting`:
    # EPILORA_EPILOGUE_EARLY as the caller read it (None: read now).
    _, _, off1, off2 = _slices(lora)
    pf_when, pf_rows, pf_stride, pf_lines, pf_half, pf_row_bytes = prefetch or (0,) * 6
    gather_step = _tiling.gather_segments(cfg, num_entries, lora.max_rank)  # 0: loop
    halves = _tiling.epilogue_halves(cfg, num_entries, mode == FP8, tokens, lora.max_rank)
    first = delta_first(mode, cfg, num_entries, split=split, pdl=pdl,
                        wait_k1_first=wait_k1_first, tokens=tokens, rank=lora.max_rank)
    # (K split: only the last split adds the delta; the weight by TMA: sm_90's pipeline, whose
    # shared memory the rule counts)
    early = split == 1 and w_tma and _tiling.epilogue_early(
        cfg, halves, num_entries, h_whole=(wait_k1_first or not pdl) and not wait_codes,
        setting=early_setting)
    if delta_in_y and not first:
        raise ValueError("delta_in_y: only where K2 would sum the delta before its K loop")
    return dict(
        pointers,
        N=n, K=lora.in_features, R=lora.max_rank, NUM_ENTRIES=num_entries,
        stride_a=stride_a, stride_y=stride_y, N_OFF1=off1, N_OFF2=off2,
        MODE=mode, HAS_LORA=True, NUM_SLICES=len(lora.output_slices), H_PLANES=h_planes,
        SPLIT_K=split, ENTRIES_BLOCK=_tiling.next_power_of_2(num_entries),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r,
        INTERPRETER=interpreter, USE_PDL=pdl,
        WAIT_CODES=wait_codes, WARM_L2=warm_l2 if wait_codes else 0, TRACE=traced,
        B_IN_REGS=_tiling.b_in_registers(cfg) and not halves,
        R_CHUNK=_tiling.epilogue_rank_chunk(cfg), EPILOGUE_HALVES=halves, EPILOGUE_EARLY=early,
        SEG_STAGES=cfg.segment_stages if num_entries > 2 else 1,
        GATHER_SEGMENTS=gather_step > 0, GATHER_R_STEP=max(1, gather_step),
        W_TMA=w_tma, WAIT_K1_FIRST=wait_k1_first and pdl, A_TMA=a_sorted,
        W_SCALE_PER_CHANNEL=per_channel, HAS_BIAS=has_bias,
        SWAP_AB=cfg.swap_ab and mode != EXPAND,  # the expand has no GEMM to swap
        SWAP_PROMOTE=SWAP_AB_PROMOTE,
        DELTA_FIRST=first, DELTA_IN_Y=delta_in_y,
        PREFETCH=pf_when, PF_ROWS=pf_rows, PF_STRIDE=pf_stride, PF_LINES=pf_lines,
        PF_HALF=pf_half, PF_ROW_BYTES=pf_row_bytes,
        PF_BLOCK=cfg.num_warps * 32,  # a line a thread per round
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )


def delta_first(mode: int, cfg: LaunchConfig, num_entries: int, *, split: int, pdl: bool,
                wait_k1_first: bool, tokens: int, rank: int) -> bool:
    """Whether K2 sums several slots' delta before its K loop (`DELTA_FIRST`): prefill tiles of
    the FP8 GEMM, K whole, h whole before the K loop (no PDL, or the fused path's wait for all
    of K1 first), and not the epilogue in halves."""
    return (mode == FP8 and cfg.block_m >= 64 and num_entries > 2 and split == 1
            and (wait_k1_first or not pdl)
            and not _tiling.epilogue_halves(cfg, num_entries, True, tokens, rank))


def k2_template(support: DeviceSupport, mode: int, lora: LoraWeights, num_entries: int,
                cfg: LaunchConfig, *, stride_a: int, stride_y: int, h_planes: int, split: int,
                w_tma: bool, per_channel: bool, pdl: bool, wait_codes: bool, warm_l2: int,
                traced: bool, wait_k1_first: bool, a_sorted: bool,
                has_bias: bool = False, prefetch: tuple[int, ...] | None = None,
                tokens: int = 0, delta_in_y: bool = False,
                early_setting: str | None = None) -> _fast_launch.Template:
    """K2's launch template (slots `_K2_SLOTS`) for these settings, made once; `pdl` as
    `use_pdl` made it; `prefetch`, `tokens`, `delta_in_y` and `early_setting` as
    `_k2_arguments` takes them."""
    early_setting = early_setting or _env.epilogue_early()
    n = lora.out_features
    key = (mode, n, lora.in_features, lora.max_rank, tuple(lora.output_slices), num_entries,
           cfg, stride_a, stride_y, h_planes, split, pdl, wait_codes, warm_l2, traced, w_tma,
           wait_k1_first, a_sorted, per_channel, has_bias, support.interpreter, prefetch,
           _tiling.gather_segments(cfg, num_entries, lora.max_rank),  # settings' (dev A/Bs)
           _tiling.epilogue_halves(cfg, num_entries, mode == FP8, tokens, lora.max_rank),
           early_setting, delta_in_y)
    template = _K2_TEMPLATES.get(key)
    if template is None:
        arguments = _k2_arguments(
            mode, lora, num_entries, cfg, n=n, stride_a=stride_a, stride_y=stride_y,
            h_planes=h_planes, split=split, w_tma=w_tma, per_channel=per_channel,
            traced=traced, pdl=pdl, wait_codes=wait_codes, warm_l2=warm_l2,
            wait_k1_first=wait_k1_first, a_sorted=a_sorted, interpreter=support.interpreter,
            has_bias=has_bias, prefetch=prefetch, tokens=tokens, delta_in_y=delta_in_y,
            early_setting=early_setting)
        template = _keep_template(_K2_TEMPLATES, key, _fast_launch.Template(
            _lora_gemm_kernel, arguments, _K2_SLOTS))
    return template


def launch_k2(support: DeviceSupport, workspace: Workspace, mode: int, a, a_scale, weight,
              weight_scale, y, h, lora: LoraWeights, batch: AdapterBatch, cfg: LaunchConfig, *,
              pdl: bool = False, wait_codes: bool = False, warm_l2: int = 0,
              trace: torch.Tensor | None = None, wait_k1_first: bool = False,
              a_sorted: bool = False, counters: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, prefetch: L2Prefetch | None = None):
    """K2 with the adapters' epilogue into `y` (MODE EXPAND: y is also its input, and no `bias`:
    the GEMM that made y added it). `counters`: as for `launch_k1`. `prefetch`: the caller's
    next weight, pulled into L2 past the K loop or before it (its `at`)."""
    if bias is not None and mode == EXPAND:
        raise ValueError("the expand adds no bias: the GEMM that made y adds it")
    t, n = y.shape
    _tiling.check_gemm_config(cfg, lora)
    pf_args = kernel_args(prefetch, y.device)
    grid, partial, counters = _gemm_buffers(workspace, mode, t, n, cfg, y.device, counters)
    w_operand = _w_operand(support, weight, cfg)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]) if a_sorted else a
    pdl = use_pdl(support, pdl)
    # EPILORA_DELTA_KERNEL: where the delta would go first, a kernel of its own writes it
    delta_in_y = use_delta_kernel(
        _env.delta_kernel(), mode, cfg, batch.num_entries, split=grid[2], pdl=pdl,
        wait_k1_first=wait_k1_first, tokens=t, rank=lora.max_rank)
    template = k2_template(
        support, mode, lora, batch.num_entries, cfg, stride_a=a.stride(0), stride_y=y.stride(0),
        h_planes=h.shape[0], split=grid[2], w_tma=w_operand is not weight,
        per_channel=mode != EXPAND and weight_scale.numel() > 1, pdl=pdl,
        wait_codes=wait_codes, warm_l2=warm_l2, traced=trace is not None,
        wait_k1_first=wait_k1_first, a_sorted=a_sorted, has_bias=bias is not None,
        prefetch=pf_args, tokens=t, delta_in_y=delta_in_y)
    partial = y if partial is None else partial
    trace = trace_arg(trace, counters, grid[0] * grid[1] * grid[2])
    _, b, _, _ = _slices(lora)
    if delta_in_y:
        launch_delta(support, y, h, lora, batch)
    _start_template(support, template, grid, (
        t, a, a_desc, a_scale, weight, w_operand, weight_scale,
        weight_scale if bias is None else bias, y, h, b[0], b[1], b[2],
        batch.sorted_token_indices, batch.lora_ids, batch.lora_token_start, partial,
        workspace.tile_counters(counters), counters, trace,
        weight if pf_args is None else prefetch.bytes_view()))
    return y


# The delta kernel's tiles: 16 rows (mma.sync's and Triton's smallest dot) by 128 columns
# (fewer where the slices' boundaries ask), the rank in steps of at most 64 (a 128 x 64 bf16
# slice of B, 64 registers a thread in 4 warps). It is launched without PDL, after K1 has
# ended, and K2 (PDL or not) waits for it before its K loop: gdc_wait, or stream order.
DELTA_BLOCK_T = 16
DELTA_BLOCK_N = 128
DELTA_MAX_R_STEP = 64
# EPILORA_DELTA_KERNEL=auto's bound: a segment of this many rows or fewer is one of the delta
# kernel's row tiles, where K2's epilogue runs an MMA of its whole 64 or 128 rows for it.
DELTA_TOKENS_PER_SLOT = DELTA_BLOCK_T


def launch_delta(support: DeviceSupport, y: torch.Tensor, h: torch.Tensor, lora: LoraWeights,
                 batch: AdapterBatch) -> None:
    """`_segment_delta_kernel`: bf16(h B_slot^T) of every adapter segment's rows into `y`
    (rows without an adapter untouched), for a K2 with `delta_in_y`."""
    t, n = y.shape
    _, b, off1, off2 = _slices(lora)
    block_n = fit_slices(DELTA_BLOCK_N, lora.output_slices)
    block_r = rank_block(lora.max_rank)  # at least 16: the dot's K on sm_90
    row_tiles = _tiling.entry_row_tiles(t, batch, DELTA_BLOCK_T)
    _start(_segment_delta_kernel, (row_tiles, -(-n // block_n)),
           y_ptr=y, h_ptr=h, b0_ptr=b[0], b1_ptr=b[1], b2_ptr=b[2],
           sorted_ptr=batch.sorted_token_indices, lora_ids_ptr=batch.lora_ids,
           counts_ptr=batch.num_tokens_per_lora, start_ptr=batch.lora_token_start, T=t, N=n,
           R=lora.max_rank, NUM_ENTRIES=batch.num_entries, stride_y=y.stride(0), N_OFF1=off1,
           N_OFF2=off2, NUM_SLICES=len(lora.output_slices), H_PLANES=h.shape[0],
           BLOCK_T=DELTA_BLOCK_T, BLOCK_N=block_n, BLOCK_R=block_r,
           R_STEP=min(block_r, DELTA_MAX_R_STEP),
           ENTRIES_BLOCK=_tiling.next_power_of_2(batch.num_entries),
           INTERPRETER=support.interpreter, num_warps=4)


def use_delta_kernel(setting: str, mode: int, cfg: LaunchConfig, num_entries: int, *,
                     split: int, pdl: bool, wait_k1_first: bool, tokens: int,
                     rank: int) -> bool:
    """Whether the delta kernel writes the several-slot delta into y before K2
    (`delta_in_y`), for EPILORA_DELTA_KERNEL's `setting`: only where K2 would sum it before
    its K loop (`delta_first`); with `auto` where the batch has at most DELTA_TOKENS_PER_SLOT
    tokens a slot held (the slots an engine holds, as `_tiling.epilogue_halves` counts them:
    with fewer in use, segments are longer). There K2's epilogue runs a whole-tile MMA for
    each of the many short segments that meet its tile, loading each one's B in turn, while
    the delta kernel's 16-row tiles each take one segment's rows and keep many loads of B in
    flight."""
    if setting == "0" or not delta_first(mode, cfg, num_entries, split=split, pdl=pdl,
                                         wait_k1_first=wait_k1_first, tokens=tokens,
                                         rank=rank):
        return False
    return setting == "1" or tokens <= DELTA_TOKENS_PER_SLOT * (num_entries - 1)


def k2_lead_template(support: DeviceSupport, lora: LoraWeights, num_entries: int,
                     cfg1: LaunchConfig, cfg2: LaunchConfig, *, stride_a: int, stride_x: int,
                     x_codes: bool, split: int, w_tma: bool, per_channel: bool, traced: bool,
                     has_bias: bool = False) -> _fast_launch.Template:
    """The decode path on the caller's codes in one launch (slots `_K2_LEAD_SLOTS`): K2 whose
    first programs are the shrink's in `cfg1`'s tiles (its K loop in `cfg1.num_stages`
    stages), h fp32; made once. `x_codes`: the shrink reads the codes (x_scales their scales),
    else bf16 x."""
    n = lora.out_features
    key = ("lead", n, lora.in_features, lora.max_rank, tuple(lora.output_slices), num_entries,
           cfg1, cfg2, stride_a, stride_x, x_codes, split, w_tma, per_channel, traced, has_bias,
           support.interpreter, _tiling.epilogue_halves(cfg2, num_entries, True))
    template = _K2_TEMPLATES.get(key)
    if template is None:
        arguments = _k2_arguments(
            FP8, lora, num_entries, cfg2, n=n, stride_a=stride_a, stride_y=n, h_planes=1,
            split=split, w_tma=w_tma, per_channel=per_channel, traced=traced, pdl=False,
            wait_codes=False, warm_l2=0, wait_k1_first=False, a_sorted=False,
            interpreter=support.interpreter, has_bias=has_bias)
        arguments.update(LEAD_SHRINK=True, EPILOGUE_EARLY=False,  # h is made in this launch
                         stride_x=stride_x,
                         S_SPLIT_K=cfg1.split_k, S_BLOCK_M=cfg1.block_m, S_BLOCK_R=cfg1.block_r,
                         S_BLOCK_K=cfg1.block_k, S_STAGES=cfg1.num_stages, X_CODES=x_codes)
        template = _keep_template(_K2_TEMPLATES, key, _fast_launch.Template(
            _lora_gemm_kernel, arguments, _K2_LEAD_SLOTS))
    return template


def lead_grid(t: int, lora: LoraWeights, batch: AdapterBatch, cfg1: LaunchConfig,
              cfg2: LaunchConfig) -> tuple[int]:
    """The one-launch decode path's programs: the shrink's, then the GEMM's."""
    return (_tiling.shrink_programs(t, lora, batch, cfg1)
            + math.prod(_tiling.gemm_grid(FP8, t, lora.out_features, cfg2)),)


def launch_lead(support: DeviceSupport, workspace: Workspace, x, x_scales, codes, code_scales,
                weight, weight_scale, y, lora: LoraWeights, batch: AdapterBatch,
                cfg1: LaunchConfig, cfg2: LaunchConfig, *, counters: torch.Tensor,
                trace: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """The decode path on the caller's `codes` in one launch (`k2_lead_template`): the shrink
    reads `x` (bf16), or with `x_scales` x is the codes themselves. `counters`: the
    workspace's, already asked for both parts' tiles."""
    t, n = y.shape
    _tiling.check_gemm_config(cfg2, lora)
    gemm = _tiling.gemm_grid(FP8, t, n, cfg2)
    split = gemm[2]
    # h fp32: plane 0 of the shrink's partials, what the GEMM's epilogue reads
    partials, _, _, _ = k1_buffers(t, lora.in_features, lora, cfg1, quantize=False,
                                   h_dtype=torch.float32, device=y.device)
    partial = (y if split == 1 else torch.empty(gemm_partial_shape(gemm, n, cfg2),
                                                dtype=torch.float32, device=y.device))
    w_operand = _w_operand(support, weight, cfg2)
    grid = lead_grid(t, lora, batch, cfg1, cfg2)
    template = k2_lead_template(
        support, lora, batch.num_entries, cfg1, cfg2, stride_a=codes.stride(0),
        stride_x=x.stride(0), x_codes=x_scales is not None, split=split,
        w_tma=w_operand is not weight, per_channel=weight_scale.numel() > 1,
        traced=trace is not None, has_bias=bias is not None)
    a, b, _, _ = _slices(lora)
    _start_template(support, template, grid, (
        t, codes, codes, code_scales, weight, w_operand, weight_scale,
        weight_scale if bias is None else bias, y, partials, b[0], b[1], b[2],
        batch.sorted_token_indices, batch.lora_ids, batch.lora_token_start, partial,
        workspace.tile_counters(counters), counters, trace_arg(trace, counters, grid[0]),
        x, code_scales if x_scales is None else x_scales, batch.num_tokens_per_lora,
        a[0], a[1], a[2]))
    return y


class _TileCounters(MockTensor):
    # launch_k2's tile counters, `counters[TILES:]`: 8 bytes past a 16-byte aligned buffer, which
    # Triton's launcher specializes as unaligned; the mock says so, so that the kernel compiled
    # here is the one the launch then runs (no second compile).
    @staticmethod
    def data_ptr():
        return TILES * 4


def k2_blocks_per_sm(support: DeviceSupport, mode: int, a_dtype: torch.dtype, weight,
                     weight_scale, h_dtype: torch.dtype, lora: LoraWeights, batch: AdapterBatch,
                     cfg: LaunchConfig, *, pdl: bool, wait_codes: bool, warm_l2: int,
                     wait_k1_first: bool, has_bias: bool = False) -> int:
    """How many of K2's blocks (as launch_k2 would launch it with `cfg`, its weight read by
    pointer loads) one SM of the device holds at once: compiled (Triton's caches keep it),
    never launched; its registers and shared memory against the SM's."""
    t, k, n = batch.num_tokens, lora.in_features, lora.out_features
    a = MockTensor(a_dtype, [t, k])
    y = MockTensor(torch.bfloat16, [t, n])
    h = MockTensor(h_dtype, [1, len(lora.output_slices), t, lora.max_rank])
    split = _tiling.gemm_grid(mode, t, n, cfg)[2]
    partial = MockTensor(torch.float32) if split > 1 else y
    ready = MockTensor(torch.int32)
    pdl = use_pdl(support, pdl)
    _, b, _, _ = _slices(lora)
    with _compiling_in_this_thread():  # its registers are wanted now
        kernel = _lora_gemm_kernel.warmup(grid=(1,), T=t, **_k2_arguments(
            mode, lora, batch.num_entries, cfg, n=n, stride_a=k, stride_y=n, h_planes=1,
            split=split, w_tma=False, per_channel=weight_scale.numel() > 1, traced=False,
            pdl=pdl, wait_codes=wait_codes, warm_l2=warm_l2, wait_k1_first=wait_k1_first,
            a_sorted=False, interpreter=support.interpreter, has_bias=has_bias, tokens=t,
            a_ptr=a, a_desc=a, a_scale_ptr=MockTensor(torch.float32), w_ptr=weight,
            w_desc=weight, w_scale_ptr=weight_scale, bias_ptr=weight_scale, y_ptr=y, h_ptr=h,
            b0_ptr=b[0], b1_ptr=b[1], b2_ptr=b[2], sorted_ptr=batch.sorted_token_indices,
            lora_ids_ptr=batch.lora_ids, start_ptr=batch.lora_token_start,
            partial_ptr=partial, counter_ptr=_TileCounters(torch.int32), ready_ptr=ready,
            trace_ptr=ready))
    kernel._init_handles()  # loads it: the registers are known from here
    props = torch.cuda.get_device_properties(weight.device)
    return _tiling.blocks_per_sm(kernel.n_regs, kernel.metadata.shared, cfg.num_warps,
                                 props.regs_per_multiprocessor,
                                 props.shared_memory_per_multiprocessor,
                                 props.max_threads_per_multi_processor)


# fit_k2_waves's choices, per case: compiled and measured once a process.
_FITTED: dict = {}


def fit_k2_waves(support: DeviceSupport, mode: int, a_dtype: torch.dtype, weight,
                 weight_scale, h_dtype: torch.dtype, lora: LoraWeights, batch: AdapterBatch,
                 cfg: LaunchConfig, *, pdl: bool, wait_codes: bool, warm_l2: int,
                 wait_k1_first: bool, has_bias: bool = False) -> LaunchConfig:
    """`cfg`, or the K2 tiles around it whose grid fills the device's waves best
    (`_tiling.fit_waves`), each candidate's blocks per SM from its compiled kernel."""
    t, n, k = batch.num_tokens, lora.out_features, lora.in_features
    key = (weight.device, mode, a_dtype, h_dtype, t, batch.num_entries, k, lora.output_slices,
           lora.max_rank, weight_scale.numel() > 1, cfg, pdl, wait_codes, warm_l2,
           wait_k1_first, has_bias,
           _tiling.gather_segments(cfg, batch.num_entries, lora.max_rank))
    if key not in _FITTED:
        def measure(candidate: LaunchConfig) -> tuple[int, int] | None:
            try:
                per_sm = k2_blocks_per_sm(
                    support, mode, a_dtype, weight, weight_scale, h_dtype, lora, batch,
                    candidate, pdl=pdl, wait_codes=wait_codes, warm_l2=warm_l2,
                    wait_k1_first=wait_k1_first, has_bias=has_bias)
            except (CompilationError, OutOfResources, PTXASError):
                return None  # a candidate that does not compile or fit is no candidate
            return math.prod(_tiling.gemm_grid(mode, t, n, candidate)), per_sm

        sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
        _FITTED[key] = _tiling.fit_waves(cfg, _tiling.wave_candidates(cfg, k, lora.output_slices),
                                         measure, sms)
    return _FITTED[key]


def launch_gemm_only(support: DeviceSupport, workspace: Workspace, a, a_scale, weight,
                     weight_scale, cfg: LaunchConfig, trace: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, mode: int = FP8):
    """K2 without adapters, rows in their own order: FP8 (`a` the codes, `a_scale` their
    scales) or W8A16 (`a` bf16, `a_scale` unread)."""
    t, k = a.shape
    n = weight.shape[0]
    by_tma = mode == FP8 and _tiling.a_tma(support, a, weight, cfg)  # TMA reads of the codes
    y = torch.empty(t, n, dtype=torch.bfloat16, device=a.device)
    unused = torch.empty(1, dtype=torch.int32, device=a.device)
    grid, partial, counters = _gemm_buffers(workspace, mode, t, n, cfg, a.device)
    w_operand = _w_operand(support, weight, cfg)
    _start(
        _lora_gemm_kernel, grid,
        a_ptr=a, a_desc=TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        if by_tma else a, a_scale_ptr=a_scale, w_ptr=weight, w_desc=w_operand,
        w_scale_ptr=weight_scale, bias_ptr=weight_scale if bias is None else bias, y_ptr=y,
        h_ptr=weight_scale, b0_ptr=weight, b1_ptr=weight,
        b2_ptr=weight, sorted_ptr=unused, lora_ids_ptr=unused, start_ptr=unused,
        partial_ptr=y if partial is None else partial, counter_ptr=counters[TILES:],
        ready_ptr=counters, trace_ptr=trace_arg(trace, unused, grid[0] * grid[1] * grid[2]),
        T=t, N=n, K=k, R=1, NUM_ENTRIES=0, stride_a=a.stride(0), stride_y=y.stride(0),
        N_OFF1=n, N_OFF2=n,
        MODE=mode, HAS_LORA=False, NUM_SLICES=1, H_PLANES=1, SPLIT_K=grid[2], ENTRIES_BLOCK=16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=16,
        INTERPRETER=_env.triton_interpreter(), W_TMA=w_operand is not weight, A_TMA=by_tma,
        W_SCALE_PER_CHANNEL=weight_scale.numel() > 1, HAS_BIAS=bias is not None,
        SWAP_AB=cfg.swap_ab, SWAP_PROMOTE=SWAP_AB_PROMOTE, TRACE=trace is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
