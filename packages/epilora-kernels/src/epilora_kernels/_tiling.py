"""How a launch is laid out: its launch settings (table or heuristic), grid sizes, counter
counts, and the compile-time choices that follow from its tiles (TMA, where B is held, rank
steps). Pure host arithmetic: nothing here launches or allocates."""

import dataclasses
from collections.abc import Callable

from epilora_kernels import _env
from epilora_kernels.arch import DeviceSupport
from epilora_kernels.batch import AdapterBatch, LoraWeights
from epilora_kernels.launch import (
    LaunchConfig,
    fit_slices,
    select_config,
    table_device,
    tuned_exactly,
    wave_efficiency,
)


# Host integer arithmetic of the launches. `triton.cdiv` and `triton.next_power_of_2` are
# constexpr functions: from host code each call goes through Triton's JIT wrapper (~3 us a call
# on a fast host; a dozen a call of the fused path).
def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` of ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def table_of(support: DeviceSupport) -> str | None:
    """The device whose launch table the launchers read for `support` (its own shipped table,
    else its architecture's; with neither its own name still finds its tuner cache, which
    launch._load_table overlays on whichever table it finds), or None: the heuristic alone
    (the interpreter, EPILORA_LAUNCH_TABLES=0)."""
    if support.interpreter or not _env.launch_tables():
        return None
    return table_device(support.name, support.arch) or support.name


def shape_config(support: DeviceSupport, op: str, tokens: int, n: int, k: int, rank: int,
                 slices: tuple[int, ...], one_slot: bool | None = False) -> LaunchConfig:
    """The device's table entry (its own table, else its architecture's), else the heuristic."""
    device = table_of(support)
    # Prefill tiles only where a block may take sm_90's shared memory (sm_89 and consumer GPUs
    # have 99-101 KB); the interpreter has no such bound.
    return select_config(device, op, tokens, n, k, rank, slices, one_slot,
                         cache_device=support.name,
                         large_tiles=support.arch == "sm90" or support.interpreter)


def config(support: DeviceSupport, op: str, tokens: int, lora: LoraWeights,
           given: LaunchConfig | None, one_slot: bool | None = False) -> LaunchConfig:
    if given is not None:
        return given
    return shape_config(support, op, tokens, lora.out_features, lora.in_features, lora.max_rank,
                        lora.output_slices, one_slot)


def one_slot(batch: AdapterBatch) -> bool:
    # One slot (and the entry for tokens without one): K2 compiles its one-slot epilogue
    # (ENTRIES_BLOCK 2), which the table's one-slot entries were tuned on; K1's row tiles grow
    # with the slots (rank 64's one-slot 4-token K1 entries made the 32-adapter layer at 4
    # tokens 5.5 us slower as plain rank entries: layer_32x64_k1_r64_4_plain.json of 0f3bdfb).
    return batch.num_entries <= 2


def gemm_config(support: DeviceSupport, batch: AdapterBatch, lora: LoraWeights,
                given: LaunchConfig | None) -> LaunchConfig:
    return config(support, "lora_gemm", batch.num_tokens, lora, given, one_slot(batch))


def gemm_tuned_exactly(support: DeviceSupport, batch: AdapterBatch, lora: LoraWeights) -> bool:
    """Whether K2's settings for this batch come from an entry tuned on this very shape (the
    shipped table or the tuner's cache), not from a nearer shape's entry or the heuristic
    (as where the shape's buckets do not cover the batch: 17-32 tokens on a shape tuned at
    1-16 only)."""
    device = table_of(support)
    return device is not None and tuned_exactly(
        device, "lora_gemm", lora.out_features, lora.in_features, lora.max_rank,
        one_slot(batch), cache_device=support.name, tokens=batch.num_tokens)


def blocks_per_sm(registers: int, shared: int, warps: int, sm_registers: int = 65536,
                  sm_shared: int = 228 * 1024, sm_threads: int = 2048) -> int:
    """Blocks of a kernel one SM holds at once (defaults: an sm_90 SM): registers are allocated
    per warp in units of 256, each block reserves 1 KB of shared memory, at most 32 blocks."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(sm_registers // (per_warp * warps), sm_shared // (shared + 1024), 32,
               sm_threads // (32 * warps))


# Wave fitting (K2 at the decode token counts, 16- and 32-row tiles). A decode K2 streams its
# weights; its programs all take about as long, so a grid one program past what the SMs hold at
# once runs a second wave of stragglers: Llama-3.1-8B's gate_up (28672 x 4096) in 64-wide tiles
# is 448 programs, and holding the rank-64 adapter's slice of B in registers (146 registers)
# leaves room for 3 blocks an SM, 396 at once: its decode K2 took 53 us against 44 without the
# adapter (dev/decode_projections.py on the H200; dev/sm90_occupancy.py for the registers).
# Qwen3-8B's gate_up, on which the table was tuned, is 384 programs: it just fits.
WAVE_BLOCK_N = (32, 64, 128)
WAVE_SPLIT_K = (1, 2)
WAVE_STAGES = (3,)


def wave_candidates(cfg: LaunchConfig, k: int, slices: tuple[int, ...]) -> list[LaunchConfig]:
    """`cfg` first, then its tiles with N tiles of 32, 64 or 128, the K loop whole or split in
    two, in its own number of stages or 3 (only where a tile stays within one slice and each split
    keeps at least one K tile)."""
    out = [cfg]
    for block_n in WAVE_BLOCK_N:
        if fit_slices(block_n, slices) != block_n:
            continue
        for split_k in WAVE_SPLIT_K:
            if k < split_k * cfg.block_k:
                continue
            for stages in sorted({cfg.num_stages, *WAVE_STAGES}):
                out.append(dataclasses.replace(cfg, block_n=block_n, split_k=split_k,
                                               num_stages=stages))
    return list(dict.fromkeys(out))


# A setting in use fills at least this much of its waves: left alone.
WAVE_EFFICIENCY_OK = 0.9


def fit_waves(cfg: LaunchConfig, candidates: list[LaunchConfig],
              measure: Callable[[LaunchConfig], tuple[int, int] | None],
              sms: int) -> LaunchConfig:
    """The setting whose grid fills its waves best: `cfg` itself where it fills
    WAVE_EFFICIENCY_OK of them, else the candidate of the highest `wave_efficiency` (ties: `cfg`
    itself, then the K loop unsplit, then the deeper pipeline, then the first listed).
    `measure(c)`: c's (programs, blocks per SM), or None where c does not compile or fit."""
    scores = {}
    for index, candidate in enumerate(candidates):
        measured = measure(candidate)
        if measured is None:
            continue
        efficiency = wave_efficiency(*measured, sms)
        if candidate == cfg and efficiency >= WAVE_EFFICIENCY_OK:
            return cfg
        scores[candidate] = (round(efficiency, 2), candidate == cfg, -candidate.split_k,
                             candidate.num_stages, -index)
    return max(scores, key=scores.get) if scores else cfg


def check_gemm_config(cfg: LaunchConfig, lora: LoraWeights) -> None:
    """K2's settings against the adapters: checked before K1 launches, so that a bad K2 cannot
    leave K1's counts behind."""
    if any(w % cfg.block_n for w in lora.output_slices[:-1]):
        raise ValueError(f"block_n={cfg.block_n} must divide the slice widths "
                         f"{lora.output_slices[:-1]} (a tile must not straddle two slices)")
    if cfg.block_r < lora.max_rank:
        raise ValueError(f"block_r={cfg.block_r} must cover the adapters' max rank "
                         f"{lora.max_rank}: K2's epilogue reads all of h in one tile")


def quant_block(k: int, cap: int) -> int:
    # Row chunk of the quantizing programs. With 8 warps a row of up to 16384 features
    # (Qwen3-8B's widest input is 12288) stays in registers, 64 values a thread, and is read
    # once; with 4 warps beside the shrink's tiles in K1 a 16384 chunk spilled and made K1 ~10x
    # slower (tune_v2.json of 0f3bdfb), so there rows go in chunks of 4096, read twice.
    return min(next_power_of_2(k), cap)


def entry_row_tiles(t: int, batch: AdapterBatch, block_m: int) -> int:
    """A bound on the row tiles of the entries' list (each entry's tokens in tiles of
    `block_m` rows, laid end to end: K1's shrink, the delta kernel): at most cdiv(T, block_m)
    + (entries with tokens) - 1, and at most min(entries, T) entries have tokens."""
    return max(0, cdiv(t, block_m) + min(batch.num_entries, t) - 1)


def shrink_programs(t: int, lora: LoraWeights, batch: AdapterBatch, cfg: LaunchConfig) -> int:
    # K1's shrink programs: one per (row tile of the entries' list, slice, rank tile, split),
    # every slice in one with `slices_together`.
    row_tiles = entry_row_tiles(t, batch, cfg.block_m)
    return (row_tiles * cdiv(lora.max_rank, cfg.block_r) * cfg.split_k
            * (1 if slices_together(cfg, lora) else len(lora.output_slices)))


def slices_together(cfg: LaunchConfig, lora: LoraWeights) -> bool:
    # K1's SLICES_TOGETHER: asked for, and more than one slice (one alone is the plain tile:
    # one kernel for both).
    return cfg.slices_together and len(lora.output_slices) > 1


def k1_tiles(t: int, lora: LoraWeights, batch: AdapterBatch, cfg: LaunchConfig) -> int:
    # K1's split-K tile counters, indexed by (entry, slice, row tile, rank tile): room for all.
    if cfg.split_k == 1:
        return 0
    return (batch.num_entries * cdiv(t, cfg.block_m)
            * cdiv(lora.max_rank, cfg.block_r) * len(lora.output_slices))


def gemm_grid(mode: int, t: int, n: int, cfg: LaunchConfig) -> tuple[int, int, int]:
    split = 1 if mode == 2 else cfg.split_k  # the expand has no K loop to split
    return (cdiv(t, cfg.block_m), cdiv(n, cfg.block_n), split)


def k2_tiles(mode: int, t: int, n: int, cfg: LaunchConfig) -> int:
    # K2's split-K tile counters, one per output tile.
    grid = gemm_grid(mode, t, n, cfg)
    return 0 if grid[2] == 1 else grid[0] * grid[1]


def w_tma(support: DeviceSupport, weight, cfg: LaunchConfig) -> bool:
    # Prefill tiles (64 rows or more, wgmma) read the weight tile by TMA, which needs 16-byte
    # aligned rows: 1x128 at 256 tokens 187.4 -> 183.6 us. The 16- and 32-row decode tiles
    # (MMAv2) were slower with it (layer_1x128_tma_hbf16_ab_*.json and
    # layer_decode_tma_ab_*.json of 0f3bdfb); swapped (`swap_ab`), wgmma's again, they take it.
    return (support.tma and (cfg.block_m >= 64 or cfg.swap_ab) and weight.stride(0) % 16 == 0
            and weight.data_ptr() % 16 == 0)


def a_tma(support: DeviceSupport, a, weight, cfg: LaunchConfig) -> bool:
    # FP8 codes read by TMA where the weight is (tiles of 64 rows or more), rows 16-byte
    # aligned; K1 then writes them in adapter order (CODES_SORTED), so each row tile is a
    # contiguous block of rows.
    return (w_tma(support, weight, cfg) and a.stride(1) == 1 and a.stride(0) % 16 == 0
            and a.data_ptr() % 16 == 0)


def b_fits_registers(cfg: LaunchConfig) -> bool:
    # The first adapter segment's slice of B (block_n x block_r bf16) is at most 32 values a
    # thread (at rank 128, 64 a thread cost gate_up's 16-row K2 a third of its blocks per SM:
    # results/cpu/sm90_occupancy.json of f2cbeef).
    return cfg.block_n * cfg.block_r <= 32 * 32 * cfg.num_warps


def b_in_registers(cfg: LaunchConfig) -> bool:
    # Whether K2 loads that slice before its K loop and holds it there. A 16-row tile (decode,
    # 1-16 tokens) whose slice does not fit only warms L2 with it and loads it after the wait:
    # the rank-128 decode layer got faster at 1-16 tokens. At 32 tokens (32-row tiles) the
    # decode layer got slower that way (decode_ed9125f.json against decode_993031f.json of
    # 0f3bdfb), so those hold it whatever its size. Larger tiles with one slot step through the
    # rank instead (epilogue_rank_chunk); with several slots none is loaded early.
    return b_fits_registers(cfg) or cfg.block_m == 32


# The several-slot epilogue's loop over adapter segments in flight (`LaunchConfig.
# segment_stages` above 1): its slices of B within SEGMENT_BYTES of shared memory, in at most
# MAX_SEGMENT_STAGES stages (the K loop's buffers, dead by then, hold them: no block takes
# more shared memory, dev/sm90_occupancy.py).
SEGMENT_BYTES = 16 * 1024
MAX_SEGMENT_STAGES = 8


