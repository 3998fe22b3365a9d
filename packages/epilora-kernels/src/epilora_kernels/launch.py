"""Launch settings: a frozen dataclass per op, chosen by a heuristic or a per-device JSON table.

Tables live in `epilora_kernels/configs/<device>.json` (device name with spaces and dashes as
underscores, as vLLM names its tables): `{op: {"<N>x<K>": {"<tokens>": LaunchConfig fields}}}`,
written by `benchmarks/tune.py` on the device, which tunes at rank 64; entries tuned at another
rank sit under `"<N>x<K>@r<R>"` (R the rank tile, `rank_block`) and are preferred for adapters
of that rank tile; entries that suit only batches of one adapter slot (K2 compiles its epilogue
for one slot apart, K1's row tiles grow with the slots) under `"<N>x<K>@r<R>/one-slot"`, and
those that suit only batches of several under `"<N>x<K>@r<R>/several-slots"` (the tuner's
several-slot runs, and the timed path choices), preferred again for such batches. The entry
for the smallest token bucket >= the batch is used (else the largest). A shape the table lacks
takes the entries of the nearest tuned shape within a factor of two in N and K
(`nearest_shape`). `validate_table` checks a table's schema on any machine. Ops, shapes or
devices a table lacks (beyond that) get the heuristic.
"""

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources

# K1 quantizing (the fused path), K1's shrink alone for the hybrid path and for the decode path
# (tuned apart: K2 overlaps the decode path's shrink, not the others), the decode path's shrink
# on the caller's codes (K2 streams its weights from its start instead of after K1's quantizing
# programs, so K1 meets a busier HBM: tuned apart again, where absent `decode_shrink`'s), and K2.
# `decode_lead_shrink`: the decode path's shrink on the caller's codes as the first programs of
# K2's own launch (EPILORA_DECODE_ONE_LAUNCH), tuned apart again: its programs take whole
# GEMM-sized blocks and start with the GEMM's.
OPS = ("quantize_shrink", "shrink", "decode_shrink", "decode_shrink_codes", "decode_lead_shrink",
       "lora_gemm")
