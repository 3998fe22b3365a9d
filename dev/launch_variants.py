"""GPU: variants of the kernels' launch rules, A/B in one process against the shipped ones.

Each variant is a rule of `epilora_kernels` patched in while its layer's CUDA graph is captured
(the launch templates and settings memo made again), so one run times them all side by side:
for each model's layer (its four FP8 projections), `--adapters` slots (one by default, the
tokens round robin over them) of each rank and each token count, the graphs are replayed in
turns with the L2 flushed (benchmarks/layer.py's `time_graphs`), beside vLLM's quant +
CUTLASS (`cutlass`) and the dispatcher `lora_linear` as shipped (`epilora`). Each variant's
output is compared with the shipped one's first (relative error: a variant may sum in another
order).

Variants (`--variants`):

* `rank-steps`: K2's one-slot epilogue in tiles of 64 rows or more steps through the rank, 32
  columns at a time, B loaded after the K loop, where the shipped rule holds B in registers
  through the K loop wherever it fits (`_tiling.b_in_registers`, `epilogue_rank_chunk`). Since
  vLLM's expand arithmetic (13d0321) those tiles hold 175 registers at rank 64 (2 blocks per SM
  where shared memory allows 3); in rank steps 48-72 (`dev/sm90_occupancy.py` with this rule).
* `heuristic`: no launch table or tuner cache (EPILORA_LAUNCH_TABLES=0), the heuristic alone:
  the layer benchmark's `epilora-heuristic`.
* `heuristic-before`: the same with the heuristic's rules as before 2026-12-05's change
  (`launch.heuristic_config`): K2 at 33-256 tokens in 64 x 64 x 128 tiles of 4 stages, K2's
  32-row tiles unswapped, the decode path's K1 at 1-32 tokens split K // 1024 ways (at most
  16). The change was read from the tuned Qwen3-8B entries (configs/NVIDIA_H200.json) and two
  A/B runs of one swapped tile: the other models' shapes are its test. Also without the later
  rules (`heuristic-plain-small`, `k1-apart` below).
* `heuristic-plain-small`: `heuristic` with K2's plain tiles at 1-16 tokens, as before the
  rule that swaps them where the plain tiles are fewer programs than SMs (o's 4096 x 4096;
  `launch.heuristic_config`, read from the tuner's o entries on the H200): against
  `heuristic`, `--tokens 4 8 16`, the three models (Qwen2.5-7B's 3584-wide o is the unseen
  shape).
* `heuristic-swap-wide`: `heuristic` with K2's one-slot tiles at 1-16 tokens swapped and 128
  deep where the plain 64-wide tiles are at least three programs an SM (the wider gate_ups;
  read from the tuner's picks on an H100 at e968ccc): against `heuristic`, `--ranks 16 32 64
  96 128 --tokens 1 4 8 16` (ranks 32 and 96 no pick saw). Untimed.
* `k1-apart`: K1's prefill tiles one slice a program, as before `launch.prefill_slices_together`
  (every slice in one program where several slices' grid still fills the SMs; read from one
  H100 probe of Qwen3-8B at 2048 tokens): `--tokens 512 2048 4096`.
* `k1-light`: the decode path's K1 (up to 32 tokens) in more, lighter programs: the shipped
  settings' K split twice as often (at most 32 ways) and rank tiles of at most 32. In a vLLM
  engine step K1 ends only near the end of K2's weight stream and K2's epilogue waits for it
  (docs/plugin.md, batch 1); more, shorter programs ended K1 sooner in the timeline
  (rank 128's 256 programs on gate_up at 4 tokens: 7.9 us against rank 64's 16: 19.7 us).
  Measure it with `--codes --tokens 1 4 8 16`, the engine's form. `k1-lighter`: K split four
  times as often (at most 64 ways), rank tiles of at most 16 (both cut K tiles to a power of
  two within each split's share). On the codes both were slower than the shipped K1 on the
  three models (H200, these variants, the kernels as at ccc1e70: 0.94-1.24x the layer's time,
  41 of 54 cells above 1.02), so `k1-heavier` and `k1-heaviest` go the other way: K split
  half and a quarter as often, the rank tiles as shipped.

* `fused-path`: several adapter slots take the fused path beyond 8 tokens and no tuner's timed
  choice, the rule before 2026-12-06 (`dispatch.DECODE_MAX_TOKENS` was 8; it is 32 since, and
  the tuner's choice goes first at 9-32 tokens). As `decode-path` against that rule, with no
  table and no cache (H100, 103b6df): 0.90-0.95x with 4 slots of rank 32 and 0.92-0.97x with
  32 of rank 64 at 16 and 32 tokens, 16 of rank 16 0.96x at 32 and 1.02-1.03x at 16.

* `k2-128x256`, `k2-128x128`, `k2-64x256`, `k2-64x128`: K2 in that tile (x 128 deep; 8 warps
  and 3 or 4 stages for 128 rows, 4 warps for 64) from 129 tokens on, where the heuristic
  takes its 128-row tiles by a wave rule. From 64 to 512 tokens most cells miss the quarter of
  vLLM's added time (the H100 page at dbc1257: 0.26-0.51), and K2 without the adapter was
  furthest from CUTLASS at 512 tokens (206 against 166 us on Qwen3-8B, docs/kernels.md,
  "Prefill"), where qkv's 128 x 256 tiles are 96 programs for 132 SMs: `--tokens 256 512
  1024`. Timed on an H100 at bd4c10b (ranks 16-128, 256-2048 tokens, the three models): each
  1.00-1.52x the shipped layer's time but 128 x 128 at 256 tokens (0.97-1.05x): no rule changed.

* `decode-prefill`: the decode path at every token count, prefill included. There K2 waits only
  for K1's quantizing programs before its K loop (their count) and for the shrink before its
  epilogue, where the fused path's K2 waits for all of K1 first: at 2048 tokens on Qwen3-8B's
  shapes K1 took 141 us, 59 of them what our quantizer alone takes (docs/kernels.md,
  "Prefill"), so the shrink's ~80 us could overlap K2's compute-bound loop. The prefill misses
  its quarter of vLLM's added time in most cells (`--tokens 256 512 2048 4096`).

* `after-previous`: the decode path's K1 launched as the programmatic dependent of the kernel
  before it (EPILORA_DECODE_AFTER_PREVIOUS=1), so that K1's launch overlaps that kernel's end
  (the committed timeline: each projection starts 1.1-1.2 us after the one before; docs/
  kernels-history.md, item 60). Give `--gap-us` so that a kernel other than ours precedes each
  K1, as in an engine.

* `one-launch`: the decode path on the codes in one launch (EPILORA_DECODE_ONE_LAUNCH=1, one
  adapter slot, `--codes`): K2's first programs are the shrink's, in settings of their own
  (`decode_lead_shrink`: one or two K steps a program), and its GEMM programs wait for their
  count only before the epilogue, where the two launches' K1 started 1.3-1.5 us before K2 and,
  its programs 4 K steps deep beside K2's weight stream, ended near K2's loop end (o's: 11.4 us
  against K2's 9.5, `decode_timeline.py`, H200, 7958fb8). `one-launch-swap-ab`: with `swap-ab`'s
  K2 tiles, as the plugin's tuner picks them.

* `prefetch-8`, `prefetch-24`: each projection's decode GEMM pulls up to 8 or 24 MiB of the
  next projection's weight into L2 past its K loop (`epilora_kernels.L2Prefetch`; down's next
  is qkv, the next layer's); `prefetch-start-24`: 24 MiB before its K loop, beside its own
  stream. Only the decode path prefetches: give decode sizes (`--tokens 1 4 8 16 32`;
  not in the default `--variants`). Time it with `--gap-us`: an engine runs attention, norms
  and the SiLU between the GEMMs (at batch 1 about 19 us before o, 4-6 us before the others:
  docs/kernels-history.md, item 59), where back to back the prefetch would only compete with the
  next GEMM's own stream.

* `swap-ab`, `swap-ab-split`: K2's decode tiles (16 and 32 rows) as the transposed product
  (`LaunchConfig.swap_ab`: wgmma's 64 x 16 tiles, the weight by TMA), 64 weight rows a tile,
  256 deep, the K loop whole or split in two, the pipeline as deep as `launch.swap_candidates`
  allows (one wave of the grid where that leaves 3 stages, else one program an SM). In the
  committed engine step (`engine_kernels.json` of 9a03a4b, `last_step`, medians of its four
  layers) vLLM's swap-AB CUTLASS GEMM takes 8.7, 6.6, 26.6 and 15.3 us for qkv, o, gate_up and
  down, our K2 (K1 beside it) 12.3, 10.7, 29.0 and 21.0: 15.8 us a layer, most of the batch-1
  TPOT's gap (flushed, our K2 alone is near CUTLASS; beside K1 it is not: docs/kernels-history.md,
  item 61). Decode sizes: `--codes --tokens 1 4 8 16 32`. `swap-ab-fast-acc`: `swap-ab`
  without the promotion of each K tile's FP8 sum to fp32 (wgmma's reduced-precision sums over
  the whole K, as CUTLASS's; ptxas waits for each tile's MMAs before the promotion's adds).

* `segments-in-flight`: K2's loop over adapter segments (several slots) with as many slices
  of B in flight as `_tiling.segment_stages` allows (`LaunchConfig.segment_stages`), where the
  shipped settings wait for each in turn: its sm_90 PTX waits once a segment
  (`cp.async.wait_group 0`), and a decode tile meets one segment a token when each token has
  its own adapter. Give several slots: `--adapters 8 --ranks 16` and `--adapters 32 --ranks
  64`, `--tokens 4 8 16 32`.

* `gather-segments`: K2's decode tiles (32 rows or fewer) with several slots add each row's
  adapter from its own slot's B, summed in registers over rank steps (EPILORA_GATHER_SEGMENTS=1,
  `_tiling.gather_segments`), where the shipped epilogue runs an MMA per adapter segment, one
  after another: the flushed timeline at 8x16 had K2's epilogue at 2.9-5.7 us a program (0.26
  without adapter) and `h-given` at +14% over `cutlass` where `gemm` was at -4% (docs/
  kernels-history.md, item 55). `--adapters 8 --ranks 16 --tokens 4 8 16 32` and `--adapters 32
  --ranks 64`; with `decode-path` beside it for 16 and 32 tokens.
  `gather-fitting` gathers only where `fit` does (16-row tiles whose slices of B fit L1), and
  `segment-loop` never (EPILORA_GATHER_SEGMENTS=0, the default: it differs from the shipped
  layer only where the environment sets another value).

* `epilogue-halves`: K2's one-slot epilogue in prefill tiles (64 rows or more) keeps the
  rounded base in registers and adds the delta half the tile's columns at a time
  (EPILORA_EPILOGUE_HALVES=1, `_tiling.epilogue_halves`), where the shipped one parks the
  base in y and reads it back: compiled for sm_90 on the CPU (`dev/sm90_occupancy.py` with
  and without it, Qwen3-8B's fused K2s at 64-2048 tokens, ranks 16-128) it spills nothing,
  takes fewer registers in 43 of the 48 and 2 more in 2, and fits 3 blocks an SM where the
  shipped takes 2 in two (rank 64: qkv at 256 tokens, gate_up at 64). Untimed. `--adapters
  1 --ranks 16 64 128 --tokens 64 256 512 2048`.
  `epilogue-halves-all` (EPILORA_EPILOGUE_HALVES=all) with several slots too, where the
  shipped epilogue parks the delta (or the base) in y, compiled alike with 8 slots: of rank
  16 no spills (19 fewer registers in the widest tiles, 8-31 more in the others), of rank 64
  188 bytes a thread in the widest (512-2048 tokens); the same blocks an SM everywhere.
  `--adapters 8 --ranks 16 --tokens 64 256 512 2048`. Since the default (`auto`) takes the
  halves with one slot from 65 tokens, `epilogue-parked` (EPILORA_EPILOGUE_HALVES=0) is the
  epilogue as before, parking a term in y. Since 2026-12-06 `auto` also takes the halves with
  several slots where their rank is at most 32 and the batch has 64 tokens a slot (32 a
  slot and 65 in all since a later check; `_tiling.HALVES_MAX_RANK`, `HALVES_TOKENS_PER_SLOT`;
  it was the opt-in `fit` until its check on setups it was not read from, docs/kernels-history.md,
  item 53).

* `epilogue-early`: the one-slot epilogue in halves (the fused path, 65 tokens on) from h's and
  B's tiles loaded before the K loop (EPILORA_EPILOGUE_EARLY=1, `_tiling.epilogue_early`),
  where the shipped halves load them after it, each half waiting on L2 for h and its B (early,
  B loads before the wait for K1 and h after it, delaying the K loop's start by that load). As
  compiled for sm_90 on a CPU (Qwen3-8B's four shapes at 128-2048 tokens, ranks 16 and 32)
  Triton stages them in shared memory before the loop: no spills, 4-12 KB more shared memory
  a block, as many blocks an SM (the rule leaves out tiles where that would change), and after
  the loop only the halves' MMAs. Untimed: `--adapters 1 --ranks 16 32 --tokens 128 256 512
  2048`, twice.

* `delta-kernel`: wherever K2 would sum several slots' delta before its K loop (`DELTA_FIRST`,
  prefill tiles), a kernel of its own writes it into y first (EPILORA_DELTA_KERNEL=1,
  `_launchers.launch_delta`), where the shipped `auto` does so only up to
  `_launchers.DELTA_TOKENS_PER_SLOT` tokens a slot held (`use_delta_kernel`);
  `delta-kernel-off` never (`0`, K2 summing it, as before 2026-12-06); `delta-kernel-by-rank`
  also up to 64 tokens a slot at rank 128 or more (one held-out run: 8x128, docs/kernels-history.md,
  item 53). Give several slots and prefill sizes: `--adapters 32 --ranks 64 --tokens 128
  256 512 2048`, `--adapters 8 --ranks 128 --tokens 128 256 512`.

* `decode-k1-one-tile`: one adapter slot at 33-64 tokens (the decode path's batches beyond
  the tuner's default buckets), the decode path's K1 in one row tile of the batch (64 rows)
  where the settings in use split it in several (the fused path's 16-row tiles, each reading
  A again beside K2's weight stream). Read from rank 128's shipped `decode_shrink` entry at
  64 tokens on Qwen3-8B's shapes (one 64-row tile on qkv) and the three-models pages (docs/
  kernels.md, "The tuner": one slot's 64-token bucket). Untimed; `--ranks 16 32 64 --tokens
  40 48 64`, the three models.

* `l2-next-a`, `l2-next-ab`: a question, not a candidate: with `--gap-us`, the gap after each
  projection first reads the next projection's adapter buffers (A; A and B) with torch
  reductions, leaving them in L2, as a prefetch by the GEMM before would; `l2-control-a` and
  `l2-control-ab` read buffers of the same shapes that no kernel uses. Their ratio says how much
  of the decode path's time beside CUTLASS is the adapter's bytes coming from HBM behind K2's
  weight stream (the engine step: K1 ends near K2's loop end, kernels-history item 58).

`--gap-us G`: after every projection of every system, a kernel that spins G microseconds on one
thread (`torch.cuda._sleep`), standing for the engine's other kernels between the GEMMs.

`--codes`: every system on per-token FP8 codes made beforehand, as in the plugin's default
engine (vLLM's quantizer fused into the norm before): `cutlass` is CUTLASS on the codes, the
kernels take `x_quantized` with x None (K1 only shrinks: `decode_shrink_codes` settings).

    source tools/device/setup.sh
    python3 dev/launch_variants.py --out $OUT/launch_variants.json \
        [--variants rank-steps] [--models qwen3-8b ...] [--ranks 16 64 128] [--tokens ...] \
        [--codes]
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer import (  # noqa: E402
    adapter_inputs,
    cutlass_on_codes,
    l2_flush_buffer,
    make_layer,
    time_graphs,
    vllm_fp8_gemm,
)
from models import MODELS  # noqa: E402

import epilora_kernels as ek  # noqa: E402
from epilora_kernels import _launchers, _tiling, dispatch, fused, launch  # noqa: E402


def _made_again() -> None:
    # Launch templates keep the K2 form they were made with; the settings memo its settings;
    # the wave fitting its tiles (from the blocks per SM of the form it compiled).
    _launchers._K2_TEMPLATES.clear()
    _launchers._FITTED.clear()
    fused._PLANS.clear()


@contextlib.contextmanager
def _made_again_around(patch):
    """`patch` (a unittest.mock patcher) applied inside, the caches made again once it is
    applied and once it is undone."""
    try:
        with patch:
            _made_again()
            yield
    finally:
        _made_again()


def rank_steps():
    def holds_b(cfg) -> bool:  # B held below 64 rows only (as shipped there)
        return (_tiling.b_fits_registers(cfg) and cfg.block_m < 64) or cfg.block_m == 32

    def chunk(cfg) -> int:  # 32-wide rank steps in every tile of 64 rows or more
        return 32 if cfg.block_m >= 64 else 0

    return _made_again_around(mock.patch.multiple(_tiling, b_in_registers=holds_b,
                                                  epilogue_rank_chunk=chunk))


def fused_path():
    return _made_again_around(mock.patch.multiple(dispatch, DECODE_MAX_TOKENS=8,
                                                  tuned_path=lambda *a, **k: None))


def decode_everywhere():
    return _made_again_around(mock.patch.multiple(
        dispatch, DECODE_MAX_TOKENS=1 << 30, DECODE_MAX_TOKENS_ONE_SLOT=1 << 30,
        tuned_path=lambda *a, **k: None))


def with_env(name: str, value: str):
    """A variant: the shipped rules with one of the kernels' settings (epilora_kernels._env)."""
    return lambda: _made_again_around(mock.patch.dict(os.environ, {name: value}))