def segment_stages(cfg: LaunchConfig) -> int:
    """The deepest segment loop for `cfg`'s tiles (the tuner's candidate): as many slices of B
    (bf16, block_n x the rank or its epilogue step) as SEGMENT_BYTES hold, at most
    MAX_SEGMENT_STAGES and at least 2 (beyond SEGMENT_BYTES where one slice is over half of
    it: a 64-wide tile at rank 128 takes 2 x 16 KB)."""
    step = cfg.block_n * (epilogue_rank_chunk(cfg) or cfg.block_r) * 2
    return max(2, min(MAX_SEGMENT_STAGES, SEGMENT_BYTES // step))


def in_flight(cfg: LaunchConfig) -> LaunchConfig:
    """`cfg` with K2's loop over adapter segments as deep as `segment_stages` allows (several
    slots; dev/launch_variants.py's `segments-in-flight`, off in the tables and the tuner)."""
    return dataclasses.replace(cfg, segment_stages=segment_stages(cfg))


# What the gathering epilogue's B may take of an SM's L1 (`gather_segments`, `fit`).
GATHER_L1_BYTES = 32 << 10


def gather_segments(cfg: LaunchConfig, num_entries: int, rank: int) -> int:
    """K2's epilogue by each row's slot (EPILORA_GATHER_SEGMENTS, decode tiles of several
    slots): the rank step it sums at once, its products at most 32 values a thread (a
    16 x 64 tile in 4 warps: 4 rank columns a step); 0: the segment loop.

    Each rank step reads a few columns of every row's slice of B (stored rank-fastest), so
    all of the tile's slices are touched once a step: they are read from HBM or L2 once only
    if they stay in L1 through the steps. Gathering everywhere (`1`), with 8 slots of rank 16
    the layer took 0.90-1.01x the loop's time at 4-16 tokens but 1.03-1.18x at 32 (32-row
    tiles), and up to 1.8x at rank 64 (8 KB a row's slice in a 64-wide tile); with 32 slots
    of rank 64 up to 3.7x (an H100; docs/kernels-history.md, item 55). Hence `fit`: 16-row
    tiles only, and only where the tile's distinct slices take at most
    `GATHER_L1_BYTES`. On setups that rule was not read from (32 slots of rank 16 at 4-16
    tokens on three models, Qwen2.5-7B's 8 slots of rank 16, 16 of rank 16) it took
    0.91-1.02x the loop's time, but with 4 slots of rank 32 0.93-1.08x (1.07-1.08x on
    Qwen2.5-7B). Off by default (`_env.gather_segments`)."""
    setting = _env.gather_segments()
    if not (setting in ("1", "fit") and num_entries > 2 and cfg.block_m <= 32):
        return 0
    # at most a slice a row (rows of one slot share theirs), and one a slot: the entries less
    # the one for tokens without an adapter (slots the engine holds, not only those in use)
    slices = min(cfg.block_m, num_entries - 1)
    if setting == "fit" and (cfg.block_m > 16
                             or slices * cfg.block_n * rank * 2 > GATHER_L1_BYTES):
        return 0
    step = 32 * 32 * cfg.num_warps // (cfg.block_m * cfg.block_n)
    return max(1, min(cfg.block_r, 1 << (max(step, 1).bit_length() - 1)))


# EPILORA_EPILOGUE_HALVES=auto (the default): one slot's epilogue in halves from this many
# tokens, and several slots' where the rank is at most HALVES_MAX_RANK and the batch has at
# least HALVES_TOKENS_PER_SLOT tokens for each slot held (few adapter segments meet a tile),
# and HALVES_MIN_TOKENS in all.
HALVES_MIN_TOKENS = 65
HALVES_MAX_RANK = 32
HALVES_TOKENS_PER_SLOT = 32


def epilogue_halves(cfg: LaunchConfig, num_entries: int, fp8: bool, tokens: int = 0,
                    rank: int = 0) -> bool:
    """K2's epilogue in FP8 tiles of 64 rows or more without a round trip through y
    (EPILORA_EPILOGUE_HALVES). There the kernel parks one term in y because the base and a
    whole delta tile in registers at once spilled: with one slot it stores the rounded base,
    adds h B^T into the freed accumulator and reads the base back (gate_up's 128 x 256
    prefill tile spilled 1.5 KB a thread otherwise); with several, where h is whole before the
    K loop, it sums the delta first and parks that (`DELTA_FIRST`: the 8x16 layer at 512-2048
    tokens took 1.15-1.57x as long with the spills), else (split K, or h not yet whole) parks
    the base as with one slot. Either costs two more passes of the tile through L2 and a
    barrier. Here the base stays in registers, rounded to bf16 (half the fp32 tile's
    registers), and the delta is made for one half of the tile's columns at a time (half a
    delta tile): the same bits. One slot's B is then loaded after the K loop (warmed in L2
    before it), never held through it.

    Timed on three models' layers (docs/kernels-history.md, item 53, has the runs): with one slot
    the layer took 0.91-1.02x its time at 64-4096 tokens; several slots gained where few adapter
    segments meet a tile at ranks up to 32 (4x32 0.79-0.92x at 256-2048 tokens) and lost where
    many do or the rank spills (16x16 at 256 tokens, 16 a slot, 1.04-1.09x; 32x64
    1.06-1.49x). Hence `auto`, the default: one slot from HALVES_MIN_TOKENS tokens, and
    several where their rank (`rank`, the slots' largest) is at most HALVES_MAX_RANK and the
    batch has HALVES_TOKENS_PER_SLOT tokens a slot held (the slots an engine holds, not those
    a batch uses: with fewer in use, fewer segments meet a tile) and HALVES_MIN_TOKENS in all.
    At 64 tokens a slot, on setups it was not read from (8x32, 2x16), it took 0.78-0.96x the
    parked epilogue's layer wherever it took the halves; at 32 a slot (4x16 and 4x32 at 128
    tokens, 16x32 at 512) 0.88-0.99x, and 16x16 at 512 0.95-1.05x.
    `1`: one slot at any size; `all`: several slots too, at any size; `0`: never."""
    setting = _env.epilogue_halves()
    if setting == "0" or not (fp8 and cfg.block_m >= 64 and cfg.block_n >= 32
                              and not cfg.swap_ab):
        return False
    if setting == "auto":
        slots = num_entries - 1  # the entries less the one for tokens without an adapter
        if slots <= 1:
            return tokens >= HALVES_MIN_TOKENS
        return (0 < rank <= HALVES_MAX_RANK
                and tokens >= max(HALVES_MIN_TOKENS, HALVES_TOKENS_PER_SLOT * slots))
    return setting == "all" or num_entries <= 2


# EPILORA_EPILOGUE_EARLY's budget: h's and B's tiles held through the K loop, in bytes a
# thread of the block (rank 32 in 128 x 128 tiles of 8 warps and in 64 x 64 of 4; compiled for
# sm_90 Triton holds them in shared memory, staged before the loop).
EARLY_BYTES_PER_THREAD = 64
SM_SHARED_BYTES = 228 * 1024  # an sm_90 SM's, 1 KB of it reserved per block


def epilogue_early(cfg: LaunchConfig, halves: bool, num_entries: int, h_whole: bool,
                   setting: str | None = None) -> bool:
    """Whether K2 loads its epilogue's operands before its K loop (`EPILOGUE_EARLY`): the
    tile's rows of h (bf16, its planes summed) and its two halves of the slot's B, where
    EPILORA_EPILOGUE_EARLY=1, the epilogue runs in halves with one slot (`num_entries` at
    most 2), h is whole before the loop (`h_whole`: no PDL, or the fused path's wait for all
    of K1 first), both tiles fit EARLY_BYTES_PER_THREAD and, staged in shared memory beside
    the K loop's FP8 buffers, leave as many blocks an SM (compiled for sm_90, Triton stages
    them there before the loop: gate_up's 64 x 128 tiles at 128 tokens, rank 16, would fit 2
    blocks where they fit 3; `EPILORA_EPILOGUE_EARLY=1 python dev/sm90_occupancy.py` compiles
    the launchers' tiles so). The launchers take it only with K whole and the weight by TMA
    (sm_90, whose shared memory this counts). `setting`: the variable's value as read by the
    caller (a `LoraProjection`, at construction), else read here.

    Why: in the halves each half loads h and its B after the loop and waits for them (L2's
    latency: they were warmed there), then stages them in shared memory for one MMA, twice,
    with one block an SM over about three waves at 256-512 tokens, where the epilogue added
    19.3 us to Qwen3-8B's four projections at 256 tokens, rank 16 (an H100 at 917d998,
    docs/kernels.md, Prefill); warming them in L2 (6331cd9) gained nothing. Early, B loads
    before the wait for K1 (it does not depend on K1), but h after it: each tile's K loop
    then starts one load of h later (its first TMA loads wait for h's staging). Untimed."""
    if (setting or _env.epilogue_early()) == "0" or not (halves and num_entries <= 2
                                                          and h_whole):
        return False
    operand_bytes = (cfg.block_m + cfg.block_n) * cfg.block_r * 2
    loop_bytes = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k
    blocks = [min(SM_SHARED_BYTES // (loop_bytes + extra + 1024), 2048 // (32 * cfg.num_warps))
              for extra in (0, operand_bytes)]  # (and at most 2048 threads an SM)
    return (operand_bytes <= EARLY_BYTES_PER_THREAD * 32 * cfg.num_warps
            and blocks[0] == blocks[1])


def epilogue_rank_chunk(cfg: LaunchConfig) -> int:
    # Prefill tiles (64 rows or more) whose slice of B is too big to hold in registers add
    # h B^T in 32-wide rank steps, pipelined loops: whole, h and B took K2 past 200 registers
    # at rank 128, and stepping made the rank-128 layer faster at 64-256 tokens. Stepping every
    # tile of 64 rows or more was slower where B fits (rank 64 in 64-wide tiles) and with
    # several slots, where that loop reloaded h for every segment and step; several slots now
    # load each step of h once (docs/kernels.md, "K2's epilogue"). 0: the whole rank.
    return 32 if cfg.block_m >= 64 and not b_fits_registers(cfg) else 0