# The tuner's timed choice between the decode and fused paths at a decode bucket, per shape (on
# bf16 x, or on the codes given) and number of adapter slots: entries {"path": "decode" |
# "fused", "slots": N}, not launch settings.
PATH_OPS = ("path", "path_codes")
TIMED_PATHS = ("decode", "fused")
# The one-launch shrink's programs at most (the heuristic's): the decode GEMM's swapped tiles
# take 64-96 of the H200's 132 SMs at one block each, and a shrink program holds a whole block.
LEAD_SHRINK_PROGRAMS = 32
# Beyond this many tokens K1 and K2 take the heuristic's prefill tiles unless a table bucket
# covers the batch: the tuned buckets end at 256, whose tiles stretched to prefill batches were
# up to 1.5x slower than the prefill tiles (select_config).
PREFILL_MIN_TOKENS = 256
# `decode_shrink` buckets cover up to this many tokens (benchmarks/tune.py). Beyond, the decode
# path's K1 takes a `decode_shrink` entry only from a bucket at or above the batch
# (benchmarks/tune_layer.py writes them, few programs that leave room for K2 beside them), else
# (one slot, rank up to DECODE_K1_RULE_MAX_RANK) the heuristic's rule for it, else
# `quantize_shrink`'s, the fused path's: the 32-token ones stretched would launch too many.
DECODE_SHRINK_MAX_TOKENS = 32
# Past those buckets (one slot's 33-64 tokens), without a bucket of its own, the decode path's
# K1 up to this rank takes a rule of its own (`heuristic_config`), not the fused path's
# settings; beyond it the fused path's settings were faster (dev/launch_variants.py,
# `heuristic-decode-k1`, ranks 96 and 128 on an H100 at 2c97882), and where no table entry
# serves them the heuristic's in 4 stages (docs/kernels-history.md, item 64).
DECODE_K1_RULE_MAX_RANK = 64
# One adapter slot's largest batch on the decode path (dispatch.choose_path's, which imports it).
DECODE_MAX_TOKENS_ONE_SLOT = 64
# A batch of at most DECODE_SHRINK_MAX_TOKENS tokens takes a table bucket at or above it only up
# to there, else the heuristic: a larger bucket's tiles are prefill-sized (64-row K2 tiles for
# 17 tokens), and stretching a smaller bucket's to the batch was never measured. The shipped
# table has no 32-token bucket for K2 and the fused and decode paths' K1 (select_config); the
# hybrid path's `shrink` keeps covering 17-32 tokens with its 64-token entry, as before (no
# run compared it with the heuristic there).


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of one kernel launch.

    `swap_ab` (K2 only; K1 ignores it): the GEMM computed as its transpose, W x^T, so that the
    weight tile is the MMA's 64-row side: sm_90 then runs decode tiles of 16 or 32 rows on
    wgmma, the weight streamed by TMA (as CUTLASS's swap-AB decode GEMM), where they are
    otherwise mma.sync's. It needs `block_n` >= 16 * `num_warps` (64 rows a warpgroup) and
    gives the same results up to the order of the fp32 sums. Off in the shipped tables; the
    heuristic takes it on sm_90 at 17-32 tokens and at 2-16 where the plain tiles leave SMs
    idle, the tuner tries it at decode sizes (EPILORA_TUNE_SWAP_AB=0: not).

    `slices_together` (K1 only; K2 ignores it): each shrink program computes its rank tile of
    every output slice (qkv's three, gate_up's two) from one read of its x tile, one
    accumulator a slice, where otherwise each slice's programs read x again. Each slice's sums
    in the same tiles and K order as apart (bit for bit on integer-valued operands under the
    interpreter). Off in the shipped tables; the heuristic's at prefill sizes where that grid
    still fills the SMs (`prefill_slices_together`).

    `segment_stages` (K2 only; one adapter slot ignores it): the stages of K2's epilogue loop
    over the adapter segments that meet its tile (several slots; a decode tile meets one
    segment a token when each token has its own adapter). 1: the loop reads each segment's
    slot and bounds from memory, and B's address waits on them, so it waits for each
    segment's slice of B in turn; 2 or more: the slots and bounds come from vectors loaded
    before the loop, so that many minus one slices of B are in flight at once. The same sums
    in the same order either way (the same bits). 1 in the shipped tables and the heuristic:
    0.98-1.01x the layer's time at 8x16 on an H100 (docs/kernels.md); the tuner no longer
    offers more (`_tiling.segment_stages` gives the depth, dev A/Bs)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    block_r: int = 16
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    slices_together: bool = False
    segment_stages: int = 1

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"LaunchConfig.{field.name} must be a bool, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LaunchConfig.{field.name} must be a positive int, got {value!r}")
        for name in ("block_m", "block_n", "block_k", "block_r"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two >= 16, got {value}")
        if self.swap_ab and (self.num_warps % 4 or self.block_n < 16 * self.num_warps):
            raise ValueError(f"LaunchConfig.swap_ab needs num_warps a multiple of 4 and block_n "
                             f">= 16 * num_warps (64 weight rows a warpgroup), got block_n="
                             f"{self.block_n}, num_warps={self.num_warps}")


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def rank_block(rank: int) -> int:
    """The rank tile that holds a whole adapter: the next power of two >= rank, at least 16."""
    return max(16, _next_pow2(rank))


def heuristic_config(
    op: str, tokens: int, n: int, k: int, rank: int, slices: tuple[int, ...] = (),
    large_tiles: bool = True, several_slots: bool = False,
) -> LaunchConfig:
    """Settings that are correct for any shape and reasonable for decode and prefill.

    `slices`: the output slice widths; a GEMM tile must not straddle two slices, so block_n is
    the largest power of two (16..256) dividing every slice boundary. `large_tiles`: the
    device's blocks may take sm_90's 227 KB of shared memory (K2's prefill tiles need ~150 KB;
    sm_89 has 99 KB). `several_slots`: the batch's slot table has several slots
    (`_tiling.one_slot` false: an engine's `max_loras` above one, whatever slots its tokens
    use), so K2 runs its several-slot epilogue (its decode tiles, below).
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    if op == "decode_shrink_codes":
        op = "decode_shrink"
    block_m = 16 if tokens <= 16 else (32 if tokens <= 32 else 64)
    block_r = rank_block(rank)
    if op == "decode_lead_shrink":
        # Each program one or two 256-deep K steps (at 32 tokens 128: its x tile's registers):
        # beside the GEMM's weight stream every dependent load waits a loaded HBM's latency
        # (the two-launch K1's 4-step programs ended near the GEMM's end). K split in
        # parts of whole K steps, none empty, the programs at most LEAD_SHRINK_PROGRAMS at
        # one adapter's tiles.
        block_k = 256 if tokens <= 16 else 128
        block_r = min(block_r, 64)
        tiles = -(-tokens // block_m) * -(-rank // block_r) * max(1, len(slices))
        split_k = whole_steps_split(k, block_k, min(LEAD_SHRINK_PROGRAMS // tiles, k // block_k))
        return LaunchConfig(block_m=block_m, block_n=64, block_k=block_k, block_r=block_r,
                            split_k=split_k, num_warps=4, num_stages=2)
    if op in ("quantize_shrink", "shrink", "decode_shrink"):
        # K1's K loop is latency-bound (one dependent load per BLOCK_K step: unsplit, the down
        # projection's shrink took over 100 us at 64 tokens), so K is split and the last split
        # sums the planes. Up to 32 tokens split 16, each at least 256 deep (best or within
        # noise on every Qwen3-8B shape, benchmarks/results/h200/tune.json). Beyond, with one
        # adapter, 16-row by 32-rank tiles split 8 were fastest or within 3% at 64-256 tokens on
        # every shape (tune_k1_64_256.json; 64-row unsplit tiles, the previous rule, 2-4x slower).
        if tokens <= 32 and op == "decode_shrink":
            # The decode path's K1 runs beside K2 and has to end before K2's epilogue; there
            # each dependent K step waits a loaded HBM's latency, so each program takes two K
            # steps (K split in up to 16 parts of whole steps), in rank tiles of at most 64.
            # The table's tuned entries on Qwen3-8B's shapes split K 8 or 16 ways in 12 of 16
            # (rank 64, 1-16 tokens; configs/NVIDIA_H200.json), where this rule said 4 before.
            block_k = 256 if tokens <= 16 else 128
            return LaunchConfig(block_m=block_m, block_n=64, block_k=block_k,
                                block_r=min(block_r, 64),
                                split_k=whole_steps_split(k, block_k, min(16, k // (2 * block_k))),
                                num_warps=4, num_stages=2)
        if op == "decode_shrink" and decode_k1_rule(tokens, rank, several_slots):
            # One slot's 33-64 tokens on the decode path: 16-row tiles 256 deep, K split in at
            # most 16 parts of whole steps, about two steps each where the program bound allows
            # (2-5 on the three models' shapes), at most 64 programs, room for K2 beside them
            # (the fused path's 16 x 32 x 128 tiles split 8 launch 64-192). Read from the
            # tuner's picks at 64 tokens (an H100 at 917d998, benchmarks/results/h100/
            # tune_decode.json: 256 deep at ranks 16 and 64, 16-64 programs); checked at 40, 48
            # and 56 tokens and rank 32, which no pick saw: the layer 0.92-0.97x the heuristic's
            # time before on the three models, ranks 16-64, two runs (dev/launch_variants.py at
            # 2c97882, heuristic-decode-k1; docs/kernels.md, "The tuner").
            tiles = -(-tokens // 16) * max(1, len(slices))  # the rank in one tile
            split_k = whole_steps_split(k, 256, max(1, min(16, k // 512, 64 // tiles)))
            return LaunchConfig(block_m=16, block_n=64, block_k=256, block_r=block_r,
                                split_k=split_k, num_warps=4, num_stages=2)
        if tokens <= 32:
            return LaunchConfig(block_m=block_m, block_n=64, block_k=256 if tokens <= 16 else 128,
                                block_r=block_r, split_k=max(1, min(16, k // 256)),
                                num_warps=4, num_stages=2)
        middle = LaunchConfig(block_m=16, block_n=64, block_k=128, block_r=min(block_r, 32),
                              split_k=max(1, min(8, k // 512)), num_warps=4, num_stages=2)
        if (op == "decode_shrink" and not several_slots
                and tokens <= DECODE_MAX_TOKENS_ONE_SLOT):
            # One slot past decode_k1_rule's ranks: the fused path's tiles (`middle`) in 4
            # stages. Beside K2 each K step waits a loaded HBM's latency, and all sixteen tuned
            # entries at rank 128 and 64 tokens (the H100's tune_decode.json picks at e968ccc
            # and configs/NVIDIA_H200.json) have 3-4. Checked at 48 tokens and rank 96, which
            # no pick saw: the layer 0.85-0.92x the 2-stage rule's time on the three models,
            # ranks 96 and 128, 48 and 64 tokens, two runs on an H100 (dev/launch_variants.py,
            # heuristic-k1-stages, at dbbd581; docs/kernels-history.md, item 64).
            return dataclasses.replace(middle, num_stages=4)
        if tokens > PREFILL_MIN_TOKENS:
            # Prefill: every row tile reads its adapter's A again, so 64-row tiles read a
            # quarter of the 16-row tiles' A. 64 x 32 tiles split 4 in 3 stages: K1 on
            # Qwen3-8B's four shapes (rank 64) 172 -> 141 us at 2048 tokens and 313 -> 258 at
            # 4096, the fastest of eight tilings there and within 4 us of the fastest at 512
            # (dev/large_m_probe.py at 5c4e33e; docs/kernels.md, "Prefill").
            cfg = LaunchConfig(block_m=64, block_n=64, block_k=128, block_r=min(block_r, 32),
                               split_k=max(1, min(4, k // 512)), num_warps=4, num_stages=3)
            return prefill_slices_together(cfg, tokens, rank, slices)
        return middle
    if tokens > PREFILL_MIN_TOKENS and large_tiles:
        # Prefill: K2 is compute-bound. Without adapters, 128 x 256 x 128 tiles in 8 warps and
        # 3 stages came within 4% of vLLM's CUTLASS at 2048 and 4096 tokens on Qwen3-8B's four
        # projections, where the 256-token entries (64-row tiles) stretched took 1.5x; at 512
        # tokens 128 x 128 x 128 tiles in 4 stages were faster (dev/large_m_probe.py at
        # f4e3310; docs/kernels.md, "Prefill"). Either holds one block per SM: the wider tile
        # unless the narrower fills the SMs' waves clearly better (a 512 x 4096 output is 64
        # wide tiles, under half of one wave).
        wide = fit_slices(256, slices)
        cfg = LaunchConfig(block_m=128, block_n=wide, block_k=128, block_r=block_r,
                           num_warps=8, num_stages=3)
        narrow = dataclasses.replace(cfg, block_n=min(wide, 128), num_stages=4)
        waves = {c: wave_efficiency(-(-tokens // 128) * -(-n // c.block_n), 1, H200_SMS)
                 for c in (cfg, narrow)}
        return narrow if waves[narrow] > waves[cfg] + 0.1 else cfg
    if tokens > PREFILL_MIN_TOKENS:  # without sm_90's shared memory (sm_89: 99 KB)
        return LaunchConfig(block_m=64, block_n=fit_slices(64, slices), block_k=128,
                            block_r=block_r, num_warps=4, num_stages=4)
    if tokens > 32:
        return _mid_gemm_config(tokens, n, k, block_r, slices, large_tiles)
    # Decode is bandwidth-bound: narrow N tiles give every SM weights to stream (N=4096 in
    # 128-wide tiles is 32 programs for 132 SMs; in 32-wide tiles, 128). The rules below are
    # what the H200 table's tuned decode entries on Qwen3-8B's four shapes had in common
    # (configs/NVIDIA_H200.json, lora_gemm at 1-32 tokens; its 32-token ones retired since,
    # _meta.runs): 256-deep K tiles; 64-wide N tiles
    # where they still give two programs per SM (gate_up), in 3 stages, else 32-wide in 5; and
    # the K loop split in two where K is at least twice N (down), so its few columns still
    # spread over every SM.
    block_n, stages = (64, 3) if n // 64 >= 2 * H200_SMS else (32, 5)
    cfg = LaunchConfig(block_m=block_m, block_n=fit_slices(block_n, slices), block_k=256,
                       block_r=block_r, split_k=2 if k >= 2 * n else 1, num_warps=4,
                       num_stages=stages)
    if large_tiles and (block_m == 32 or (tokens > 1 and cfg.split_k == 1
                                          and -(-n // cfg.block_n) < H200_SMS)
                        or (several_slots and tokens > 1 and -(-n // 64) >= SWAP_MIN_PROGRAMS)):
        # (sm_90, or the interpreter, which runs any tile.) 32-row tiles run on mma.sync
        # unless swapped (LaunchConfig.swap_ab: wgmma, the weight by TMA). The engine-start
        # tuner chose swapped tiles in 17 of 20 buckets on Qwen3-8B's shapes, and this one
        # swapped tile (64 weight rows, 256 deep, K whole, the one-wave pipeline) took 0.95x
        # the shipped table's layer at 32 tokens, 0.98x at 16 and 1.05x at 1 and 4 (docs/
        # kernels-history.md, item 61): hence from 17 tokens. At 2-16 tokens it is taken where
        # the plain tiles leave SMs without a program: the tuner's entries for the 4096 x 4096
        # projection (o: 128 plain 32-wide tiles) took it at 4, 8 and 16 tokens at ranks 16,
        # 64 and 128 (its cache on the H200 at ba2f1be; the decode path 1.07-1.18x faster
        # than before tuning there, tune_decode.json), and kept plain tiles where those give
        # every SM one (qkv's 192, down's 256 split in two, gate_up's); at one token it kept
        # plain tiles at ranks 16 and 64. Not where the plain tiles split K (K >= 2N): there
        # the swapped tile, unsplit, would be a quarter of their programs, and no tuned entry
        # says what serves those shapes (a small model's down, 1536 x 8960: 24 programs).
        # With several slots, swapped at 2-16 tokens wherever the swapped grid has
        # SWAP_MIN_PROGRAMS programs, split or not: a tile's epilogue walks every slot's
        # segment meeting it, and the 64-wide swapped tiles are half the plain 32-wide ones.
        # Read from the tuner's 8x16 picks (swapped at 8 and 16 tokens on gate_up and down,
        # an H100 at c6b1cf3): there the layer took 0.88-0.98x the plain tiles' time at 4-16
        # tokens; on 4x32, 16x16 and 32x64, which no pick saw, 0.92-1.01x on the three
        # models, but for Qwen3-8B at 4x32 (1.01-1.02x), two runs on an H100
        # (dev/launch_variants.py's `heuristic-swapped-small` at bd4c10b, then bd4c10b against
        # e968ccc; docs/kernels.md, Next steps 3).
        tile = swap_candidate(cfg, n, k, slices, tokens)
        grid = -(-tokens // tile.block_m) * -(-n // tile.block_n)
        if several_slots and tile.swap_ab and grid > H200_SMS:
            # Several slots on a grid larger than the SMs (gate_up): 128-deep K steps. 41 of
            # the tuner's 43 swapped picks on gate_up's shapes are 128 deep (an H100's
            # tune_decode.json at e968ccc); the layer took 0.94-0.98x the 256-deep tile's time
            # on 8x16 at 8-32 tokens (two runs) and 0.93-0.99x on 16x16 and 32x64, which no
            # pick saw, on the three models (an H100 at dbbd581, dev/launch_variants.py,
            # heuristic-swap-k128; docs/kernels-history.md, item 64). With one slot at 24 and
            # 32 tokens it took 0.97-1.04x (Llama-3.1-8B's gate_up at ranks 64 and 128 slower):
            # one slot keeps the 256-deep tile.
            return swap_candidate(cfg, n, k, slices, tokens, block_k=128)
        return tile
    return cfg


def decode_k1_rule(tokens: int, rank: int, several_slots: bool) -> bool:
    """Whether the decode path's K1 past its buckets (DECODE_SHRINK_MAX_TOKENS) takes the
    heuristic's rule of its own: one slot, up to DECODE_MAX_TOKENS_ONE_SLOT tokens and rank
    DECODE_K1_RULE_MAX_RANK; else the fused path's settings (`quantize_shrink`'s; the
    heuristic's in 4 stages with one slot, `heuristic_config`)."""
    return (not several_slots and rank_block(rank) <= DECODE_K1_RULE_MAX_RANK
            and DECODE_SHRINK_MAX_TOKENS < tokens <= DECODE_MAX_TOKENS_ONE_SLOT)


def prefill_slices_together(cfg: LaunchConfig, tokens: int, rank: int,
                            slices: tuple[int, ...]) -> LaunchConfig:
    """K1's prefill tile `cfg` with every slice in one program (`slices_together`) where there
    are several and the grid still gives every SM a program; then in 64-deep K steps of 4
    stages (80 KB of shared memory with three slices' A, two blocks an SM, where 128-deep
    steps of 3 stages take 120 KB, one block).

    The shrink reads x once per slice and rank tile, mostly from L2, which likely bounds it
    at 2048 tokens (a hypothesis, docs/kernels.md, "Prefill"): together, qkv's x is read a
    third as often and gate_up's half. On an H100 at 2048 tokens, Qwen3-8B's shapes at rank 64, K1
    took 0.87x the plain 64 x 32 tiles' time on qkv and on gate_up in these steps, and 1.26x
    on qkv in 128-deep steps of 3 stages (`dev/large_m_probe.py --tokens 2048`, one run at
    1dcd623, file not kept). Fewer programs than SMs (rank 64 below ~1100 tokens) keep the
    plain tiles: the slices' programs are then what fills the GPU."""
    programs = -(-tokens // cfg.block_m) * -(-rank // cfg.block_r) * cfg.split_k
    if len(slices) < 2 or programs < H200_SMS:
        return cfg
    return dataclasses.replace(cfg, block_k=64, num_stages=4, slices_together=True)


# From this many tokens K2 takes 128 x 128 tiles in 8 warps (wgmma at its widest) where they
# fill the SMs: the tuned gate_up entry at 256 tokens (Qwen3-8B's, the only shape of four whose
# 128-wide tiles make a program an SM), while at 128 tokens the tuner kept 64-row tiles.
MID_LARGE_TILE_TOKENS = 129


def _mid_gemm_config(tokens: int, n: int, k: int, block_r: int, slices: tuple[int, ...],
                     large_tiles: bool) -> LaunchConfig:
    """K2 between the decode tiles and prefill's (33-256 tokens). Still mostly a weight stream
    at 64 tokens, compute at 256: 64-row tiles whose grid fills every SM at least once (64-wide
    N tiles where that gives a program an SM, else 32-wide, and the K loop split in two where
    K is at least twice N and the grid is still short of the SMs), 256 deep in the deepest
    pipeline of 3-4 stages in which the whole grid runs at once, else 128 deep in 4; from
    MID_LARGE_TILE_TOKENS, 128 x 128 tiles in 8 warps where they fill the SMs. Of the H200
    table's 12 tuned entries at 64, 128 and 256 tokens on Qwen3-8B's shapes, 9 are what this
    gives; the other 3 take wider N tiles (the rule it replaced gave 64 x 64 x 128 in 4 stages
    everywhere and matched 2, and took 1.6-4.5x the table's added time at 64 tokens on the
    three models' layers: layer_models.json of b10d3da). On an H100 the layer with these
    tiles took 0.99-1.01x the table's time at 64 and 256 tokens on all three models, the old
    rule's 1.10-1.14x (docs/kernels-history.md, item 54)."""
    if tokens >= MID_LARGE_TILE_TOKENS and large_tiles:
        wide = LaunchConfig(block_m=128, block_n=fit_slices(128, slices), block_k=128,
                            block_r=block_r, num_warps=8, num_stages=4)
        if -(-tokens // 128) * -(-n // wide.block_n) >= H200_SMS:
            return wide
    row_tiles = -(-tokens // 64)
    block_n = fit_slices(64 if row_tiles * (n // 64) >= H200_SMS else 32, slices)
    programs = row_tiles * -(-n // block_n)
    split_k = 2 if k >= 2 * n and programs < H200_SMS and k // 2 >= 256 else 1
    per_sm = -(-programs * split_k // H200_SMS)
    stages = min(4, SHARED_BYTES // (per_sm * (64 + block_n) * 256))
    if stages >= 3 and large_tiles:
        return LaunchConfig(block_m=64, block_n=block_n, block_k=256, block_r=block_r,
                            split_k=split_k, num_warps=4, num_stages=stages)
    return LaunchConfig(block_m=64, block_n=block_n, block_k=128, block_r=block_r,
                        split_k=split_k, num_warps=4, num_stages=4)


def whole_steps_split(k: int, block_k: int, split_k: int) -> int:
    """`split_k` (at least 1) made to cut K into parts of whole `block_k` steps, none empty:
    each part ceil(K / split_k) rounded up to whole steps, then as many parts as K needs."""
    depth = -(-k // max(1, split_k))
    depth = -(-depth // block_k) * block_k
    return -(-k // depth)


H200_SMS = 132  # the heuristic's programs-per-SM rules (H100 SXM has 132 too)
# Several slots take swapped decode tiles only where those (64 weight rows, K whole) are this
# many programs: the swapped down projections timed had 56 and 64 (3584 and 4096 wide); a
# small model's down (1536 wide: 24) keeps its plain tiles, whose split spreads it wider.
SWAP_MIN_PROGRAMS = H200_SMS // 3
SHARED_BYTES = 227 * 1024  # an sm_90 block's shared memory at most: larger pipelines never run


def wave_efficiency(programs: int, blocks_per_sm: int, sms: int) -> float:
    """The fraction of the waves' room a grid fills: 1 when it fits in one wave on every SM's
    share (at least one program an SM, at most what the SMs hold at once), else its programs
    over the room of the waves it needs (a last wave of few programs idles most SMs)."""
    if blocks_per_sm < 1 or programs < 1:
        return 0.0
    room = blocks_per_sm * sms
    if programs <= room:
        return min(1.0, programs / sms)
    return programs / (math.ceil(programs / room) * room)


def fit_slices(block_n: int, slices: tuple[int, ...]) -> int:
    """The largest power of two <= block_n (at least 16) dividing every slice boundary: a K2
    tile must not straddle two slices."""
    while block_n > 16 and any(width % block_n for width in slices[:-1]):
        block_n //= 2
    return block_n


SWAP_MAX_STAGES = 8
SWAP_MIN_STAGES = 3


def swap_candidates(cfg: LaunchConfig, n: int, k: int, slices: tuple[int, ...],
                    tokens: int | None = None, sms: int = H200_SMS) -> list:
    """Swapped decode tiles (`LaunchConfig.swap_ab`) around `cfg` where its tiles have 32 rows
    or fewer: 64 or 128 weight rows, K tiles of 128 or 256, the K loop whole or split in two.
    A streamed GEMM's speed is its bytes in flight, so each takes the deepest pipeline (at
    most 8 stages, a stage's worth of shared memory left to the epilogue) that lets every
    program of the grid run at once on `sms` SMs, and, where that differs, the deepest at one
    program an SM (CUTLASS's decode GEMM runs its 64 x 256 tiles so, in several waves)."""
    if cfg.block_m > 32 or cfg.num_warps % 4:  # a warpgroup's 64 rows: whole warpgroups
        return []
    row_tiles = 1 if tokens is None else -(-tokens // cfg.block_m)
    out = []
    for block_n in (64, 128):
        if fit_slices(block_n, slices) != block_n or block_n < 16 * cfg.num_warps:
            continue
        for block_k in (128, 256):
            for split_k in (1, 2):
                if k // split_k < block_k:
                    continue
                programs = row_tiles * -(-n // block_n) * split_k
                stage_bytes = (block_n + cfg.block_m) * block_k  # FP8 weight and codes
                for per_sm in (-(-programs // sms), 1):
                    stages = min(SWAP_MAX_STAGES, SHARED_BYTES // (per_sm * stage_bytes) - 1)
                    if stages >= SWAP_MIN_STAGES:
                        out.append(dataclasses.replace(cfg, block_n=block_n, block_k=block_k,
                                                       split_k=split_k, num_stages=stages,
                                                       swap_ab=True))
    return list(dict.fromkeys(out))


def swap_candidate(cfg: LaunchConfig, n: int, k: int, slices: tuple[int, ...], tokens: int,
                   split_k: int = 1, block_k: int | None = None) -> LaunchConfig:
    """One swapped tile of `swap_candidates` (the heuristic's at decode sizes, and the A/B
    tools' pick, dev/launch_variants.py and dev/decode_timeline.py): 64 weight rows, K tiles
    `block_k` deep (default the deepest), the K loop split `split_k` ways, the one-wave
    pipeline where there is one; `cfg` itself where none fits."""
    for cand in sorted(swap_candidates(cfg, n, k, slices, tokens), key=lambda c: -c.block_k):
        if (cand.block_n, cand.split_k) == (64, split_k) and block_k in (None, cand.block_k):
            return cand
    return cfg


def table_name(device_name: str) -> str:
    return device_name.replace(" ", "_").replace("-", "_") + ".json"


# The suffixes of rank keys whose entries serve batches of one adapter slot only, or of several
# only: K2's one-slot epilogue (ENTRIES_BLOCK <= 2) is another kernel than the several-slot one,
# and settings tuned on either can slow the other (rank-64 K2 entries tuned with one slot at 16
# tokens made the 32-adapter layer 10-14 us slower on the H200 at 93f78f7; on an H100 at c6b1cf3
# 32 slots of rank 64 at 16 tokens on the table's entries, tuned with one adapter (or 4 slots in
# benchmarks/tune.py's earlier sweeps), added +70 to
# +73% where the heuristic added +56 to +57%).
ONE_SLOT = "/one-slot"
SEVERAL_SLOTS = "/several-slots"


def slots_suffix(one_slot: bool) -> str:
    """The key suffix of entries for batches of one slot (True) or of several (False)."""
    return ONE_SLOT if one_slot else SEVERAL_SLOTS


def shape_key(n: int, k: int, rank: int | None = None, one_slot: bool | None = None) -> str:
    """`"NxK"`, or `"NxK@rR"` (R = rank_block(rank)) for entries tuned at that rank; with
    `one_slot` True or False, `ONE_SLOT` or `SEVERAL_SLOTS` appended for entries that serve
    only batches of one slot or only batches of several."""
    if rank is None:
        if one_slot is not None:
            raise ValueError("one-slot and several-slot entries sit under a rank key")
        return f"{n}x{k}"
    return f"{n}x{k}@r{rank_block(rank)}" + ("" if one_slot is None else slots_suffix(one_slot))


def validate_table(table: dict) -> None:
    """Raise unless `table` is {op: {"NxK": {tokens: LaunchConfig fields}}} with known ops."""
    if not isinstance(table, dict):
        raise ValueError("a launch table must be a JSON object")
    for op, shapes in table.items():
        if op == "_meta":
            continue
        if op not in OPS + PATH_OPS:
            raise ValueError(f"unknown op {op!r} in launch table; expected one of "
                             f"{OPS + PATH_OPS}")
        for shape, entries in shapes.items():
            dims, at, rank = shape.partition("@r")
            n, _, k = dims.partition("x")
            rank, slash, slots = rank.partition("/")
            if (not (n.isdigit() and k.isdigit()) or (at and not rank.isdigit())
                    or slash + slots not in ("", ONE_SLOT, SEVERAL_SLOTS)):
                raise ValueError(f"{op}: shape key {shape!r} must look like '6144x4096', "
                                 f"'6144x4096@r128', '6144x4096@r128{ONE_SLOT}' or "
                                 f"'6144x4096@r128{SEVERAL_SLOTS}'")
            for bucket, fields in entries.items():
                if not bucket.isdigit():
                    raise ValueError(f"{op} {shape}: bucket {bucket!r} must be a token count")
                if not isinstance(fields, dict):
                    raise ValueError(f"{op} {shape} {bucket}: {fields!r} must be an object")
                if op in PATH_OPS:
                    if (set(fields) != {"path", "slots"} or fields["path"] not in TIMED_PATHS
                            or not isinstance(fields["slots"], int) or fields["slots"] < 2):
                        raise ValueError(f"{op} {shape} {bucket}: {fields!r} must be "
                                         f"{{'path': one of {TIMED_PATHS}, 'slots': 2 or more}}")
                    continue
                LaunchConfig(**fields)  # raises on unknown or bad fields


def write_table(table: dict, path) -> None:
    """Check `table` (`validate_table`) and write it where a tool was told to (the tuners,
    benchmarks/tune_layer.py), in the layout of the shipped tables."""
    validate_table(table)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)


# The table a device without one of its own uses, by architecture: every sm_90 part (H100 SXM
# and PCIe, H200, H200 NVL, GH200) starts from the H200's tiles (shared memory per SM, what the
# tiles are bound by, is the same; bandwidths differ, and the H100 PCIe has 114 SMs, not 132):
# a starting point the tuner replaces with the device's own measurements.
ARCH_TABLES = {"sm90": "NVIDIA H200"}


@functools.cache
def table_device(device_name: str, arch: str | None = None) -> str | None:
    """The device whose shipped table serves `device_name`: its own, else its architecture's
    (`ARCH_TABLES`), else None (the heuristic). Asked on every launch: the package's files are
    looked up once a process."""
    for name in (device_name, ARCH_TABLES.get(arch or "")):
        if name and resources.files("epilora_kernels").joinpath(
                "configs", table_name(name)).is_file():
            return name
    return None


@functools.cache
def _load_table(device_name: str, cache_device: str | None = None) -> dict | None:
    # Read and checked once per process: the launchers ask on every call. The tuner's cache
    # of the device that runs (`cache_device`, default `device_name`: an H100 without a table
    # of its own reads the H200's, and its own cache) overlays it shape by shape.
    path = resources.files("epilora_kernels").joinpath("configs", table_name(device_name))
    table = None
    if path.is_file():
        table = json.loads(path.read_text())
        validate_table(table)
    from epilora_kernels import tuner  # the cache's file name needs the versions

    cached = tuner.read_cache(cache_device or device_name)
    if cached is None:
        return table
    merged = {op: dict(shapes) for op, shapes in (table or {}).items() if op != "_meta"}
    for op, shape in stale_path_choices(merged, cached):
        del merged[op][shape]
    for op, shapes in cached.items():
        if op != "_meta":
            merged.setdefault(op, {}).update(shapes)
    return merged


def stale_path_choices(table: dict, cache: dict) -> list[tuple[str, str]]:
    """(op, shape key) of `table`'s path choices that `cache` voids when laid over it: a choice
    was timed beside its table's GEMM settings, and the cache brings the shape's own GEMM
    settings without a choice of that op."""
    return [(op, shape) for shape in cache.get("lora_gemm", {}) for op in PATH_OPS
            if shape in table.get(op, {}) and shape not in cache.get(op, {})]


def settings_identity(device_name: str) -> str:
    """A digest of what decides, besides a call's own shapes, the launch settings the launchers
    use on `device_name`: whether they read tables at all, the shipped tables and the tuner's
    cache for the device, and the settings that change which kernels the launchers run
    (EPILORA_DECODE_AFTER_PREVIOUS, EPILORA_DECODE_ONE_LAUNCH, EPILORA_GATHER_SEGMENTS,
    EPILORA_EPILOGUE_HALVES, EPILORA_EPILOGUE_EARLY, EPILORA_DELTA_KERNEL). Work that depends
    on those settings (an engine's kernels compiled ahead) stays valid while this is
    unchanged."""
    from epilora_kernels import _env, tuner

    digest = hashlib.sha256(b"tables" if _env.launch_tables() else b"heuristic")
    digest.update(b"after-previous %d one-launch %d" % (_env.decode_after_previous(),
                                                        _env.decode_one_launch()))
    digest.update(b"gather %s halves %s early %s delta-kernel %s" % (
        _env.gather_segments().encode(), _env.epilogue_halves().encode(),
        _env.epilogue_early().encode(), _env.delta_kernel().encode()))
    shipped = resources.files("epilora_kernels").joinpath("configs")
    for path in [*sorted(shipped.iterdir(), key=lambda p: p.name), tuner.cache_path(device_name)]:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def clear_table_cache() -> None:
    """Forget the tables read so far (after the tuner wrote its cache), and the launch
    settings derived from them."""
    from epilora_kernels import fused, projection

    _load_table.cache_clear()
    table_device.cache_clear()
    tuned_path.cache_clear()
    fused._PLANS.clear()
    projection.clear()


def table_config(device_name: str, op: str, tokens: int, n: int, k: int,
                 rank: int | None = None, cover: bool = False,
                 one_slot: bool | None = False, cache_device: str | None = None,
                 max_bucket: int | None = None) -> LaunchConfig | None:
    """The tuned entry for (op, N x K) at the smallest bucket >= tokens (else the largest, or
    with `cover` none; buckets above `max_bucket` not at all); given a rank, its rank tile's
    entries replace the others' at the buckets they tuned (a rank tuned at 64-256 tokens leaves
    the decode buckets to the rank-64 entries), and its one-slot entries (`one_slot`: a batch
    of one adapter slot) or several-slot entries (otherwise) replace those in turn."""
    table = _load_table(device_name, cache_device)
    return None if table is None else table_entry(table, op, tokens, n, k, rank, cover, one_slot,
                                                  max_bucket)


def tuned_exactly(device_name: str, op: str, n: int, k: int, rank: int | None = None,
                  one_slot: bool = False, cache_device: str | None = None,
                  tokens: int | None = None, slots_key_only: bool = False) -> bool:
    """Whether the table (with the tuner's cache over it) has entries of `op` for N x K itself,
    plain or at the rank's keys `table_config` would read (`slots_key_only`: at its one-slot
    or several-slot key only), rather than lending a nearer shape's; given `tokens`, an entry
    `select_config` takes for that batch (not the heuristic's settings where the shape's
    buckets do not cover it)."""
    table = _load_table(device_name, cache_device)
    if table is None:
        return False
    suffixes = _key_suffixes(rank, one_slot)
    keys = [f"{n}x{k}{suffix}" for suffix in (suffixes[-1:] if slots_key_only else suffixes)]
    if tokens is None:
        return any(table.get(op, {}).get(key) for key in keys)
    own = {key: table[op][key] for key in keys if table.get(op, {}).get(key)}
    cover, max_bucket = _lookup_limits(op, tokens)
    entry = table_entry({op: own}, op, tokens, n, k, rank, cover, one_slot, max_bucket)
    # (a nearer shape's bucket covering the batch goes before the shape's own largest one)
    return entry is not None and entry == table_entry(table, op, tokens, n, k, rank, cover,
                                                      one_slot, max_bucket)


@functools.lru_cache(maxsize=4096)  # asked on every dispatched call, by value
def tuned_path(device_name: str, tokens: int, n: int, k: int, rank: int, slots: int,
               codes: bool = False, cache_device: str | None = None) -> str | None:
    """The path the tuner timed fastest for N x K itself (no nearer shape's: a choice between
    paths is the shape's own measurement) with adapters of `rank` over `slots` slots (a
    choice timed with other slots does not count), at the smallest of its decode buckets
    covering `tokens` (up to DECODE_SHRINK_MAX_TOKENS); `codes`: the choice timed on the
    codes given. None where it timed none."""
    table = _load_table(device_name, cache_device)
    entries = (table or {}).get(path_op(codes), {}).get(shape_key(n, k, rank, one_slot=False),
                                                         {})
    bucket = _covering_bucket(entries, tokens, DECODE_SHRINK_MAX_TOKENS)
    if bucket is None or entries[str(bucket)]["slots"] != slots:
        return None
    return entries[str(bucket)]["path"]


def _covering_bucket(entries: dict, tokens: int, max_bucket: int | None) -> int | None:
    # The smallest of the entries' buckets (token counts, as text) at or above `tokens` and at
    # most `max_bucket` (None: no bound), or None.
    return min((int(b) for b in entries
                if tokens <= int(b) and (max_bucket is None or int(b) <= max_bucket)),
               default=None)


def path_op(codes: bool) -> str:
    """The launch-table op of the tuner's path choices, on bf16 x or on the codes given."""
    return "path_codes" if codes else "path"


def _lookup_limits(op: str, tokens: int) -> tuple[bool, int | None]:
    # `select_config`'s table lookup for a batch of `tokens`: (cover, max_bucket). Up to
    # DECODE_SHRINK_MAX_TOKENS (but `shrink`, the hybrid path's K1) a bucket up to there
    # covering the batch, else none; beyond PREFILL_MIN_TOKENS a bucket covering it, else none;
    # between, a bucket covering it, else the largest.
    decode = tokens <= DECODE_SHRINK_MAX_TOKENS and op != "shrink"
    return (decode or tokens > PREFILL_MIN_TOKENS,
            DECODE_SHRINK_MAX_TOKENS if decode else None)


def _key_suffixes(rank: int | None, one_slot: bool | None) -> list[str]:
    # The shape-key suffixes a lookup at `rank` (one slot, several, or None: no adapters'
    # slots asked, as K2 without adapters) reads, each replacing the one before at the buckets
    # it has: plain, the rank tile's, its one-slot or several-slot entries.
    if rank is None:
        return [""]
    rank_key = f"@r{rank_block(rank)}"
    return ["", rank_key] + ([] if one_slot is None else [rank_key + slots_suffix(one_slot)])


# How far a tuned shape may be from an untuned one and still lend it its entries: within this
# factor in N and in K (Llama-3.1-8B's gate_up 28672 x 4096 takes Qwen3-8B's 24576 x 4096;
# Qwen2.5-7B's 4608 x 3584 qkv the 4096 x 4096 o's).
NEAREST_SHAPE_FACTOR = 2.0


def nearest_shape(shapes: dict, n: int, k: int, suffixes: tuple[str, ...] | None = None,
                  ) -> tuple[int, int] | None:
    """The tuned (N, K) of `shapes` (an op's part of a table) closest to (n, k) in log N + log K
    and within NEAREST_SHAPE_FACTOR in each, or None: where the table has n x k itself, that.
    With `suffixes` (e.g. ("", "@r64")), only shapes with a key of one of them count."""
    near = nearest_shapes(shapes, n, k, suffixes)
    return near[0] if near else None


def nearest_shapes(shapes: dict, n: int, k: int,
                   suffixes: tuple[str, ...] | None = None) -> list[tuple[int, int]]:
    """Every shape `nearest_shape` may return, nearest first (ties by N, then K)."""
    found = {}
    for key in shapes:
        dims, at, rest = key.partition("@r")
        if suffixes is not None and (at + rest) not in suffixes:
            continue
        tn, tk = (int(v) for v in dims.split("x"))
        ratios = (max(tn, n) / min(tn, n), max(tk, k) / min(tk, k))
        if max(ratios) > NEAREST_SHAPE_FACTOR:
            continue
        found[(tn, tk)] = math.log(ratios[0]) + math.log(ratios[1])
    return sorted(found, key=lambda shape: (found[shape], shape))


def table_entry(table: dict, op: str, tokens: int, n: int, k: int, rank: int | None = None,
                cover: bool = False, one_slot: bool | None = False,
                max_bucket: int | None = None) -> LaunchConfig | None:
    """`table_config`'s lookup in a given table; a shape the table lacks takes the entries of
    its nearest tuned shape (`nearest_shape`), if any."""
    shapes = table.get(op, {})
    suffixes = _key_suffixes(rank, one_slot)
    # The nearest shape with entries this lookup may use (a shape tuned only for other ranks or
    # one slot does not hide a farther one that serves it) and a bucket at or above the batch:
    # a shape the tuner cached at the decode buckets only does not give a prefill batch its
    # 32-token tiles while a near shape has prefill ones. Where no shape has such a bucket, the
    # largest bucket of any (the nearest shape's among equals), or with `cover` none.
    fallback, fallback_bucket = None, -1
    for near in nearest_shapes(shapes, n, k, tuple(suffixes)):
        keys = [f"{near[0]}x{near[1]}{suffix}" for suffix in suffixes]
        entries = {b: fields for key in keys for b, fields in shapes.get(key, {}).items()}
        buckets = sorted(int(b) for b in entries if max_bucket is None or int(b) <= max_bucket)
        if not buckets:
            continue
        bucket = _covering_bucket(entries, tokens, max_bucket)
        if bucket is not None:
            return LaunchConfig(**entries[str(bucket)])
        if buckets[-1] > fallback_bucket:
            fallback, fallback_bucket = entries[str(buckets[-1])], buckets[-1]
    return None if cover or fallback is None else LaunchConfig(**fallback)


def select_config(device_name: str | None, op: str, tokens: int, n: int, k: int, rank: int,
                  slices: tuple[int, ...] = (), one_slot: bool | None = False,
                  cache_device: str | None = None, large_tiles: bool = True) -> LaunchConfig:
    """The launchers' choice: the device's tuned entry, else the heuristic (`device_name`
    None: the heuristic). K2's table entries are tuned at one rank; its epilogue holds a whole
    adapter's rank in one tile, so their `block_r` becomes the rank's. The decode path's K1
    beyond the decode buckets (`decode_shrink`, more than DECODE_SHRINK_MAX_TOKENS tokens) takes
    a `decode_shrink` bucket covering the batch, else with one slot (`one_slot` True) up to
    rank DECODE_K1_RULE_MAX_RANK and DECODE_MAX_TOKENS_ONE_SLOT tokens the heuristic's rule for
    it, else the fused path's settings (the heuristic's with one slot in 4 stages); beyond
    PREFILL_MIN_TOKENS every op takes the heuristic's prefill tiles unless a bucket covers the
    batch; up to DECODE_SHRINK_MAX_TOKENS, the heuristic's unless a bucket up to there does
    (but `shrink`, the hybrid path's K1).
    `one_slot`: the batch has one adapter slot (its one-slot entries first, `table_config`),
    or several (its several-slot entries, and the heuristic's `several_slots` rule), or None:
    no adapters (neither).
    `cache_device`: the device whose tuner cache overlays `device_name`'s table (default: that
    device). `large_tiles`: as for `heuristic_config`. `decode_shrink_codes` takes its own
    entry where a bucket covers the batch, else `decode_shrink`'s choice."""
    cover, max_bucket = _lookup_limits(op, tokens)

    def covered(op: str) -> LaunchConfig | None:  # a bucket at or above the batch, or None
        return None if device_name is None else table_config(
            device_name, op, tokens, n, k, rank, cover=True, one_slot=one_slot,
            cache_device=cache_device, max_bucket=max_bucket)

    if op == "decode_shrink_codes":  # (a nearest shape's entries too, before decode_shrink's)
        tuned = covered(op)
        if tuned is not None:
            return tuned
        op = "decode_shrink"
    # the heuristic's op and slots (the decode path's K1 keeps its rules past the table's)
    rule_op, several_slots = op, one_slot is False
    if op == "decode_shrink" and tokens > DECODE_SHRINK_MAX_TOKENS:
        tuned = covered(op)
        if tuned is not None:
            return tuned
        several_slots = one_slot is not True  # (no adapters: not one slot's rules either)
        if decode_k1_rule(tokens, rank, several_slots):
            return heuristic_config(op, tokens, n, k, rank, slices, large_tiles)
        op = "quantize_shrink"
    tuned = None if device_name is None else table_config(
        device_name, op, tokens, n, k, rank, cover=cover, one_slot=one_slot,
        cache_device=cache_device, max_bucket=max_bucket)
    if tuned is None:
        return heuristic_config(rule_op, tokens, n, k, rank, slices, large_tiles,
                                several_slots)
    if op != "lora_gemm":
        return tuned
    # K2 holds the whole rank in its epilogue; a nearest shape's tiles may not fit the slices
    # (narrowed below 64 weight rows a warpgroup, a swapped tile is no longer one).
    block_n = fit_slices(tuned.block_n, slices)
    return dataclasses.replace(tuned, block_r=rank_block(rank), block_n=block_n,
                               swap_ab=tuned.swap_ab and block_n >= 16 * tuned.num_warps)
