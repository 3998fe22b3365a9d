"""The Triton kernels behind `epilora_kernels.fused` (private: call the launchers there).

`_quantize_shrink_kernel` (K1) has two kinds of programs in one launch: the first T quantize one
token each (per-token FP8, in Triton's own arithmetic, which is vLLM's compiled arithmetic: see
epilora_quant.fp8, mode INDUCTOR), the rest compute one `BLOCK_M x BLOCK_R` tile of
`h = x A_slot^T` for one adapter, one slice (or with `SLICES_TOGETHER` every slice) and one
split of K, over that adapter's tokens.
Either kind may be launched alone. Split-K partials go to separate fp32 planes and the last
split of each tile sums them in a fixed order into plane 0 (`_sum_splits`): deterministic, and
K2 reads one plane. In the decode path (`SIGNAL_CODES`) the quantizing programs count the rows
they finished, for the K2 that runs beside them. With `AFTER_PREVIOUS` K1 itself is launched as
the programmatic dependent of the kernel before it and waits for that kernel first.

`_lora_gemm_kernel` (K2) walks the tokens in adapter order. MODE 0: FP8 x FP8 GEMM scaled as
vLLM's CUTLASS epilogue, `x_scale * (w_scale * acc)`, with one weight scale or one per output
channel (`W_SCALE_PER_CHANNEL`); MODE 1: W8A16 (FP8 weight widened to bf16 in registers). In
both the projection's bias (`HAS_BIAS`) is added to the scaled fp32 result, before any rounding,
as CUTLASS's epilogue adds it. MODE 2: no GEMM, the tile starts from an existing output (the
hybrid path's expand). Tiles of 64 rows or more (`W_TMA`) read the weight tile through a TMA
descriptor (`w_desc`); so do decode tiles computed as the transposed product (`SWAP_AB`, W x^T
on wgmma's 64-row side). Its epilogue sums `bf16(h) B_slot^T` for each adapter segment that meets
the tile, reading only the tile's columns of B, and writes the bf16 tile once: in MODEs 0 and 2
as vLLM's expand adds into its GEMM's output, `bf16(bf16(base) + bf16(delta))` (with several
slots in tiles of 64 rows or more whose h is whole before the K loop, the delta is summed first
and waits in y: `DELTA_FIRST`; with `EPILOGUE_HALVES` no term waits in y, the rounded base stays
in registers and the delta is added half the tile's columns at a time, with `EPILOGUE_EARLY`
from h's and B's tiles loaded before the K loop); in MODE 1 rounded once,
`bf16(base + delta)`. In the fused path with PDL (`WAIT_K1_FIRST`) it is launched as K1's
programmatic dependent only to hide its launch, and waits for all of K1 before its K loop. In
the decode path (`USE_PDL`, `WAIT_CODES`) it is K1's programmatic dependent: it waits for K1's
count of quantized rows before its K loop (prefetching the first `WARM_L2` bytes of its weight
rows into L2 meanwhile), streams its weights while K1's shrink runs, and waits for all of K1
(`gdc_wait`) only before its epilogue.
With `LEAD_SHRINK` (the decode path on the caller's codes in one launch) there is no K1: the
grid is 1-D and its first programs are K1's shrink programs (`_shrink_tile`, in `S_` settings),
each releasing a count once its part of h is stored; the GEMM programs after them spin on that
count before their epilogue instead of `gdc_wait`, and the last of them zeroes it.
With `SPLIT_K` > 1 the K loop is split over programs and the last split of each tile reduces in
a fixed order. Counters (split-K tiles, the decode path's counts) are zero at rest
(epilora_kernels.workspace): whoever arrives last resets them. With `PREFETCH` every program,
past its K loop (`PREFETCH` 1) or before it (2), pulls its share of the caller's next weight
into L2 (`_prefetch_next`, `epilora_kernels.L2Prefetch`).

`TRACE` (diagnostics, dev/decode_timeline.py) makes every program of either kernel store
its SM and global clock at its start, after each wait and at its end; it is compiled out
otherwise (checked in tests/test_compile_sm90.py).

`INTERPRETER` works around three bugs of Triton's CPU interpreter: its bf16 arithmetic (bf16
dots become fp32 dots; h is still rounded to bf16 first), its fp32 -> bf16 cast, which truncates
(`_to_bf16` rounds the bits first), and its fp32 -> e4m3 cast, which loses the carry when
rounding overflows the mantissa (1.9 * 64 became 64.0 instead of 128.0); there the casts are
done by integer arithmetic, round to nearest even exactly as the hardware's `cvt.rn`.
"""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
FP8_MIN_SCALE = tl.constexpr(1.0 / (448.0 * 512.0))


@triton.jit
def _pick(s, p0, p1, p2):
    # A per-slice base pointer from a runtime slice index (at most three slices).
    p = p0
    if s == 1:
        p = p1
    if s == 2:
        p = p2
    return p