heuristic = with_env("EPILORA_LAUNCH_TABLES", "0")


def delta_kernel_by_rank():
    """A variant: the shipped `auto`, and at rank 128 or more the delta kernel up to 64 tokens
    a slot held (4 slots of rank 128 gained with it at 32 and 64 a slot on the H100 at
    a2db2cf, where `auto` declines; 32 of rank 64 lost at 64 a slot: docs/kernels-history.md,
    item 53). To be timed on setups other than those (8x128, 16x128)."""
    shipped = _launchers.use_delta_kernel

    def rule(setting, mode, cfg, num_entries, *, tokens, rank, **kw):
        if setting == "auto" and rank >= 128:
            return (shipped("1", mode, cfg, num_entries, tokens=tokens, rank=rank, **kw)
                    and tokens <= 64 * (num_entries - 1))
        return shipped(setting, mode, cfg, num_entries, tokens=tokens, rank=rank, **kw)

    return _made_again_around(mock.patch.object(_launchers, "use_delta_kernel", rule))


@contextlib.contextmanager
def one_launch_swapped():
    with with_env("EPILORA_DECODE_ONE_LAUNCH", "1")(), swap_ab(1)():
        yield


@contextlib.contextmanager
def heuristic_before():
    new = launch.heuristic_config

    def before(op, tokens, n, k, rank, slices=(), large_tiles=True, several_slots=False):
        if op == "lora_gemm" and 32 < tokens <= launch.PREFILL_MIN_TOKENS:
            return launch.LaunchConfig(block_m=64, block_n=launch.fit_slices(64, slices),
                                       block_k=128, block_r=launch.rank_block(rank),
                                       num_warps=4, num_stages=4)
        if op == "lora_gemm" and tokens <= 32:
            return new(op, tokens, n, k, rank, slices, large_tiles=False)  # never swapped
        cfg = new(op, tokens, n, k, rank, slices, large_tiles, several_slots)
        if op in ("decode_shrink", "decode_shrink_codes") and tokens <= 32:
            return dataclasses.replace(cfg, split_k=max(1, min(16, k // 1024)))
        return cfg

    with (heuristic(), mock.patch.object(launch, "prefill_slices_together", _apart),
          _made_again_around(mock.patch.object(launch, "heuristic_config", before))):
        yield


def _apart(cfg, *args):
    return cfg  # launch.prefill_slices_together undone: K1's plain prefill tile


@contextlib.contextmanager
def heuristic_plain_small():
    new = launch.heuristic_config

    def plain(op, tokens, n, k, rank, slices=(), large_tiles=True, several_slots=False):
        # at decode sizes large_tiles gates the swapped tiles alone (several slots' too)
        return new(op, tokens, n, k, rank, slices, large_tiles and not (
            op == "lora_gemm" and tokens <= 16), several_slots)

    with heuristic(), _made_again_around(mock.patch.object(launch, "heuristic_config", plain)):
        yield


@contextlib.contextmanager
def heuristic_swapped_small():
    """The heuristic with K2's swapped decode tile at 2-32 tokens wherever the device's
    shared memory allows, not only where plain tiles leave SMs without a program: what the
    tuner chose in most of its 8x16 cells on an H100 at c6b1cf3 (docs/kernels-history.md, item
    55). The heuristic's rule for several slots since it was checked on 4x32 and 16x16
    (`launch.heuristic_config`'s `several_slots`); this variant swaps one slot's tiles too."""
    new = launch.heuristic_config

    def swapped(op, tokens, n, k, rank, slices=(), large_tiles=True, several_slots=False):
        cfg = new(op, tokens, n, k, rank, slices, large_tiles, several_slots)
        if op == "lora_gemm" and 2 <= tokens <= 32 and large_tiles and not cfg.swap_ab:
            return launch.swap_candidate(cfg, n, k, slices, tokens)
        return cfg

    with heuristic(), _made_again_around(mock.patch.object(launch, "heuristic_config", swapped)):
        yield


@contextlib.contextmanager
def heuristic_swap_wide():
    """The heuristic with K2's one-slot decode tiles (1-16 tokens) swapped, 128 deep, where the
    plain 64-wide tiles are at least three programs an SM: the gate_up projections of
    Llama-3.1-8B and Qwen2.5-7B (28,672 and 37,888 wide: 3.4 and 4.5 an SM), not Qwen3-8B's
    (24,576: 2.9). The tuner's one-slot picks there (an H100 at e968ccc,
    benchmarks/results/h100/tune_decode.json, ranks 16, 64 and 128 at 1-16 tokens) were swapped
    in 21 of those two models' 24 cells, 19 of them 128 deep, in the stages `swap_candidate`
    gives (4 and 3), where Qwen3-8B's stayed plain in 11 of 12."""
    new = launch.heuristic_config

    def wide(op, tokens, n, k, rank, slices=(), large_tiles=True, several_slots=False):
        cfg = new(op, tokens, n, k, rank, slices, large_tiles, several_slots)
        if (op == "lora_gemm" and tokens <= 16 and large_tiles and not several_slots
                and not cfg.swap_ab and -(-n // 64) >= 3 * launch.H200_SMS):
            return launch.swap_candidate(cfg, n, k, slices, tokens, block_k=128)
        return cfg

    with heuristic(), _made_again_around(mock.patch.object(launch, "heuristic_config", wide)):
        yield


@contextlib.contextmanager
def heuristic_k1_fewer_splits():
    """The heuristic with the decode path's K1 at 1-32 tokens split half as often and its K
    steps 256 deep where each split keeps whole ones: what the tuner chose for 8 slots of rank
    16 in most cells on an H100 at c6b1cf3 (its cache: splits 4-8 where the heuristic's rule,
    read from one slot, splits 8-16; docs/kernels-history.md, item 55). A several-slot K1 rule to
    read from 8x16 and check on 4x32, 16x16 and 32x64."""
    shipped = _tiling.select_config

    def fewer(device, op, tokens, n, k, rank, *args, **kwargs):
        cfg = shipped(device, op, tokens, n, k, rank, *args, **kwargs)
        if op not in ("decode_shrink", "decode_shrink_codes") or tokens > 32:
            return cfg
        split = max(1, cfg.split_k // 2)
        deep = 256 if k % (256 * split) == 0 else cfg.block_k
        return dataclasses.replace(cfg, split_k=split, block_k=deep)

    with heuristic(), _made_again_around(mock.patch.object(_tiling, "select_config", fewer)):
        yield


def k1_apart():
    return _made_again_around(mock.patch.object(launch, "prefill_slices_together", _apart))


def k1_split_by(times: float, most: int, rank_tile: int):
    def variant():
        shipped = _tiling.select_config

        def light(device, op, tokens, n, k, rank, *args, **kwargs):
            cfg = shipped(device, op, tokens, n, k, rank, *args, **kwargs)
            if op not in ("decode_shrink", "decode_shrink_codes") or tokens > 32:
                return cfg
            split = max(1, min(most, int(times * cfg.split_k)))
            deepest = 1 << (k // split).bit_length() - 1  # a power of two within K's share
            return dataclasses.replace(cfg, split_k=split, block_r=min(cfg.block_r, rank_tile),
                                       block_k=max(16, min(cfg.block_k, deepest)))

        return _made_again_around(mock.patch.object(_tiling, "select_config", light))
    return variant


def swap_ab(split: int, promote: bool = True):
    @contextlib.contextmanager
    def variant():
        with mock.patch.object(_launchers, "SWAP_AB_PROMOTE", promote), swapped_settings():
            yield

    def swapped_settings():
        shipped = _tiling.select_config

        def swapped(device, op, tokens, n, k, rank, slices=(), *args, **kwargs):
            cfg = shipped(device, op, tokens, n, k, rank, slices, *args, **kwargs)
            if op != "lora_gemm":
                return cfg
            return launch.swap_candidate(cfg, n, k, slices, tokens, split)

        return _made_again_around(mock.patch.object(_tiling, "select_config", swapped))
    return variant


def k2_tile(block_m: int, block_n: int, warps: int, stages: int):
    """A variant: K2 in `block_m` x `block_n` x 128 tiles (`warps`, `stages`) wherever the
    heuristic takes its 128-row tiles (from launch.MID_LARGE_TILE_TOKENS, 129 tokens), the
    slices' boundaries kept (`launch.fit_slices`)."""
    def variant():
        shipped = _tiling.select_config

        def tiled(device, op, tokens, n, k, rank, slices=(), *args, **kwargs):
            cfg = shipped(device, op, tokens, n, k, rank, slices, *args, **kwargs)
            if op != "lora_gemm" or tokens < launch.MID_LARGE_TILE_TOKENS:
                return cfg
            return dataclasses.replace(cfg, block_m=block_m,
                                       block_n=launch.fit_slices(block_n, slices), block_k=128,
                                       num_warps=warps, num_stages=stages, split_k=1,
                                       swap_ab=False)

        return _made_again_around(mock.patch.object(_tiling, "select_config", tiled))
    return variant


def decode_k1_one_tile():
    shipped = _tiling.select_config

    def one_tile(device, op, tokens, n, k, rank, slices=(), one_slot=False, *args, **kwargs):
        cfg = shipped(device, op, tokens, n, k, rank, slices, one_slot, *args, **kwargs)
        if (op in ("decode_shrink", "decode_shrink_codes") and one_slot is True
                and 32 < tokens <= dispatch.DECODE_MAX_TOKENS_ONE_SLOT and cfg.block_m < 64):
            return dataclasses.replace(cfg, block_m=64)
        return cfg

    return _made_again_around(mock.patch.object(_tiling, "select_config", one_tile))


def segments_in_flight():
    shipped = _tiling.select_config

    def in_flight(device, op, tokens, n, k, rank, *args, **kwargs):
        cfg = shipped(device, op, tokens, n, k, rank, *args, **kwargs)
        return _tiling.in_flight(cfg) if op == "lora_gemm" else cfg

    return _made_again_around(mock.patch.object(_tiling, "select_config", in_flight))


VARIANTS = {"rank-steps": rank_steps, "heuristic": heuristic,
            "heuristic-before": heuristic_before, "heuristic-plain-small": heuristic_plain_small,
            "heuristic-swapped-small": heuristic_swapped_small,
            "heuristic-swap-wide": heuristic_swap_wide,
            "heuristic-k1-fewer-splits": heuristic_k1_fewer_splits,
            "k1-apart": k1_apart, "k1-light": k1_split_by(2, 32, 32),
            "k1-lighter": k1_split_by(4, 64, 16), "k1-heavier": k1_split_by(0.5, 32, 128),
            "k1-heaviest": k1_split_by(0.25, 32, 128), "fused-path": fused_path,
            "decode-prefill": decode_everywhere,
            "after-previous": with_env("EPILORA_DECODE_AFTER_PREVIOUS", "1"),
            "swap-ab": swap_ab(1), "swap-ab-split": swap_ab(2),
            "swap-ab-fast-acc": swap_ab(1, promote=False),
            "one-launch": with_env("EPILORA_DECODE_ONE_LAUNCH", "1"),
            "one-launch-swap-ab": one_launch_swapped, "segments-in-flight": segments_in_flight,
            "gather-segments": with_env("EPILORA_GATHER_SEGMENTS", "1"),
            "gather-fitting": with_env("EPILORA_GATHER_SEGMENTS", "fit"),
            "segment-loop": with_env("EPILORA_GATHER_SEGMENTS", "0"),
            "epilogue-halves": with_env("EPILORA_EPILOGUE_HALVES", "1"),
            "epilogue-halves-all": with_env("EPILORA_EPILOGUE_HALVES", "all"),
            "epilogue-parked": with_env("EPILORA_EPILOGUE_HALVES", "0"),
            "epilogue-early": with_env("EPILORA_EPILOGUE_EARLY", "1"),
            "delta-kernel": with_env("EPILORA_DELTA_KERNEL", "1"),
            "delta-kernel-off": with_env("EPILORA_DELTA_KERNEL", "0"),
            "delta-kernel-by-rank": delta_kernel_by_rank, "decode-k1-one-tile": decode_k1_one_tile,
            "k2-128x256": k2_tile(128, 256, 8, 3), "k2-128x128": k2_tile(128, 128, 8, 4),
            "k2-64x256": k2_tile(64, 256, 4, 3), "k2-64x128": k2_tile(64, 128, 4, 4)}


PREFETCH_MIB = {"prefetch-8": (8, "end"), "prefetch-24": (24, "end"),
                "prefetch-start-24": (24, "start")}
VARIANTS.update({name: contextlib.nullcontext for name in PREFETCH_MIB})  # a call argument
# gap variants: (read B too, read the next projection's own buffers rather than look-alikes)
L2_READS = {"l2-next-a": (False, True), "l2-next-ab": (True, True),
            "l2-control-a": (False, False), "l2-control-ab": (True, False)}
VARIANTS.update({name: contextlib.nullcontext for name in L2_READS})
_LOOK_ALIKES: dict[int, torch.Tensor] = {}


def read_into_l2(lora, with_b: bool, own: bool) -> None:
    """Read an adapter's buffers (or same-shaped ones no kernel uses) with reductions."""
    for t in lora.lora_a + (lora.lora_b if with_b else ()):
        if not own:  # made in the eager run before capture, reused by the graphs
            if t.data_ptr() not in _LOOK_ALIKES:
                _LOOK_ALIKES[t.data_ptr()] = torch.zeros_like(t)
            t = _LOOK_ALIKES[t.data_ptr()]
        t.sum(dtype=torch.float32)
SM_MHZ = 1980  # the H200's SM clock (benchmarks/results/h200/gpu-sm90-device.txt): --gap-us


def run_layer(variant: str | None, xs: dict, layer: dict, batch, out: dict,
              codes: dict | None = None, gap_us: float = 0.0) -> None:
    names = list(layer)
    for index, (name, (weight, scale, lora)) in enumerate(layer.items()):
        if variant == "cutlass":
            out[name] = (vllm_fp8_gemm(xs[name], weight, scale) if codes is None else
                         cutlass_on_codes(codes[name], weight, scale))
        else:
            prefetch = None
            if variant in PREFETCH_MIB:  # the next projection's weight; down's: qkv's
                following = layer[names[(index + 1) % len(names)]][0]
                mib, at = PREFETCH_MIB[variant]
                prefetch = ek.L2Prefetch(following, mib << 20, at=at)
            with VARIANTS[variant]() if variant else contextlib.nullcontext():
                if codes is None:
                    out[name] = ek.lora_linear(xs[name], weight, scale, lora, batch,
                                               base_gemm=vllm_fp8_gemm, prefetch=prefetch)
                else:
                    out[name] = ek.lora_linear(None, weight, scale, lora, batch,
                                               x_quantized=codes[name], prefetch=prefetch)
        if gap_us:
            if variant in L2_READS:
                read_into_l2(layer[names[(index + 1) % len(names)]][2], *L2_READS[variant])
            torch.cuda._sleep(int(gap_us * SM_MHZ))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS),
                        default=[v for v in VARIANTS
                                 if v not in PREFETCH_MIB and v not in L2_READS],
                        help="default: all but the prefetch's and the L2 reads' (decode sizes "
                             "only: --tokens 1 4 8 16 32 --gap-us 5)")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512, 2048])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--adapters", type=int, default=1,
                        help="adapter slots, the tokens round robin over them (8: the 8x16 cells)")
    parser.add_argument("--codes", action="store_true",
                        help="every system on FP8 codes made beforehand (the plugin's engine)")
    parser.add_argument("--gap-us", type=float, default=0.0,
                        help="a kernel spinning this long after every projection (the "
                             "engine's attention and norms between its GEMMs)")
    args = parser.parse_args()
    systems = {"cutlass": "cutlass", "epilora": None, **{v: v for v in args.variants}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = l2_flush_buffer()
    rows = []
    print(f"{'model':12s} {'rank':>4s} {'tokens':>6s} "
          + " ".join(f"{s:>16s}" for s in systems) + "   (us; a variant's / epilora's)")
    for model in args.models:
        projections = MODELS[model]
        for rank in args.ranks:
            layer = make_layer(args.adapters, rank, gen, projections)
            for tokens in args.tokens:
                batch, xs, _ = adapter_inputs(tokens, rank, args.adapters, gen, projections)
                # vLLM's per-token codes, bit for bit (as benchmarks/layer.py makes them)
                codes = {name: ek.quantize(x) for name, x in xs.items()} if args.codes else None
                outs = {system: {} for system in systems}
                runs = {system: functools.partial(run_layer, variant, xs, layer, batch,
                                                  outs[system], codes, args.gap_us)
                        for system, variant in systems.items()}
                for run in runs.values():
                    run()
                torch.cuda.synchronize()
                errs = {v: max(((outs[v][p].float() - outs["epilora"][p].float()).norm()
                                / outs["epilora"][p].float().norm()).item() for p in layer)
                        for v in args.variants}
                times = time_graphs(runs, args.reps, flush)
                for system, us in times.items():
                    rows.append({"model": model, "rank": rank, "adapters": args.adapters,
                                 "tokens": tokens,
                                 "codes": args.codes, "gap_us": args.gap_us, "system": system,
                                 "layer_us": round(us, 2), "n": args.reps,
                                 "rel_err_vs_epilora": round(errs.get(system, 0.0), 6)})
                cells = [f"{times['cutlass']:16.1f}", f"{times['epilora']:16.1f}"] + [
                    f"{times[v]:8.1f} ({times[v] / times['epilora']:.2f})".rjust(16)
                    for v in args.variants]
                print(f"{model:12s} {rank:4d} {tokens:6d} " + " ".join(cells)
                      + f"   rel err <= {max(errs.values(), default=0.0):.0e}", flush=True)
                Path(args.out).write_text(json.dumps(rows, indent=1))  # a cut-short run keeps
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