@triton.jit
def _e4m3_bits(v):
    # Round-to-nearest-even fp32 -> e4m3fn code bits, for |v| <= 448 (the caller clamps).
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range (|v| >= 2^-6): round the 23-bit mantissa to 3 bits; a carry moves into the
    # exponent field by itself. Then rebias the exponent from 127 to 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: multiples of 2^-9, rounded half to even by adding 2^23 (for 0 <= y < 2^23,
    # y + 2^23 rounds y to an integer in fp32).
    sub = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= 0x3C800000, normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _to_e4m3(v, INTERPRETER: tl.constexpr):
    if INTERPRETER:
        return _e4m3_bits(v).to(tl.float8e4nv, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def _quantize_row(x_ptr, codes_ptr, scales_ptr, src, t, K, stride_x,
                  QUANT_BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
    # One token: x's row `src` to the codes' and scales' row `t`. A row of up to QUANT_BLOCK
    # elements is loaded once and kept in registers (a chunked two-pass loop over a 12288-wide
    # row is ~100 dependent loads: 35 us on the H200, benchmarks/results/h200/tune_v1.json);
    # longer rows take chunks of QUANT_BLOCK.
    row = x_ptr + src * stride_x
    if K <= QUANT_BLOCK:
        offs = tl.arange(0, QUANT_BLOCK)
        v = tl.load(row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(v), axis=0) / FP8_MAX, FP8_MIN_SCALE)
        inverse = 1.0 / scale
        tl.store(scales_ptr + t, scale)
        q = tl.minimum(tl.maximum(v * inverse, -FP8_MAX), FP8_MAX)
        tl.store(codes_ptr + t * K + offs, _to_e4m3(q, INTERPRETER), mask=offs < K)
    else:
        amax = tl.zeros([QUANT_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, QUANT_BLOCK):
            offs = k0 + tl.arange(0, QUANT_BLOCK)
            v = tl.load(row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, FP8_MIN_SCALE)
        inverse = 1.0 / scale
        tl.store(scales_ptr + t, scale)
        for k0 in range(0, K, QUANT_BLOCK):
            offs = k0 + tl.arange(0, QUANT_BLOCK)
            v = tl.load(row + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(v * inverse, -FP8_MAX), FP8_MAX)
            tl.store(codes_ptr + t * K + offs, _to_e4m3(q, INTERPRETER), mask=offs < K)


@triton.jit
def _stamp(trace_ptr, event: tl.constexpr, TRACE: tl.constexpr):
    # Diagnostics only (dev/decode_timeline.py): this program's SM and global clock (ns)
    # at `event`, in its row of 8 int64 (slot 7: the SM). Compiled out unless TRACE. In K2 these
    # stores precede gdc_wait: harmless for a buffer allocated before the run that no kernel
    # reads.
    if TRACE:
        pid = tl.program_id(0) + tl.num_programs(0) * (
            tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        row = trace_ptr + pid.to(tl.int64) * 8
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                       is_pure=True, pack=1)
        tl.store(row + event, now)
        tl.store(row + 7, sm.to(tl.int64))


@triton.jit
def _fence_proxy_async_global(INTERPRETER: tl.constexpr):
    # Orders this thread's generic-proxy accesses of global memory against its async-proxy ones
    # (TMA): K1 stores the codes with generic stores, K2 reads them by TMA, and the release /
    # acquire of the count of quantized rows orders generic accesses only (PTX memory model,
    # "proxies"). Both sides fence: the writer before its release, the reader after its acquire.
    if not INTERPRETER:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(ptrs, EVICT_LAST: tl.constexpr = False):
    # Pull the 128-byte lines at `ptrs` into L2, no registers written; EVICT_LAST: as the last
    # lines L2 evicts for room.
    if EVICT_LAST:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2::evict_last [$1];",
                                  "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _next_lines(pf_ptr, first, rows, row_stride, row_lines, half, row_bytes,
                BLOCK: tl.constexpr):
    # Lines `first` .. `first + BLOCK - 1` of the caller's next weight, numbered row by row:
    # `row_lines` 128-byte lines of each of `rows` rows (`row_stride` bytes apart), taken in
    # turn from the row's start and from `half` bytes into it (where the second split of a
    # GEMM whose K loop is split in two starts), none past the row's `row_bytes`. Their
    # addresses and which of them exist (the others point at the tensor's first line).
    i = first + tl.arange(0, BLOCK)
    row = i // row_lines
    line = i - row * row_lines
    offset = (line % 2) * half + (line // 2) * 128
    inside = (i < rows * row_lines) & (offset < row_bytes)
    ptrs = pf_ptr + row.to(tl.int64) * row_stride + offset
    return tl.where(inside, ptrs, pf_ptr), inside


@triton.jit
def _prefetch_next(pf_ptr, rows, row_stride, row_lines, half, row_bytes, BLOCK: tl.constexpr,
                   EVICT_LAST: tl.constexpr = False, record_ptr=None):
    # Pull the caller's next weight (`epilora_kernels.L2Prefetch`) into L2, its lines dealt
    # to the grid's programs BLOCK at a time in turn (K2 calls it past its K loop, or before
    # it); nothing is written, nothing waits for it. `record_ptr` (tests only): store each
    # line's offset from `pf_ptr` at its number instead.
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    pid = tl.program_id(0) + tl.num_programs(0) * (
        tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    for first in range(pid * BLOCK, rows * row_lines, programs * BLOCK):
        ptrs, inside = _next_lines(pf_ptr, first, rows, row_stride, row_lines, half,
                                   row_bytes, BLOCK)
        if record_ptr is None:
            _prefetch_l2(ptrs, EVICT_LAST)
        else:
            tl.store(record_ptr + first + tl.arange(0, BLOCK),
                     ptrs.to(tl.int64) - pf_ptr.to(tl.int64), mask=inside)


@triton.jit
def _b_step(b_base, slot, b_stride, n, n_mask, slice_begin, slice_end, R, rr):
    # One slot's slice of B for the tile's columns n at rank columns rr (zeros for slot -1).
    return tl.load(b_base + slot.to(tl.int64) * b_stride + (n - slice_begin)[:, None] * R
                   + rr[None, :],
                   mask=(n < slice_end)[:, None] & n_mask[:, None] & (rr[None, :] < R)
                   & (slot >= 0), other=0.0)


@triton.jit
def _to_bf16(x, INTERPRETER: tl.constexpr):
    # fp32 -> bf16, rounded to nearest even as the GPU's cvt.rn does. Triton's interpreter
    # truncates instead, so there the bits are rounded first (normal values and infinities;
    # the truncation that follows is then exact; NaNs pass as they are). A bf16 `x` (a bf16
    # h's planes) passes through unchanged.
    if INTERPRETER:
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(tl.bfloat16)


@triton.jit
def _h_bf16(h_ptr, tok, rows, s, T, R, r, NUM_SLICES: tl.constexpr, H_PLANES: tl.constexpr,
            INTERPRETER: tl.constexpr):
    # bf16(h) of slice s for the tile's tokens (`rows` masks them) at rank columns r, its
    # planes summed in a fixed order (deterministic; plane 0 first, so one plane is exact).
    mask = rows[:, None] & (r[None, :] < R)
    total = tl.load(h_ptr + (s * T + tok[:, None]).to(tl.int64) * R + r[None, :], mask=mask,
                    other=0.0)
    for split in tl.static_range(1, H_PLANES):
        plane = h_ptr + ((split * NUM_SLICES + s) * T + tok[:, None]).to(tl.int64) * R
        total += tl.load(plane + r[None, :], mask=mask, other=0.0)
    return _to_bf16(total, INTERPRETER)


@triton.jit
def _add_rows(acc, hb, rows, bt, INTERPRETER: tl.constexpr):
    # acc += h B^T over the tile's `rows` (one adapter's segment), h zero elsewhere.
    return _dot_acc(acc, tl.where(rows[:, None], hb, tl.zeros_like(hb)), bt, INTERPRETER)


@triton.jit
def _dot_acc(acc, hz, bt, INTERPRETER: tl.constexpr):
    # acc += hz bt^T in the MMA (the interpreter's bf16 dot is an fp32 one).
    if INTERPRETER:
        return tl.dot(hz.to(tl.float32), tl.trans(bt.to(tl.float32)), acc)
    return tl.dot(hz, tl.trans(bt), acc)


@triton.jit
def _one_slot_delta(acc, h_ptr, tok, pos, pos_mask, s, T, R, n, n_mask, slice_begin,
                    slice_end, b_base, b_stride, slot, seg_begin, seg_end, STEP: tl.constexpr,
                    BLOCK_R: tl.constexpr, NUM_SLICES: tl.constexpr, H_PLANES: tl.constexpr,
                    INTERPRETER: tl.constexpr):
    # acc += bf16(h) B_slot^T over the tile's rows in [seg_begin, seg_end) and its columns n,
    # the rank in STEP-wide steps: a loop Triton pipelines, no step's loads waiting on another.
    in_seg = pos_mask & (pos >= seg_begin) & (pos < seg_end)
    for step in range(BLOCK_R // STEP):
        rr = step * STEP + tl.arange(0, STEP)
        bt = _b_step(b_base, slot, b_stride, n, n_mask, slice_begin, slice_end, R, rr)
        hz = _h_bf16(h_ptr, tok, in_seg, s, T, R, rr, NUM_SLICES, H_PLANES, INTERPRETER)
        acc = _dot_acc(acc, hz, bt, INTERPRETER)
    return acc


@triton.jit
def _early_b(b_base, slot, R, N, n0, slice_begin, slice_end, BLOCK_N: tl.constexpr,
             BLOCK_R: tl.constexpr):
    # One slot's B for `_epilogue_in_halves` with EARLY: its slice for the left and the right
    # half of the tile's columns at the whole rank (zeros for slot -1).
    r = tl.arange(0, BLOCK_R)
    b_stride = (slice_end - slice_begin) * R  # one slot's slice of B
    left = n0 + tl.arange(0, BLOCK_N // 2)
    right = left + BLOCK_N // 2
    return (_b_step(b_base, slot, b_stride, left, left < N, slice_begin, slice_end, R, r),
            _b_step(b_base, slot, b_stride, right, right < N, slice_begin, slice_end, R, r))


@triton.jit
def _epilogue_in_halves(acc, h_ptr, y_ptr, tok, pos, pos_mask, s, T, R, N, n0, stride_y,
                        slice_begin, slice_end, b_base, first_slot, first_begin, first_end,
                        lora_ids_ptr, start_ptr, NUM_ENTRIES, z_first, z_last,
                        early_h, early_b_left, early_b_right,
                        NUM_SLICES: tl.constexpr, H_PLANES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        R_CHUNK: tl.constexpr, ENTRIES_BLOCK: tl.constexpr,
                        SEG_STAGES: tl.constexpr, EARLY: tl.constexpr,
                        INTERPRETER: tl.constexpr):
    # y = bf16(bf16(base) + bf16(h B^T)), as the epilogue below computes it, without parking
    # the base in y: `acc` (the scaled fp32 base) rounded to bf16 and split by column halves,
    # then each half's delta summed from zero as there (one slot: in the same rank steps,
    # R_CHUNK, else the whole rank, or with EARLY from h's tile and B's halves loaded before
    # the K loop, `_early_b`; several: `_several_slots_delta`), added and stored.
    HALF: tl.constexpr = BLOCK_N // 2
    STEP: tl.constexpr = R_CHUNK if (R_CHUNK > 0 and R_CHUNK < BLOCK_R) else BLOCK_R
    left, right = tl.split(tl.permute(tl.reshape(_to_bf16(acc, INTERPRETER),
                                                 [BLOCK_M, 2, HALF]), (0, 2, 1)))
    b_stride = (slice_end - slice_begin) * R  # one slot's slice of B
    rows = y_ptr + tok[:, None].to(tl.int64) * stride_y
    for half in tl.static_range(2):
        n = n0 + half * HALF + tl.arange(0, HALF)
        n_mask = n < N
        delta = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        if ENTRIES_BLOCK > 2:
            r = tl.arange(0, BLOCK_R)
            delta = _several_slots_delta(
                delta, h_ptr, tok, pos, pos_mask, s, T, R, n, n_mask, slice_begin, slice_end,
                b_base, (n - slice_begin)[:, None] * R + r[None, :],
                (n < slice_end)[:, None] & n_mask[:, None] & (r[None, :] < R), lora_ids_ptr,
                start_ptr, NUM_ENTRIES, z_first, z_last, NUM_SLICES, H_PLANES, BLOCK_R,
                R_CHUNK, ENTRIES_BLOCK, SEG_STAGES, INTERPRETER)
        elif first_slot >= 0:
            if EARLY:
                if half == 0:
                    delta = _dot_acc(delta, early_h, early_b_left, INTERPRETER)
                else:
                    delta = _dot_acc(delta, early_h, early_b_right, INTERPRETER)
            else:
                delta = _one_slot_delta(delta, h_ptr, tok, pos, pos_mask, s, T, R, n, n_mask,
                                        slice_begin, slice_end, b_base, b_stride, first_slot,
                                        first_begin, first_end, STEP, BLOCK_R, NUM_SLICES,
                                        H_PLANES, INTERPRETER)
        if half == 0:
            kept = left
        else:
            kept = right
        out = kept.to(tl.float32) + _to_bf16(delta, INTERPRETER).to(tl.float32)
        tl.store(rows + n[None, :], _to_bf16(out, INTERPRETER),
                 mask=pos_mask[:, None] & n_mask[None, :])


@triton.jit
def _entry_row_tile(m_tile, counts_ptr, NUM_ENTRIES, BLOCK_M: tl.constexpr,
                    ENTRIES_BLOCK: tl.constexpr):
    # The entries' row tiles laid end to end (entry z has cdiv(count_z, BLOCK_M) of them):
    # (z, the tile's index within entry z) of tile `m_tile`; z == NUM_ENTRIES past the list's
    # end (a launch's bound on the list is larger than the list).
    e = tl.arange(0, ENTRIES_BLOCK)
    tiles = tl.cdiv(tl.load(counts_ptr + e, mask=e < NUM_ENTRIES, other=0), BLOCK_M)
    z = tl.sum((tl.cumsum(tiles, axis=0) <= m_tile).to(tl.int32), axis=0)
    return z, m_tile - tl.sum(tl.where(e < z, tiles, 0), axis=0)


@triton.jit
def _slice_at(n0, N, N_OFF1, N_OFF2, b0_ptr, b1_ptr, b2_ptr):
    # The output slice holding column n0 (a tile never straddles two): its index, bounds and B.
    s = (n0 >= N_OFF1).to(tl.int32) + (n0 >= N_OFF2).to(tl.int32)
    slice_begin = tl.where(s == 0, 0, tl.where(s == 1, N_OFF1, N_OFF2))
    slice_end = tl.where(s == 0, N_OFF1, tl.where(s == 1, N_OFF2, N))
    return s, slice_begin, slice_end, _pick(s, b0_ptr, b1_ptr, b2_ptr)


@triton.jit
def _segment(z, e, slots, seg_begins, seg_ends, lora_ids_ptr, start_ptr,
             SEG_STAGES: tl.constexpr):
    # Segment z's slot and bounds. SEG_STAGES 1: loaded here, so the slice of B the loop
    # loads next waits on them and the loop waits for each slice in turn (cp.async.wait_group
    # 0 in the sm_90 PTX); more: taken from the vectors loaded before the loop, so no load in
    # it waits on another and Triton's pipeliner keeps SEG_STAGES - 1 slices in flight.
    if SEG_STAGES == 1:
        slot = tl.load(lora_ids_ptr + z)
        begin = tl.load(start_ptr + z)
        end = tl.load(start_ptr + z + 1)
    else:
        slot = tl.max(tl.where(e == z, slots, -1), axis=0)
        begin = tl.max(tl.where(e == z, seg_begins, 0), axis=0)
        end = tl.max(tl.where(e == z, seg_ends, 0), axis=0)
    return slot, begin, end


@triton.jit
def _several_slots_delta(acc, h_ptr, tok, pos, pos_mask, s, T, R, n, n_mask, slice_begin,
                         slice_end, b_base, b_offs, b_mask, lora_ids_ptr, start_ptr,
                         NUM_ENTRIES, z_first, z_last, NUM_SLICES: tl.constexpr,
                         H_PLANES: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr,
                         ENTRIES_BLOCK: tl.constexpr, SEG_STAGES: tl.constexpr,
                         INTERPRETER: tl.constexpr):
    # acc += bf16(h) B_slot^T for every adapter segment z_first..z_last that meets the tile,
    # in the segments' order whatever SEG_STAGES (the same bits).
    b_stride = (slice_end - slice_begin) * R  # one slot's slice of B
    e = tl.arange(0, ENTRIES_BLOCK)
    if SEG_STAGES > 1:
        # The segments' slots and bounds again, one round of loads beside h's (the vectors
        # loaded before the K loop are not held through it: registers).
        e_mask = e < NUM_ENTRIES
        slots = tl.load(lora_ids_ptr + e, mask=e_mask, other=-1)
        seg_begins = tl.load(start_ptr + e, mask=e_mask, other=0)
        seg_ends = tl.load(start_ptr + e + 1, mask=e_mask, other=0)
    else:  # unused: each segment's are loaded in the loop
        slots = e
        seg_begins = e
        seg_ends = e
    if R_CHUNK > 0 and R_CHUNK < BLOCK_R:
        # The rank in R_CHUNK-wide steps: each step's columns of h are loaded once for all
        # segments, then the segments' slices of B for that step in a loop Triton pipelines
        # (branch-free, as below). Whole, h and B took gate_up's K2 at 128 tokens past 200
        # registers and to one and a half waves.
        steps: tl.constexpr = BLOCK_R // R_CHUNK
        for step in tl.static_range(steps):
            rr = step * R_CHUNK + tl.arange(0, R_CHUNK)
            hs = _h_bf16(h_ptr, tok, pos_mask, s, T, R, rr, NUM_SLICES, H_PLANES, INTERPRETER)
            for z in tl.range(z_first, z_last + 1,
                              num_stages=None if SEG_STAGES == 1 else SEG_STAGES):
                slot, begin, end = _segment(z, e, slots, seg_begins, seg_ends, lora_ids_ptr,
                                            start_ptr, SEG_STAGES)
                in_seg = (pos >= begin) & (pos < end)
                bt = _b_step(b_base, slot, b_stride, n, n_mask, slice_begin, slice_end, R, rr)
                acc = _add_rows(acc, hs, in_seg, bt, INTERPRETER)
    else:
        # A tile may meet many segments (32 adapters at 128 tokens, 16 per 64-row tile). The
        # loop over them is a K loop of its own, branch-free (a slot's B masked to zero for
        # tokens without an adapter), so Triton's pipeliner keeps the next segments' slices
        # of B in flight (SEG_STAGES).
        hb = _h_bf16(h_ptr, tok, pos_mask, s, T, R, tl.arange(0, BLOCK_R), NUM_SLICES,
                     H_PLANES, INTERPRETER)
        for z in tl.range(z_first, z_last + 1,
                          num_stages=None if SEG_STAGES == 1 else SEG_STAGES):
            slot, begin, end = _segment(z, e, slots, seg_begins, seg_ends, lora_ids_ptr,
                                        start_ptr, SEG_STAGES)
            in_seg = (pos >= begin) & (pos < end)
            bt = tl.load(b_base + slot.to(tl.int64) * b_stride + b_offs,
                         mask=b_mask & (slot >= 0), other=0.0)
            acc = _add_rows(acc, hb, in_seg, bt, INTERPRETER)
    return acc


@triton.jit(do_not_specialize=["T"])
def _segment_delta_kernel(y_ptr, h_ptr, b0_ptr, b1_ptr, b2_ptr, sorted_ptr, lora_ids_ptr,
                          counts_ptr, start_ptr, T, N, R, NUM_ENTRIES, stride_y, N_OFF1, N_OFF2,
                          NUM_SLICES: tl.constexpr, H_PLANES: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          R_STEP: tl.constexpr, ENTRIES_BLOCK: tl.constexpr,
                          INTERPRETER: tl.constexpr):
    # The several-slot delta on its own (EPILORA_DELTA_KERNEL): bf16(h) B_slot^T of every
    # adapter segment's rows, rounded to bf16, into y, which K2 then adds to its base
    # (DELTA_IN_Y); rows without an adapter are not written (K2 does not read them). One
    # program: BLOCK_T rows of one segment by BLOCK_N columns of one slice, the segments' row
    # tiles laid end to end as K1's shrink lays them, so each slot's slice of B is read by its
    # own rows only. In K2, before the K loop (DELTA_FIRST), a tile met by many short
    # segments ran an MMA of all its rows per segment, loading each segment's B in turn on
    # an SM nothing else ran on; here small programs keep many loads of B in flight.
    z, pid_m = _entry_row_tile(tl.program_id(0), counts_ptr, NUM_ENTRIES, BLOCK_T,
                               ENTRIES_BLOCK)
    if z < NUM_ENTRIES:
        slot = tl.load(lora_ids_ptr + z)
        if slot >= 0:
            count = tl.load(counts_ptr + z)
            start = tl.load(start_ptr + z)
            rows = pid_m * BLOCK_T + tl.arange(0, BLOCK_T)
            row_mask = rows < count
            tok = tl.load(sorted_ptr + start + rows, mask=row_mask, other=0)
            n0 = tl.program_id(1) * BLOCK_N
            s, slice_begin, slice_end, b_base = _slice_at(n0, N, N_OFF1, N_OFF2, b0_ptr,
                                                          b1_ptr, b2_ptr)
            b_stride = (slice_end - slice_begin) * R  # one slot's slice of B
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < N
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for step in tl.static_range(BLOCK_R // R_STEP):
                rr = step * R_STEP + tl.arange(0, R_STEP)
                hs = _h_bf16(h_ptr, tok, row_mask, s, T, R, rr, NUM_SLICES, H_PLANES,
                             INTERPRETER)
                bt = _b_step(b_base, slot, b_stride, n, n_mask, slice_begin, slice_end, R, rr)
                acc = _dot_acc(acc, hs, bt, INTERPRETER)
            tl.store(y_ptr + tok[:, None].to(tl.int64) * stride_y + n[None, :],
                     _to_bf16(acc, INTERPRETER), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _gathered_delta(acc, h_ptr, tok, pos, pos_mask, s, T, R, n, n_mask, slice_begin,
                    slice_end, b_base, lora_ids_ptr, start_ptr, NUM_ENTRIES,
                    NUM_SLICES: tl.constexpr, H_PLANES: tl.constexpr, BLOCK_R: tl.constexpr,
                    R_STEP: tl.constexpr, ENTRIES_BLOCK: tl.constexpr,
                    INTERPRETER: tl.constexpr):
    # acc += bf16(h) B_slot^T with each row's own slot, without a loop over the segments
    # (GATHER_SEGMENTS, decode tiles of several slots): each row's slot from the segments'
    # vectors in one round of loads, then for each R_STEP-wide rank step h's columns and every
    # row's slice of B (rows of one slot read the same lines, from L1 or L2) in loads that wait
    # on nothing but the slots, summed over the step in fp32 in registers (no MMA, no operand
    # through shared memory). The segment loop's MMA per segment costs its latency in turn:
    # 8x16's epilogue took 2.9-5.7 us a program (docs/kernels-history.md, item 55). The sum runs
    # over the rank in another order than the MMA's: the same bits on integer-valued operands.
    e = tl.arange(0, ENTRIES_BLOCK)
    e_mask = e < NUM_ENTRIES
    slots = tl.load(lora_ids_ptr + e, mask=e_mask, other=-1)
    begins = tl.load(start_ptr + e, mask=e_mask, other=0)
    ends = tl.load(start_ptr + e + 1, mask=e_mask, other=0)
    inside = (pos[:, None] >= begins[None, :]) & (pos[:, None] < ends[None, :])
    row_slot = tl.max(tl.where(inside & pos_mask[:, None], slots[None, :], -1), axis=1)
    b_stride = (slice_end - slice_begin) * R  # one slot's slice of B
    b_rows = b_base + row_slot.to(tl.int64)[:, None, None] * b_stride
    col_mask = ((n < slice_end) & n_mask)[None, :, None] & (row_slot >= 0)[:, None, None]
    for step in tl.range(0, BLOCK_R // R_STEP):  # a loop, not unrolled: up to 128 steps
        rr = step * R_STEP + tl.arange(0, R_STEP)
        hs = _h_bf16(h_ptr, tok, pos_mask & (row_slot >= 0), s, T, R, rr, NUM_SLICES,
                     H_PLANES, INTERPRETER)
        bg = tl.load(b_rows + (n - slice_begin)[None, :, None] * R + rr[None, None, :],
                     mask=col_mask & (rr < R)[None, None, :], other=0.0)
        acc += tl.sum(hs.to(tl.float32)[:, None, :] * bg.to(tl.float32), axis=2)
    return acc


@triton.jit
def _sum_splits(acc, tile_ptrs, plane, mask, split, counter, SPLIT_K: tl.constexpr):
    # Deterministic split-K: every split stores its fp32 partial at `tile_ptrs + split * plane`;
    # the split that arrives last at the tile's counter sums the planes in the fixed order
    # 0..SPLIT_K-1 (the same bits whichever split came last) and resets the counter to zero
    # (counters are zero at rest: epilora_kernels.workspace). Returns (the sum, is last).
    tl.store(tile_ptrs + split * plane, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the counter moves
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        for i in tl.static_range(SPLIT_K):
            # .cg: read at L2, never a stale L1 line of another SM's partial
            total += tl.load(tile_ptrs + i * plane, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(counter, 0)
    return total, last


@triton.jit
def _sorted_token(sorted_ptr, start_ptr, pos, NUM_ENTRIES, ENTRIES_BLOCK: tl.constexpr,
                  mask=None):
    # The token at adapter-sorted position `pos`: `sorted[pos]` among the tokens the segments
    # count (the largest segment end), `pos` itself beyond (a bijection of [0, T) either way).
    # vLLM sizes its metadata to the scheduled tokens and a CUDA graph's batch pads them: the
    # padding's sorted indices are stale, possibly out of range.
    e = tl.arange(0, ENTRIES_BLOCK)
    counted = tl.max(tl.load(start_ptr + e + 1, mask=e < NUM_ENTRIES, other=0), axis=0)
    inside = pos < counted
    if mask is not None:
        inside = inside & mask
    return tl.where(inside, tl.load(sorted_ptr + pos, mask=inside, other=0), pos)


@triton.jit
def _shrink_count(T, R, NUM_ENTRIES, NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    # The shrink's programs for T tokens (`_tiling.shrink_programs`, the same count): one per
    # row tile of the entries' list, slice, rank tile and split. At most min(entries, T)
    # entries have tokens, so the list has at most cdiv(T, BLOCK_M) + that - 1 row tiles.
    row_tiles = tl.maximum(tl.cdiv(T, BLOCK_M) + tl.minimum(NUM_ENTRIES, T) - 1, 0)
    return row_tiles * tl.cdiv(R, BLOCK_R) * NUM_SLICES * SPLIT_K


@triton.jit
def _shrink_step(acc, xt, a_ptrs, a_mask, INTERPRETER: tl.constexpr):
    # One K step of a shrink tile: this slice's A tile, its product with the x tile added.
    at = tl.load(a_ptrs, mask=a_mask, other=0.0)
    if INTERPRETER:  # the interpreter's bf16 dot is an fp32 one (xt widened by the caller)
        return acc + tl.dot(xt, tl.trans(at.to(tl.float32)))
    return acc + tl.dot(xt, tl.trans(at))


@triton.jit
def _store_h(acc, s, h_ptr, partial_ptr, scales_ptr, counter_ptr, tok, r, row_mask, h_mask, z,
             split, pid_m, pid_r, n_m, n_r, T, R, NUM_SLICES: tl.constexpr,
             SPLIT_K: tl.constexpr, H_BF16: tl.constexpr, X_CODES: tl.constexpr,
             INTERPRETER: tl.constexpr):
    # A shrink tile's part of slice `s` of h: its split's partial summed with the others' (the
    # last split's program stores), scaled by each row's scale on codes, stored.
    h_offs = (s * T + tok[:, None]).to(tl.int64) * R + r[None, :]
    h_tile = h_ptr + h_offs
    if H_BF16:
        part_tile = partial_ptr + h_offs
    else:
        part_tile = h_tile
    last = True
    if SPLIT_K > 1:
        # Summed here, once, into plane 0 (the other planes are scratch), so K2's epilogue
        # reads one plane: it read all of them in every output tile (at rank 128, 16 planes
        # made the h-given layer ~25% slower than rank 16: results/h200/decode.json).
        tile = ((z * NUM_SLICES + s) * n_m + pid_m) * n_r + pid_r
        acc, last = _sum_splits(acc, part_tile, NUM_SLICES * T * R, h_mask, split,
                                counter_ptr + tile, SPLIT_K)
    if last:
        if X_CODES:  # once, on the summed rows: the same bits at every split
            acc = acc * tl.load(scales_ptr + tok, mask=row_mask, other=0.0)[:, None]
        if H_BF16:  # rounded as K2 rounds an fp32 h: the same bits either way
            tl.store(h_tile, _to_bf16(acc, INTERPRETER), mask=h_mask)
        else:
            tl.store(h_tile, acc, mask=h_mask)


@triton.jit
def _shrink_tile(pid, x_ptr, scales_ptr, h_ptr, partial_ptr, a0_ptr, a1_ptr, a2_ptr,
                 sorted_ptr, lora_ids_ptr, counts_ptr, start_ptr, counter_ptr, trace_ptr,
                 T, K, R, stride_x, NUM_ENTRIES, NUM_SLICES: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, INTERPRETER: tl.constexpr,
                 ENTRIES_BLOCK: tl.constexpr, TRACE: tl.constexpr, H_BF16: tl.constexpr,
                 X_CODES: tl.constexpr, SLICES_TOGETHER: tl.constexpr = False):
    # Shrink program `pid`: one `BLOCK_M x BLOCK_R` tile of `h = x A_slot^T` for one adapter,
    # one slice and one split of K (K1's shrink programs, and with LEAD_SHRINK K2's first
    # programs). Its K loop in NUM_STAGES stages, whatever the launch's own.
    # SLICES_TOGETHER (`LaunchConfig.slices_together`, more than one slice): the same tile of
    # every slice, each x tile read once for all of them (one accumulator a slice).
    n_m = tl.cdiv(T, BLOCK_M)
    n_r = tl.cdiv(R, BLOCK_R)
    if SLICES_TOGETHER:
        per_tile = n_r * SPLIT_K
    else:
        per_tile = n_r * SPLIT_K * NUM_SLICES
    m_tile = pid // per_tile
    rest = pid % per_tile
    if SLICES_TOGETHER:
        s = 0  # and the others after it
    else:
        s = rest // (n_r * SPLIT_K)
    rest = rest % (n_r * SPLIT_K)
    split = rest // n_r
    pid_r = rest % n_r
    # The entries' row tiles laid end to end (entry z has cdiv(count_z, BLOCK_M) of them): the
    # launch has one program per tile of that list, not per tile of every entry times the
    # tokens' tiles, most of which would find no row (32 adapters at 128 tokens: 40 tiles for
    # 264). A program past the list's end (the launch's bound is larger) has nothing to do.
    z, pid_m = _entry_row_tile(m_tile, counts_ptr, NUM_ENTRIES, BLOCK_M, ENTRIES_BLOCK)
    if z < NUM_ENTRIES:
        slot = tl.load(lora_ids_ptr + z)
        count = tl.load(counts_ptr + z)
        start = tl.load(start_ptr + z)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < count
        tok = tl.load(sorted_ptr + start + rows, mask=row_mask, other=0)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        h_mask = row_mask[:, None] & (r[None, :] < R)
        # H_BF16: h in bf16 (for K2's tiles of 64 rows or more, whose epilogue rounds h to bf16
        # anyway: the same bits, half the bytes to read), split-K partials in fp32 planes of
        # their own (`partial_ptr`), both addressed only after the K loop (held through it,
        # their offsets spilled the decode path's K1 at 256 tokens, rank 128); else h is fp32
        # and plane 0 of the partials.
        if slot < 0:  # tokens without an adapter get zero rows of h: no loop, no partials
            if split == 0:
                tl.store(h_ptr + (s * T + tok[:, None]).to(tl.int64) * R + r[None, :],
                         tl.zeros([BLOCK_M, BLOCK_R], dtype=h_ptr.dtype.element_ty),
                         mask=h_mask)
                if SLICES_TOGETHER:
                    for other in tl.static_range(1, NUM_SLICES):
                        tl.store(h_ptr + (other * T + tok[:, None]).to(tl.int64) * R
                                 + r[None, :],
                                 tl.zeros([BLOCK_M, BLOCK_R], dtype=h_ptr.dtype.element_ty),
                                 mask=h_mask)
        else:
            a_base = _pick(s, a0_ptr, a1_ptr, a2_ptr) + slot.to(tl.int64) * R * K
            if SLICES_TOGETHER:  # slices 1 and 2 (a third only where there is one)
                a_base1 = a1_ptr + slot.to(tl.int64) * R * K
                a_base2 = a2_ptr + slot.to(tl.int64) * R * K
            k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
            k_begin = split * k_per_split
            k_end = tl.minimum(k_begin + k_per_split, K)
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            if SLICES_TOGETHER:
                acc1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                acc2 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
                k = k0 + tl.arange(0, BLOCK_K)
                xt = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :],
                             mask=row_mask[:, None] & (k[None, :] < K), other=0.0)
                if X_CODES:
                    xt = xt.to(tl.bfloat16)
                if INTERPRETER:
                    xt = xt.to(tl.float32)
                a_mask = (r[:, None] < R) & (k[None, :] < K)
                acc = _shrink_step(acc, xt, a_base + r[:, None] * K + k[None, :], a_mask,
                                   INTERPRETER)
                if SLICES_TOGETHER:  # the same x tile, the next slices' A
                    acc1 = _shrink_step(acc1, xt, a_base1 + r[:, None] * K + k[None, :],
                                        a_mask, INTERPRETER)
                    if NUM_SLICES > 2:
                        acc2 = _shrink_step(acc2, xt, a_base2 + r[:, None] * K + k[None, :],
                                            a_mask, INTERPRETER)
            _store_h(acc, s, h_ptr, partial_ptr, scales_ptr, counter_ptr, tok, r, row_mask,
                     h_mask, z, split, pid_m, pid_r, n_m, n_r, T, R, NUM_SLICES, SPLIT_K,
                     H_BF16, X_CODES, INTERPRETER)
            if SLICES_TOGETHER:
                _store_h(acc1, 1, h_ptr, partial_ptr, scales_ptr, counter_ptr, tok, r,
                         row_mask, h_mask, z, split, pid_m, pid_r, n_m, n_r, T, R, NUM_SLICES,
                         SPLIT_K, H_BF16, X_CODES, INTERPRETER)
                if NUM_SLICES > 2:
                    _store_h(acc2, 2, h_ptr, partial_ptr, scales_ptr, counter_ptr, tok, r,
                             row_mask, h_mask, z, split, pid_m, pid_r, n_m, n_r, T, R,
                             NUM_SLICES, SPLIT_K, H_BF16, X_CODES, INTERPRETER)
    _stamp(trace_ptr, 1, TRACE)


# T, the batch's tokens, is not specialized (Triton would compile a kernel for T = 1, one for
# multiples of 16 and one for the rest): vLLM's graph capture meets many batch sizes, each a
# compile in the engine's start (dev/compile_variants.py), and no address here needs T's
# alignment (every offset with T in it is a multiple of the rank R, whose alignment is known).
@triton.jit(do_not_specialize=["T"])
def _quantize_shrink_kernel(
    x_ptr, codes_ptr, scales_ptr, h_ptr, partial_ptr,
    a0_ptr, a1_ptr, a2_ptr,
    sorted_ptr, lora_ids_ptr, counts_ptr, start_ptr, counter_ptr, ready_ptr, trace_ptr,
    T, K, R, stride_x, NUM_ENTRIES,
    QUANTIZE: tl.constexpr, SIGNAL_CODES: tl.constexpr, NUM_SLICES: tl.constexpr,
    CODES_SORTED: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT_BLOCK: tl.constexpr, INTERPRETER: tl.constexpr, ENTRIES_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False, TRACE: tl.constexpr = False,
    H_BF16: tl.constexpr = False, X_CODES: tl.constexpr = False,
    AFTER_PREVIOUS: tl.constexpr = False, NUM_STAGES: tl.constexpr = 2,
    SLICES_TOGETHER: tl.constexpr = False,
):
    # X_CODES: x is the caller's per-token FP8 codes (scales at `scales_ptr`), not bf16: the
    # shrink widens them to bf16 (exact) and scales each row's sum, h = s_t * (q_t A^T), so an
    # engine need not keep the bf16 activations its compiler fused into the quantization.
    _stamp(trace_ptr, 0, TRACE)
    if AFTER_PREVIOUS:
        # Launched as the programmatic dependent of the kernel before it on the stream, so that
        # this launch overlaps that kernel's end: wait for it before anything else, and let K2
        # launch only after (K2 reads the caller's codes, and the counters, before its own
        # wait: everything before K1 must be done by then).
        tl.extra.cuda.gdc_wait()
    if USE_PDL:
        # The decode path: let the GEMM launched after us (our programmatic dependent) start
        # now; it waits for our codes (SIGNAL_CODES) before its K loop and for h before its
        # epilogue.
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if QUANTIZE:
        if pid < T:
            # CODES_SORTED: row pid of the codes is the pid-th token in adapter order (what
            # K2 reads by TMA, in whole row tiles), else token pid.
            # Rows past the tokens the segments count (an engine pads a batch to a captured
            # graph's size and leaves those sorted indices stale) stay in their own place.
            if CODES_SORTED:
                src = _sorted_token(sorted_ptr, start_ptr, pid, NUM_ENTRIES, ENTRIES_BLOCK)
            else:
                src = pid
            _quantize_row(x_ptr, codes_ptr, scales_ptr, src, pid, K, stride_x, QUANT_BLOCK,
                          INTERPRETER)
            if SIGNAL_CODES:
                # Count this row as done for the K2 already running, which spins on the count;
                # every thread's codes and the scale are stored before the release.
                if CODES_SORTED:  # K2 reads these codes by TMA
                    _fence_proxy_async_global(INTERPRETER)
                tl.debug_barrier()
                tl.atomic_add(ready_ptr, 1, sem="release", scope="gpu")
            _stamp(trace_ptr, 1, TRACE)
            _stamp(trace_ptr, 2, TRACE)  # marks a quantizing program (decode_timeline.py)
            return
        pid -= T
    _shrink_tile(pid, x_ptr, scales_ptr, h_ptr, partial_ptr, a0_ptr, a1_ptr, a2_ptr,
                 sorted_ptr, lora_ids_ptr, counts_ptr, start_ptr, counter_ptr, trace_ptr,
                 T, K, R, stride_x, NUM_ENTRIES, NUM_SLICES, SPLIT_K, BLOCK_M, BLOCK_R, BLOCK_K,
                 NUM_STAGES, INTERPRETER, ENTRIES_BLOCK, TRACE, H_BF16, X_CODES, SLICES_TOGETHER)


@triton.jit
def _pass_and_reset(ready_ptr, programs):
    # Count this program past its wait (`ready_ptr + 1`); the last of `programs` zeroes the
    # count it waited on (`ready_ptr`) and the pass count: counters at rest for the next
    # launch.
    if tl.atomic_add(ready_ptr + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.atomic_xchg(ready_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ready_ptr + 1, 0, sem="relaxed", scope="gpu")


# T: as _quantize_shrink_kernel's; the prefetch's geometry, so that one compiled kernel serves
# every next weight (an engine compiles it ahead, before it knows which layer follows which).
@triton.jit(do_not_specialize=["T", "PF_ROWS", "PF_STRIDE", "PF_LINES", "PF_HALF",
                               "PF_ROW_BYTES"])
def _lora_gemm_kernel(
    a_ptr, a_desc, a_scale_ptr, w_ptr, w_desc, w_scale_ptr, bias_ptr, y_ptr, h_ptr,
    b0_ptr, b1_ptr, b2_ptr,
    sorted_ptr, lora_ids_ptr, start_ptr, partial_ptr, counter_ptr, ready_ptr, trace_ptr,
    T, N, K, R, NUM_ENTRIES,
    stride_a, stride_y, N_OFF1, N_OFF2,
    MODE: tl.constexpr, HAS_LORA: tl.constexpr, NUM_SLICES: tl.constexpr,
    H_PLANES: tl.constexpr, SPLIT_K: tl.constexpr, ENTRIES_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, INTERPRETER: tl.constexpr, USE_PDL: tl.constexpr = False,
    WAIT_CODES: tl.constexpr = False, WARM_L2: tl.constexpr = 0, TRACE: tl.constexpr = False,
    B_IN_REGS: tl.constexpr = True, R_CHUNK: tl.constexpr = 0,  # 0: the whole rank at once
    SEG_STAGES: tl.constexpr = 1,
    GATHER_SEGMENTS: tl.constexpr = False, GATHER_R_STEP: tl.constexpr = 1,
    W_TMA: tl.constexpr = False, WAIT_K1_FIRST: tl.constexpr = False,
    A_TMA: tl.constexpr = False, W_SCALE_PER_CHANNEL: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False, DELTA_FIRST: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False, SWAP_PROMOTE: tl.constexpr = True,
    EPILOGUE_HALVES: tl.constexpr = False, DELTA_IN_Y: tl.constexpr = False,
    EPILOGUE_EARLY: tl.constexpr = False,
    pf_ptr=None, PF_ROWS=0, PF_STRIDE=0, PF_LINES=0, PF_HALF=0, PF_ROW_BYTES=0,
    PREFETCH: tl.constexpr = 0,
    PF_BLOCK: tl.constexpr = 128,
    LEAD_SHRINK: tl.constexpr = False, x_ptr=None, x_scales_ptr=None, counts_ptr=None,
    a0_ptr=None, a1_ptr=None, a2_ptr=None, stride_x=0, S_SPLIT_K: tl.constexpr = 1,
    S_BLOCK_M: tl.constexpr = 16, S_BLOCK_R: tl.constexpr = 16, S_BLOCK_K: tl.constexpr = 16,
    S_STAGES: tl.constexpr = 1, X_CODES: tl.constexpr = False,
):
    _stamp(trace_ptr, 0, TRACE)
    if LEAD_SHRINK:
        # The decode path on the caller's codes in one launch: a 1-D grid whose first `lead`
        # programs are the shrink's (K1's shrink programs, in the S_ settings), each counting
        # itself done (a release) once its part of h is stored, and whose others are the
        # GEMM's, which wait for that count only before their epilogue. The GPU starts a grid's
        # blocks in order and the shrink's wait for nothing, so a spinning GEMM program never
        # keeps one from running; the interpreter runs them in order.
        lead = _shrink_count(T, R, NUM_ENTRIES, NUM_SLICES, S_SPLIT_K, S_BLOCK_M, S_BLOCK_R)
        lin = tl.program_id(0)
        if lin < lead:
            _shrink_tile(lin, x_ptr, x_scales_ptr, h_ptr, h_ptr, a0_ptr, a1_ptr, a2_ptr,
                         sorted_ptr, lora_ids_ptr, counts_ptr, start_ptr, counter_ptr,
                         trace_ptr, T, K, R, stride_x, NUM_ENTRIES, NUM_SLICES, S_SPLIT_K,
                         S_BLOCK_M, S_BLOCK_R, S_BLOCK_K, S_STAGES, INTERPRETER, ENTRIES_BLOCK,
                         TRACE, False, X_CODES)
            tl.debug_barrier()  # every thread's part of h stored before the count moves
            tl.atomic_add(ready_ptr, 1, sem="release", scope="gpu")
            return
        lin -= lead
        grid_m = tl.cdiv(T, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        pid_m = lin % grid_m
        pid_n = (lin // grid_m) % grid_n
        pid_k = lin // (grid_m * grid_n)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        grid_m = tl.num_programs(0)
        grid_n = tl.num_programs(1)
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos_mask = pos < T
    if HAS_LORA:
        tok = _sorted_token(sorted_ptr, start_ptr, pos, NUM_ENTRIES, ENTRIES_BLOCK, pos_mask)
    else:  # no adapters: rows in their own order
        tok = pos
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    y_tile = y_ptr + tok[:, None].to(tl.int64) * stride_y + n[None, :]
    out_mask = pos_mask[:, None] & n_mask[None, :]

    early_h = 0  # (the epilogue in halves takes these whether or not EPILOGUE_EARLY loads them)
    early_b_left = 0
    early_b_right = 0
    if HAS_LORA:
        # Before the K loop, what the epilogue needs that K1 does not write: the adapter
        # segments that meet this tile (one vector load, not a loop over every slot) and, with
        # one slot, the first one's slice of B (B_IN_REGS: held in registers, so that after the
        # wait only h is read; else warmed in L2).
        n0 = pid_n * BLOCK_N
        s, slice_begin, slice_end, b_base = _slice_at(n0, N, N_OFF1, N_OFF2, b0_ptr, b1_ptr,
                                                      b2_ptr)
        b_offs = (n - slice_begin)[:, None] * R + tl.arange(0, BLOCK_R)[None, :]
        b_mask = (n < slice_end)[:, None] & n_mask[:, None] & (tl.arange(0, BLOCK_R)[None, :] < R)
        e = tl.arange(0, ENTRIES_BLOCK)
        e_mask = e < NUM_ENTRIES
        slots = tl.load(lora_ids_ptr + e, mask=e_mask, other=-1)
        seg_begins = tl.load(start_ptr + e, mask=e_mask, other=0)
        seg_ends = tl.load(start_ptr + e + 1, mask=e_mask, other=0)
        tile_begin = pid_m * BLOCK_M
        meets = (slots >= 0) & (seg_begins < tile_begin + BLOCK_M) & (seg_ends > tile_begin)
        z_first = tl.min(tl.where(meets, e, ENTRIES_BLOCK), axis=0)
        z_last = tl.max(tl.where(meets, e, -1), axis=0)
        if ENTRIES_BLOCK <= 2:  # one slot (several: the segment loop pipelines its loads)
            # Its slot and segment, so that the epilogue waits on no load of them (loaded
            # there, at every rank step, the slot held back each step's slice of B: the
            # rank-128 epilogue took ~4 us a program at 256 tokens against ~0.4 without an
            # adapter, benchmarks/results/h200/decode_timeline_epilogue_r128_256.json; taken
            # from here, 2.9-3.7 us: decode_timeline_one_slot_epilogue_r128_256.json).
            first_slot = tl.max(tl.where(e == z_first, slots, -1), axis=0)
            first_begin = tl.max(tl.where(e == z_first, seg_begins, 0), axis=0)
            first_end = tl.max(tl.where(e == z_first, seg_ends, 0), axis=0)
            first_b = b_base + first_slot.to(tl.int64) * (slice_end - slice_begin) * R
            if EPILOGUE_EARLY:
                # The epilogue in halves from operands loaded before the K loop: B's two
                # halves now (they do not depend on K1), h after the wait for K1 below.
                tl.static_assert(
                    EPILOGUE_HALVES and MODE == 0 and SPLIT_K == 1 and not WAIT_CODES
                    and not LEAD_SHRINK and (WAIT_K1_FIRST or not USE_PDL),
                    "EPILOGUE_EARLY: one slot in halves, K whole, h whole before the K loop")
                early_b_left, early_b_right = _early_b(
                    b_base, first_slot, R, N, n0, slice_begin, slice_end, BLOCK_N, BLOCK_R)
            if B_IN_REGS:
                b_first = tl.load(first_b + b_offs, mask=b_mask & (first_slot >= 0), other=0.0)
            elif not INTERPRETER and not EPILOGUE_EARLY:
                # Too big to hold in registers through the K loop (at rank 128 it cost gate_up's
                # K2 a third of its blocks per SM: results/cpu/sm90_occupancy.json of f2cbeef):
                # warm L2 with it, one prefetch per 128-byte line, and load it after the wait.
                lines = tl.arange(0, (BLOCK_R + 63) // 64) * 64
                warm_b = first_b + (n - slice_begin)[:, None] * R + lines[None, :]
                warm_b = tl.where((n < slice_end)[:, None] & n_mask[:, None]
                                  & (lines[None, :] < R) & (first_slot >= 0), warm_b, b_base)
                _prefetch_l2(warm_b)

    if SPLIT_K == 1:
        k_begin = 0
        k_end = K
    else:  # this program's share of K, whole BLOCK_K steps
        k_step = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_begin = pid_k * k_step
        k_end = tl.minimum(k_begin + k_step, K)

    if WARM_L2 and not INTERPRETER:
        # While K1 quantizes, pull the first WARM_L2 bytes of each of this program's weight rows
        # into L2 (one prefetch per 128-byte line): weights do not depend on K1.
        k_warm = k_begin + tl.arange(0, WARM_L2 // 128) * 128
        warm = (w_ptr + n[:, None].to(tl.int64) * K + k_warm[None, :])
        warm = tl.where(n_mask[:, None] & (k_warm[None, :] < k_end), warm, w_ptr)
        _prefetch_l2(warm)

    if PREFETCH == 2 and not INTERPRETER:
        # The caller's next projection's weight, into L2 beside this GEMM's own stream (a
        # small projection's decode GEMM is latency-bound and leaves HBM room); evicted last,
        # so that this GEMM's own lines, read once, make L2's room (its cp.async copies take
        # no eviction hint in Triton 3.6).
        _prefetch_next(pf_ptr, PF_ROWS, PF_STRIDE, PF_LINES, PF_HALF, PF_ROW_BYTES, PF_BLOCK,
                       EVICT_LAST=True)

    if WAIT_CODES:
        # The decode path: launched while K1 runs, wait until its quantizing programs have
        # counted every row (a spin on the count, which they release; they cannot be waiting
        # for us: PDL launched us only once every K1 program had started).
        while tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu") < T:
            pass
        if A_TMA:  # the codes, stored by K1's generic stores, are read below by TMA
            _fence_proxy_async_global(INTERPRETER)
        _stamp(trace_ptr, 1, TRACE)

    if WAIT_K1_FIRST:
        # The fused path with PDL: launched early only to hide the launch and the prologue
        # above, it waits for all of K1 before reading K1's codes.
        tl.extra.cuda.gdc_wait()
        _stamp(trace_ptr, 1, TRACE)

    if EPILOGUE_EARLY:
        # h whole (K1 done): the slot's segment's rows of it (zero elsewhere), held through the
        # K loop with B's halves, so that after the loop no load waits (its own load waits
        # here, before the loop's first TMA loads: `_tiling.epilogue_early`).
        early_h = _h_bf16(h_ptr, tok, pos_mask & (pos >= first_begin) & (pos < first_end), s,
                          T, R, tl.arange(0, BLOCK_R), NUM_SLICES, H_PLANES, INTERPRETER)

    if DELTA_IN_Y:
        # `_segment_delta_kernel` wrote the delta of adapter segments' rows only: which rows
        # those are, worked out here so that only one flag a row lives through the K loop.
        inside = ((pos[:, None] >= seg_begins[None, :]) & (pos[:, None] < seg_ends[None, :])
                  & (slots[None, :] >= 0))
        adapted = tl.max(inside.to(tl.int32), axis=1) > 0
    elif DELTA_FIRST:
        # Several slots in 64- and 128-row FP8 tiles where h is whole before the K loop (K1
        # done): the adapters' delta first, rounded to bf16 and kept in y (L2), then the GEMM.
        # Summed after the GEMM, beside its stored base, the tile spilled 1.6 KB a thread
        # (dev/sm90_occupancy.py --adapters 8 --tokens 512 2048) and the layer's 8x16 cells at
        # 512-2048 tokens took 1.15-1.57x as long on the H200 (docs/kernels.md).
        delta = _several_slots_delta(
            tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), h_ptr, tok, pos, pos_mask, s, T, R,
            n, n_mask, slice_begin, slice_end, b_base, b_offs, b_mask, lora_ids_ptr, start_ptr,
            NUM_ENTRIES, z_first, z_last, NUM_SLICES, H_PLANES, BLOCK_R, R_CHUNK, ENTRIES_BLOCK,
            SEG_STAGES, INTERPRETER)
        tl.store(y_tile, _to_bf16(delta, INTERPRETER), mask=out_mask)
    if MODE == 2:
        acc = tl.load(y_tile, mask=out_mask, other=0.0).to(tl.float32)
    else:
        # SWAP_AB: decode tiles (16 or 32 rows) as the transposed product, W x^T: the weight
        # tile is the MMA's 64-row side, so sm_90 runs it on wgmma (m64n16 / m64n32) from
        # shared memory, the weight streamed by TMA (W_TMA), as CUTLASS's swap-AB decode GEMM
        # does, where a 16-row tile is mma.sync's; transposed back after the loop, so the
        # epilogue is the same. FP8 wgmma sums in reduced precision (about 7% low on
        # all-positive operands over K = 4096: docs/kernels.md, "FP8 accumulation"), so there
        # (SWAP_PROMOTE) each K tile's sum starts from zero and is then added to the fp32
        # accumulator (max_num_imprecise_acc): near the mma.sync tiles' fp32 sums, for a few
        # FADDs a thread per K tile and a wait for the tile's MMAs before them (ptxas injects
        # it), where the wgmmas otherwise chain asynchronously.
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if A_TMA:  # codes in adapter order (K1's CODES_SORTED): the tile's rows by TMA
                at = a_desc.load([pid_m * BLOCK_M, k0])
            else:
                at = tl.load(a_ptr + tok[:, None].to(tl.int64) * stride_a + k[None, :],
                             mask=pos_mask[:, None] & (k[None, :] < K), other=0.0)
            if W_TMA:  # the weight tile by TMA (zero-padded past N and K)
                wt = w_desc.load([pid_n * BLOCK_N, k0])
            else:
                wt = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :],
                             mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
            if MODE == 1:  # the weight widened (the interpreter's bf16 dot is an fp32 one)
                wt = wt.to(tl.float32 if INTERPRETER else tl.bfloat16)
                if INTERPRETER:
                    at = at.to(tl.float32)
            if SWAP_AB and MODE == 0 and SWAP_PROMOTE:
                acc = tl.dot(wt, tl.trans(at), acc, max_num_imprecise_acc=BLOCK_K)
            elif SWAP_AB and MODE == 0:
                acc = tl.dot(wt, tl.trans(at), acc)
            elif SWAP_AB:
                acc += tl.dot(wt, tl.trans(at))
            elif MODE == 0:
                acc = tl.dot(at, tl.trans(wt), acc)
            else:
                acc += tl.dot(at, tl.trans(wt))
        if SWAP_AB:
            acc = tl.trans(acc)
    _stamp(trace_ptr, 2, TRACE)
    if PREFETCH == 1 and not INTERPRETER:
        # The caller's next projection's weight, into L2 while the engine runs what comes
        # between (attention, a norm: little HBM traffic at decode sizes). No store: it may
        # precede gdc_wait.
        _prefetch_next(pf_ptr, PF_ROWS, PF_STRIDE, PF_LINES, PF_HALF, PF_ROW_BYTES, PF_BLOCK)

    if WAIT_CODES:
        # The last program past the K loop (so past the spin) zeroes both counts for the next
        # launch: here its latency overlaps the wait below (right after the spin every program
        # hit one address before its K loop; the H200 showed no difference either way,
        # results/h200/decode_v3_count_after_spin.json). Atomics: no plain store may precede
        # gdc_wait, and none is needed.
        _pass_and_reset(ready_ptr, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2))
    if LEAD_SHRINK:
        # h: every shrink program counted (the last GEMM program past here zeroes the counts)
        while tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu") < lead:
            pass
        _pass_and_reset(ready_ptr, grid_m * grid_n * SPLIT_K)
        _stamp(trace_ptr, 3, TRACE)
    if USE_PDL:
        # Everything above read what existed before K1 started or what K1 counted as done
        # (WAIT_CODES); h is K1's. Unconditional, and before any global store (split-K
        # partials included): see docs/kernels.md, "The decode path".
        tl.extra.cuda.gdc_wait()
        _stamp(trace_ptr, 3, TRACE)
    if SPLIT_K > 1:
        plane = (grid_m * BLOCK_M).to(tl.int64) * N
        acc, last = _sum_splits(
            acc, partial_ptr + pos[:, None].to(tl.int64) * N + n[None, :], plane,
            n_mask[None, :], pid_k, counter_ptr + pid_m * grid_n + pid_n, SPLIT_K)
        if not last:
            _stamp(trace_ptr, 4, TRACE)
            return
    if MODE != 2:
        if W_SCALE_PER_CHANNEL:  # one scale per output channel (llm-compressor's FP8-dynamic)
            w_scale = tl.load(w_scale_ptr + n, mask=n_mask, other=0.0)[None, :]
        else:
            w_scale = tl.load(w_scale_ptr)
    if MODE == 0:
        x_scale = tl.load(a_scale_ptr + (pos if A_TMA else tok), mask=pos_mask, other=0.0)
        acc = x_scale[:, None] * (w_scale * acc)
    elif MODE == 1:
        acc = w_scale * acc
    if HAS_BIAS:  # in fp32 before any rounding, as vLLM's CUTLASS epilogue adds it
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]

    if EPILOGUE_HALVES:
        # A 64- or 128-row FP8 tile: the rounded base stays in registers and the delta is
        # added half the tile's columns at a time (`_tiling.epilogue_halves`).
        tl.static_assert(MODE == 0 and HAS_LORA and not DELTA_FIRST,
                         "EPILOGUE_HALVES: FP8 tiles with adapters, no term parked in y")
        if ENTRIES_BLOCK > 2:  # unused with several slots (the segment loop's own)
            first_slot = -1
            first_begin = 0
            first_end = 0
        _epilogue_in_halves(
            acc, h_ptr, y_ptr, tok, pos, pos_mask, s, T, R, N, n0, stride_y,
            slice_begin, slice_end, b_base, first_slot, first_begin, first_end, lora_ids_ptr,
            start_ptr, NUM_ENTRIES, z_first, z_last, early_h, early_b_left, early_b_right,
            NUM_SLICES, H_PLANES, BLOCK_M, BLOCK_N, BLOCK_R, R_CHUNK, ENTRIES_BLOCK,
            SEG_STAGES, EPILOGUE_EARLY, INTERPRETER)
    else:
        if HAS_LORA and MODE != 1 and not DELTA_FIRST:
            # As vLLM's expand (do_expand_kernel, add_inputs): the delta summed from zero, rounded
            # to bf16, then added to the GEMM's bf16 output (the expand's MODE 2 loaded it), so
            # that served answers are stock's up to the base's own sums. W8A16 (MODE 1) adds the
            # fp32 delta before one rounding, the trainer's arithmetic (epilora_rl.reference).
            if BLOCK_M >= 64:
                # A second tile in registers beside the delta's spilled the 64- and 128-row tiles
                # (gate_up's 128 x 256 prefill tile 1.5 KB a thread, dev/sm90_occupancy.py): the
                # bf16 base waits in y instead, in L2 (the expand's base is there already).
                if MODE == 0:
                    tl.store(y_tile, _to_bf16(acc, INTERPRETER), mask=out_mask)
            else:
                base = _to_bf16(acc, INTERPRETER)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HAS_LORA and not DELTA_FIRST:
            b_stride = (slice_end - slice_begin) * R  # one slot's slice of B
            if GATHER_SEGMENTS:
                acc = _gathered_delta(
                    acc, h_ptr, tok, pos, pos_mask, s, T, R, n, n_mask, slice_begin, slice_end,
                    b_base, lora_ids_ptr, start_ptr, NUM_ENTRIES, NUM_SLICES, H_PLANES, BLOCK_R,
                    GATHER_R_STEP, ENTRIES_BLOCK, INTERPRETER)
            elif ENTRIES_BLOCK > 2:
                acc = _several_slots_delta(
                    acc, h_ptr, tok, pos, pos_mask, s, T, R, n, n_mask, slice_begin, slice_end,
                    b_base, b_offs, b_mask, lora_ids_ptr, start_ptr, NUM_ENTRIES, z_first, z_last,
                    NUM_SLICES, H_PLANES, BLOCK_R, R_CHUNK, ENTRIES_BLOCK, SEG_STAGES, INTERPRETER)
            elif R_CHUNK > 0 and R_CHUNK < BLOCK_R:
                # One slot, the rank in R_CHUNK-wide steps: a loop Triton pipelines, no step's
                # loads waiting on another load.
                if first_slot >= 0:
                    acc = _one_slot_delta(acc, h_ptr, tok, pos, pos_mask, s, T, R, n, n_mask,
                                          slice_begin, slice_end, b_base, b_stride,
                                          first_slot, first_begin, first_end, R_CHUNK,
                                          BLOCK_R, NUM_SLICES, H_PLANES, INTERPRETER)
            else:  # one slot: at most one segment with an adapter
                hb = _h_bf16(h_ptr, tok, pos_mask, s, T, R, tl.arange(0, BLOCK_R), NUM_SLICES,
                             H_PLANES, INTERPRETER)
                if not B_IN_REGS and first_slot >= 0:  # B's load waits on no load of the slot
                    bt = tl.load(first_b + b_offs, mask=b_mask, other=0.0)
                    acc = _add_rows(acc, hb, (pos >= first_begin) & (pos < first_end), bt,
                                    INTERPRETER)
                elif B_IN_REGS:
                    # B already here, the slot's load overlaps h's. (Written as above, gate_up's
                    # 128-row K2 at rank 16 needed 4 KB more shared memory, 3 blocks per SM to 2:
                    # tools/sm90_occupancy.py.)
                    for z in range(z_first, z_last + 1):
                        slot = tl.load(lora_ids_ptr + z)
                        seg_begin = tl.load(start_ptr + z)
                        seg_end = tl.load(start_ptr + z + 1)
                        if slot >= 0:
                            if z == z_first:
                                bt = b_first
                            else:
                                bt = tl.load(b_base + slot.to(tl.int64) * b_stride + b_offs,
                                             mask=b_mask, other=0.0)
                            acc = _add_rows(acc, hb, (pos >= seg_begin) & (pos < seg_end), bt,
                                            INTERPRETER)
        if HAS_LORA and MODE != 1:
            # acc holds the delta, or with DELTA_FIRST the base; the other term, rounded, waits in
            # y or (base, below 64 rows) in registers. Their sum is the same either way round.
            held = _to_bf16(acc, INTERPRETER)  # rounded first: the fp32 tile's registers free
            if DELTA_IN_Y:  # rows outside adapter segments add 0 (y is unwritten there)
                kept = tl.load(y_tile, mask=out_mask & adapted[:, None], other=0.0)
            elif DELTA_FIRST or BLOCK_M >= 64:
                tl.debug_barrier()  # y's stores, whichever thread made them, before its load
                kept = tl.load(y_tile, mask=out_mask, other=0.0)
            else:
                kept = base
            acc = kept.to(tl.float32) + held.to(tl.float32)
        tl.store(y_tile, _to_bf16(acc, INTERPRETER), mask=out_mask)
    _stamp(trace_ptr, 4, TRACE)
