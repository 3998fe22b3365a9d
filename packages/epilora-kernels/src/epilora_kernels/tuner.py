"""The decode path's launch settings tuned on the GPU for a model's own shapes, in bounded time,
into a cache the launchers read (the user's cache directory, per GPU and versions).

    import epilora_kernels.tuner as tuner
    report = tuner.tune_decode({"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
                                "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))},
                               rank=64, budget_s=60)

For each projection and token bucket it times the decode path (K1 and K2 together: K2 hides
K1, so they are tuned as a pair) in a CUDA graph with the L2 flushed, median of `reps`
replays: first the launch settings the launchers would use now (the shipped table, its nearest
shape, or the heuristic), then K2 candidates around them with that K1, then K1 candidates with
the best K2. A candidate replaces the settings in use only if it is faster by more than
`MARGIN`: noise does not churn the cache. When the budget runs out the remaining cells keep the
settings they had. With `codes` it tunes the path as an engine that quantizes x itself calls it
(the codes given, K2 streaming from its start), whose K1 is cached apart. Where the decode and
fused paths are close (`dispatch.timed_choice`: several slots at 9-32 tokens), it also times the
fused path with the chosen GEMM settings and caches the faster path (`path` or `path_codes`
entries), which `choose_path` then takes for that shape. The cache is a launch
table (`launch.validate_table`'s schema) under one-slot keys for batches of one adapter slot,
several-slot keys otherwise (never plain rank keys: settings tuned with one slot can slow
batches of several, and the other way round); the launchers overlay it on the shipped table,
shape by shape.
"""

import dataclasses
import fcntl
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from epilora_kernels import _env, reference
from epilora_kernels.launch import (
    PATH_OPS,
    SHARED_BYTES,
    LaunchConfig,
    fit_slices,
    path_op,
    rank_block,
    shape_key,
    swap_candidates,
    validate_table,
)

DECODE_BUCKETS = (1, 4, 8, 16, 32)
# One adapter slot: the decode path serves batches up to dispatch.DECODE_MAX_TOKENS_ONE_SLOT
# (64), and at 33-64 tokens its K1 takes the heuristic's rule for it up to rank 64, else the
# fused path's settings (`launch.select_config`), unless a `decode_shrink` bucket covers the
# batch, so the tuner's buckets for one slot end at
# 64 (there the search adds K1 in one row tile and K2 in 32-row decode tiles). On an H100 at
# c23f639, one slot of rank 32 (a setup no table entry was tuned on) on Llama-3.1-8B's and
# Qwen2.5-7B's shapes, two runs: the layer at 48 and 64 tokens took 0.93-0.97x its time
# without the bucket, its added time over CUTLASS from 0.28-0.31 of vLLM's LoRA's to
# 0.12-0.22; the tuner took 56 s a model (49 s of it compiling, Triton's cache cold).
ONE_SLOT_BUCKETS = (*DECODE_BUCKETS, 64)


def default_buckets(slots: int) -> tuple[int, ...]:
    """The token buckets `tune_decode` tunes unless told: every batch size class the decode
    path serves with `slots` adapter slots (ONE_SLOT_BUCKETS with one, else DECODE_BUCKETS)."""
    return ONE_SLOT_BUCKETS if slots == 1 else DECODE_BUCKETS


MARGIN = 0.01  # a candidate must beat the settings in use by more than this fraction


def _past_decode_buckets(tokens: int | None) -> bool:
    # a batch of one slot's 64-token bucket beyond the default buckets (33-64 tokens)
    return tokens is not None and DECODE_BUCKETS[-1] < tokens <= ONE_SLOT_BUCKETS[-1]


def cache_path(device_name: str) -> Path:
    """The cache file of `device_name` for these versions of torch, Triton and this package
    (settings tuned with one compiler are not assumed to suit another)."""
    return _cache_file(device_name, _env.cache_dir())


@functools.cache
def _cache_file(device_name: str, directory: str) -> Path:
    # Asked on every launch where the device has no shipped table: the versions once.
    from importlib.metadata import version

    import triton

    name = "_".join(device_name.replace("-", " ").split())
    versions = (f"torch-{torch.__version__.split('+')[0]}_triton-{triton.__version__}_"
                f"epilora-kernels-{version('epilora-kernels')}")
    return Path(directory) / f"{name}__{versions}.json"


def _load(path: Path) -> dict:
    """The cache file's table; one that fails its schema check raises, naming it, rather than
    serve wrong settings."""
    try:
        table = json.loads(path.read_text())
        validate_table(table)
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"the launch-settings cache {path} is not a valid table ({e}); "
                         "delete it to re-tune") from e
    return table


@functools.cache
def _read(path: str, mtime: float) -> dict:
    return _load(Path(path))


def read_cache(device_name: str) -> dict | None:
    """The tuned table of `device_name`, or None (no file; a file that fails its schema check
    raises, naming it, rather than serve wrong settings)."""
    path = cache_path(device_name)
    if not path.is_file():
        return None
    return _read(str(path), path.stat().st_mtime)


def needs_tuning(n: int, k: int, rank: int, *, slots: int = 1, codes: bool = False,
                 device: torch.device | str | None = None) -> bool:
    """Whether `tune_decode` would give the launchers decode settings they lack for an N x K
    projection with adapters of `rank` over `slots` slots (`codes`: called with the codes
    given): no K1 entry tuned on this very shape in the shipped table or the cache (one tuned
    bucket counts; with several slots, only an entry under the several-slot key: the plain
    and rank keys the shipped table fills were not tuned with an engine's slots, but with one
    adapter or, in `benchmarks/tune.py`'s earlier sweeps, 4 slots), and the launchers read
    tables at all (not under EPILORA_LAUNCH_TABLES=0 or the interpreter). K2's entries are one
    per shape, for one slot or several, for both modes: tuning one mode replaces the other's
    (and the timed choices between the decode and fused paths made beside them). A shape
    tuned without a timed choice (an earlier cache's, a run whose budget ended first) is not
    tuned again for it: `choose_path`'s rule serves it, where a choice made each start would
    cost every start its search."""
    from epilora_kernels._tiling import table_of
    from epilora_kernels.arch import device_support
    from epilora_kernels.launch import tuned_exactly

    support = device_support(device)
    name = table_of(support)
    return name is not None and not tuned_exactly(name, _k1_op(codes, slots, 1), n, k, rank,
                                                  slots == 1, cache_device=support.name,
                                                  slots_key_only=slots > 1)


def k2_candidates(cfg: LaunchConfig, n: int, k: int, slices: tuple[int, ...],
                  tokens: int | None = None) -> list:
    """K2 settings around `cfg`: N tiles of 32, 64 and 128, K tiles of 256 and 512, the K loop
    split in 1 or 2, 3 or 5 stages (a tile must not straddle two slices); unless
    EPILORA_TUNE_SWAP_AB=0, for decode tiles (32 rows or fewer) also, first, the swapped
    product (`swap_ab`, `swap_candidates`) for a batch of `tokens` (default: one row tile).
    Where `cfg` has tiles of more than 32 rows for a batch of 33 to ONE_SLOT_BUCKETS[-1]
    tokens (the decode path's one-slot batches beyond 32), the candidates around its 32-row
    form instead, the decode tiles (`cfg` itself stays the settings in use the search starts
    from): prefill tiles around it would be kernels compiled for this bucket alone."""
    if cfg.block_m > 32 and _past_decode_buckets(tokens):
        cfg = dataclasses.replace(cfg, block_m=32)
    return _k2_around(cfg, n, k, slices, tokens)


def _k2_around(cfg: LaunchConfig, n: int, k: int, slices: tuple[int, ...],
               tokens: int | None) -> list:
    out = []
    for block_n in (32, 64, 128):
        for block_k in (256, 512):
            for split_k in (1, 2):
                for stages in (3, 5):
                    # each split at least one K tile; the stages within an SM's shared memory
                    if (k // split_k < block_k
                            or stages * (cfg.block_m + block_n) * block_k > SHARED_BYTES):
                        continue
                    out.append(dataclasses.replace(cfg, block_n=fit_slices(block_n, slices),
                                                   block_k=block_k, split_k=split_k,
                                                   num_stages=stages, swap_ab=False))
    if _env.tune_swap_ab():  # first: what the setting asks to try is timed within the budget
        out = swap_candidates(cfg, n, k, slices, tokens) + out
    # the segment loop as shipped (`LaunchConfig.segment_stages` 1), wherever the settings in
    # use (a cache's) had it: in flight it timed no faster (docs/kernels-history.md, item 55)
    return list(dict.fromkeys(dataclasses.replace(c, segment_stages=1) for c in out))


# A candidate's answer against the settings in use's (norm of the difference over the norm):
# the same sums in another order stay far below; every token's adapter lost in the tuner's
# problem is 0.34-0.38 off (Qwen3-8B's and Qwen2.5-7B's shapes, 1 and 32 tokens), one token's
# of 32 about 0.07.
ANSWER_TOL = 2e-2


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def k1_shared_bytes(cfg: LaunchConfig, slices: int = 1, codes: bool = False) -> int:
    """The shared memory the decode path's K1 takes on sm_90 in `cfg`'s tiles: its pipelined
    buffers of the x tile (bf16 x, or FP8 codes with `codes`) and of the A tile (bf16) of each
    slice a program holds (all `slices` with `slices_together`). Triton 3.6 keeps num_stages - 1
    buffers of each below 64 rows; from 64 rows, where the product reads its operands from
    shared memory, num_stages of A and of bf16 x, one fewer of the codes (widened in registers
    first). Equal to the sm_90 compile's on every K1 tile the tuner offers on the three models'
    shapes (98 kinds, compiled on a CPU at ba7dba7) and on 30 tiles that
    tests/aot_k1_shared_sm90.py compiles for test_compile_sm90.py, beyond the limit among them
    (Triton reports their bytes; only loading them fails)."""
    in_program = slices if cfg.slices_together else 1
    a_tile = cfg.block_k * in_program * cfg.block_r * 2
    x_tile = cfg.block_k * cfg.block_m * (1 if codes else 2)
    if cfg.block_m >= 64:
        return cfg.num_stages * a_tile + (cfg.num_stages - int(codes)) * x_tile
    return (cfg.num_stages - 1) * (a_tile + x_tile)


def k1_candidates(cfg: LaunchConfig, k: int, rank: int, slices: int = 1,
                  tokens: int | None = None, codes: bool = False) -> list:
    """The decode K1's settings around `cfg`: K split in 2 to 32 parts, K tiles of 128 and 256
    (each split at least one tile deep), rank tiles of 32 and 64 (the rank's own where it is
    smaller). Beside K2's weight stream each K step of K1 waits a loaded HBM's latency, so K1
    ends after about (its share of K) / block_k steps: deep splits and wide tiles end it
    sooner, at the price of more programs on K2's SMs. With several output `slices`, the three
    deepest splits also with every slice in one program (`slices_together`: the same steps in
    a third or half the programs), in their deepest K tiles and widest rank tiles. Where `cfg`
    splits a batch of 33 to ONE_SLOT_BUCKETS[-1] `tokens` into several row tiles, also `cfg`'s
    tiles in one row tile (each row tile reads A again, beside K2's weight stream), K split in
    2 to 32 parts: a kernel each for this bucket alone, so its K and rank tiles are not varied.
    None whose buffers exceed an sm_90 block's shared memory (`k1_shared_bytes`, K1 on `codes`
    or bf16 x): those fail only once compiled (at e968ccc 12-36 of a run's compiles at ranks
    64 and 128, 64 tokens, the tuner's budget spent on them)."""
    out = _k1_around(cfg, k, rank, slices)
    rows = 1 << max(0, (tokens or 1) - 1).bit_length()  # the batch in one row tile
    if _past_decode_buckets(tokens) and cfg.block_m < rows:
        out += [dataclasses.replace(cfg, block_m=rows, split_k=split_k)
                for split_k in (2, 4, 8, 16, 32) if k // split_k >= cfg.block_k]
    return [c for c in dict.fromkeys(out) if k1_shared_bytes(c, slices, codes) <= SHARED_BYTES]


def _k1_around(cfg: LaunchConfig, k: int, rank: int, slices: int) -> list:
    out = []
    for split_k in (2, 4, 8, 16, 32):
        for block_k in (128, 256):
            for block_r in sorted({min(32, rank_block(rank)), min(64, rank_block(rank))}):
                if k // split_k < block_k:
                    continue
                out.append(dataclasses.replace(cfg, split_k=split_k, block_k=block_k,
                                               block_r=block_r, slices_together=False))
    if slices > 1:
        for split_k in (8, 16, 32):
            block_k = 256 if k // split_k >= 256 else 128
            if k // split_k >= block_k:
                out.append(dataclasses.replace(cfg, split_k=split_k, block_k=block_k,
                                               block_r=min(64, rank_block(rank)),
                                               slices_together=True))
    return list(dict.fromkeys(out))


def _problem(tokens: int, k: int, slices: tuple[int, ...], rank: int, slots: int, device):
    from epilora_kernels.batch import AdapterBatch, LoraWeights

    gen = torch.Generator(device=device).manual_seed(tokens)
    n = sum(slices)
    x = torch.randn(tokens, k, generator=gen, device=device).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen, device=device) * 8).to(torch.float8_e4m3fn)
    scale = torch.full((1,), 1e-3, device=device)
    lora = LoraWeights(
        tuple((torch.randn(slots, 1, rank, k, generator=gen, device=device) * 0.02)
              .to(torch.bfloat16) for _ in slices),
        tuple((torch.randn(slots, 1, w, rank, generator=gen, device=device) * 0.02)
              .to(torch.bfloat16) for w in slices), slices)
    batch = AdapterBatch.from_token_mapping(
        torch.arange(tokens, device=device, dtype=torch.int32) % slots, slots)
    return x, weight, scale, lora, batch


def graph_timer(reps: int, flush: torch.Tensor):
    """`time_us(fn)`: the median microseconds of one call of `fn`, captured in a CUDA graph
    (after one eager call, on a side stream) and replayed `reps` times, `flush` zeroed before
    every replay (the L2 flushed when it is larger than the L2). Engines time their candidate
    paths with it too (epilora-vllm's timed dispatch)."""

    def time_us(fn) -> float:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: an engine tunes in a thread of its own beside others that may
        # allocate (in global mode those calls would fail for the capture's duration)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        times = []
        for _ in range(reps):
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        return statistics.median(times)

    return time_us


def _k1_op(codes: bool, slots: int, tokens: int) -> str:
    # The decode path in one launch (`fused.one_launch_case`) has its shrink's settings apart,
    # and the tuner leaves them to the heuristic (`k1_tuned`).
    from epilora_kernels import fused

    if fused.one_launch_case(codes=codes, one_slot=slots == 1, tokens=tokens):
        return "decode_lead_shrink"
    return "decode_shrink_codes" if codes else "decode_shrink"


def k1_tuned(codes: bool, slots: int, tokens: int) -> bool:
    """Whether the tuner searches K1's settings for this case: not in one launch, where each
    shrink setting with each GEMM setting is a kernel of its own to compile (the search would
    be their product), and the shrink's heuristic already ends it early beside the GEMM."""
    return _k1_op(codes, slots, tokens) != "decode_lead_shrink"


def _baseline(support, k: int, slices: tuple[int, ...], t: int, rank: int, one_slot: bool,
              codes: bool):
    """The decode path's settings in use for one cell: (K1's, K2's)."""
    from epilora_kernels._tiling import shape_config

    n = sum(slices)
    k1 = shape_config(support, _k1_op(codes, 1 if one_slot else 2, t), t, n, k, rank, slices,
                      one_slot)
    k2 = shape_config(support, "lora_gemm", t, n, k, rank, slices, one_slot)
    return k1, dataclasses.replace(k2, block_r=rank_block(rank))


def _launches(support, projections: dict, tokens, rank: int, slots: int, codes: bool) -> list:
    """Every (K, slices, tokens, K1, K2) the search may time: the settings in use, the K2
    candidates with K1's in use, the K1 candidates with a K2 of each form K1 follows (the
    best K2 differs, but K1 and K2 are separate kernels: compiling each K1 once a form is
    enough)."""
    out = []
    for k, slices in projections.values():
        for t in tokens:
            k1, k2 = _baseline(support, k, slices, t, rank, slots == 1, codes)
            out += [(k, slices, t, k1, k2)]
            k2s = k2_candidates(k2, sum(slices), k, slices, tokens=t)
            out += [(k, slices, t, k1, c) for c in k2s]
            if slots > 1:  # settings in use in flight (an earlier cache's), timed as shipped
                out.append((k, slices, t, k1, dataclasses.replace(k2, segment_stages=1)))
            if k1_tuned(codes, slots, t):
                out += [(k, slices, t, c, partner)
                        for c in k1_candidates(k1, k, rank, len(slices), tokens=t, codes=codes)
                        for partner in _k1_partners([k2, *k2s], codes)]
    return list(dict.fromkeys(out))


def _k1_partners(k2s: list, codes: bool = False) -> list:
    """One K2 of each form that K1's kernel follows, the first of each, so that the search,
    which times K1's candidates beside whichever K2 won, finds each compiled: K1 writes h in
    bf16 for K2 tiles of 64 rows or more, else fp32 (`fused._plan`, K1's H_BF16: at one slot's
    64-token bucket the settings in use have 64 rows and the K2 candidates 32), and, where it
    quantizes x (not `codes`), the codes in adapter order for a K2 that reads them by TMA
    (swapped tiles, or 64 rows or more: `_tiling.w_tma`, K1's CODES_SORTED)."""
    partners: dict = {}
    for c in k2s:
        partners.setdefault((c.block_m >= 64, not codes and c.swap_ab), c)
    return list(partners.values())


def _decode(x, weight, scale, lora, batch, k1, k2, quantized, workspace=None, path="decode"):
    """The decode path as the tuner times it: on bf16 x (K1 quantizes; `quantized` False), or
    on x's per-token codes (`quantized`, the pair; x not passed: the shrink and the GEMM read
    the codes). `path="fused"`: the fused path alike (`k1` None: its K1 the launchers')."""
    from epilora_kernels import fused

    linear = fused.decode_lora_fp8_linear if path == "decode" else fused.fused_lora_fp8_linear
    return linear(None if quantized else x, weight, scale, lora, batch, k1_config=k1,
                  k2_config=k2, workspace=workspace, x_quantized=quantized or None)


def launch_text(launch: tuple) -> str:
    """One of the tuner's launches, (K, slices, tokens, K1's settings, K2's), as its reports
    name it (a compile's error, a stopped worker's progress)."""
    return "{} {} {} {} {}".format(*launch)


def _compile(launches: list, rank: int, slots: int, codes: bool,
             device: torch.device | None = None, started=None) -> list[str]:
    """Run each launch once on `device` (default: the current CUDA device), so that Triton
    compiles it (in a worker process, into its disk cache, which the tuning process then reads;
    or under `compile_only`, into this process's caches); the errors, as text. `started(i,
    launch)` is told of each launch before it runs (a worker's progress file)."""
    from epilora_kernels import fused

    errors = []
    device = torch.device("cuda") if device is None else device
    fitted = set()
    for i, (k, slices, t, k1, k2) in enumerate(launches):
        if started is not None:
            started(i, (k, slices, t, k1, k2))
        try:
            x, weight, scale, lora, batch = _problem(t, k, slices, rank, slots, device)
            if (k, slices, t) not in fitted:  # the wave fitting's candidates, compiled here too
                fitted.add((k, slices, t))
                fused.decode_settings(x, weight, scale, lora, batch, codes=codes)
            _decode(x, weight, scale, lora, batch, k1, k2, codes and fused.quantize(x))
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (reported; the timed search skips it)
            errors.append(f"{launch_text((k, slices, t, k1, k2))}: {e!r}"[:800])
    return errors


def _compile_in_threads(launches: list, rank: int, slots: int, codes: bool,
                        threads: int) -> list[str]:
    """`_compile` in this process, each launch compiled without running (`compile_only`), the
    compiles in `threads` threads: for a process that must not spawn others (an engine)."""
    from epilora_kernels._launchers import compile_only

    try:
        with compile_only(threads=threads):
            return _compile(launches, rank, slots, codes)
    except Exception as e:  # noqa: BLE001 (the first failed compile; the search skips it)
        return [f"compile: {e!r}"[:500]]


def _compile_in_parallel(launches: list, rank: int, slots: int, codes: bool, jobs: int,
                         device: torch.device, timeout_s: float) -> list[str]:
    """`_compile` in `jobs` worker processes (`epilora_kernels._compile_worker`), a share of the
    launches each, within `timeout_s`; the errors, as text. Started as commands, not with
    multiprocessing, which a daemonic process (vLLM's engine core, where an engine tunes at
    start) may not use to start children. Each worker runs in a session of its own, so that
    stopping it stops what it started (ptxas); none outlives this call, however it ends."""
    import signal
    import subprocess
    import sys
    import tempfile

    if device.type == "cuda" and device.index is None:  # the workers number devices alike
        device = torch.device("cuda", torch.cuda.current_device())
    shares = [share for share in (launches[i::jobs] for i in range(jobs)) if share]
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="epilora-compile-") as folder:
        workers = []
        try:
            for i, share in enumerate(shares):
                files = {part: Path(folder, f"{part}{i}.json") for part in
                         ("share", "errors", "stderr", "progress")}
                files["share"].write_text(json.dumps({
                    "device": str(device), "rank": rank, "slots": slots, "codes": codes,
                    "launches": [[k, list(slices), t, dataclasses.asdict(k1),
                                  dataclasses.asdict(k2)] for k, slices, t, k1, k2 in share]}))
                with open(files["stderr"], "w") as stderr:  # a file: no pipe to fill
                    workers.append((subprocess.Popen(
                        [sys.executable, "-m", "epilora_kernels._compile_worker",
                         str(files["share"]), str(files["errors"]), str(files["progress"])],
                        stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True),
                        files))
            deadline = time.monotonic() + timeout_s
            for worker, files in workers:
                try:
                    worker.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    errors.append(_stopped_at_the_budget(timeout_s, files["progress"]))
                    continue
                if worker.returncode != 0 or not files["errors"].is_file():
                    said = files["stderr"].read_text(errors="replace").strip()
                    errors.append(f"a compile worker exited {worker.returncode}: {said[-400:]}")
                    continue
                errors += json.loads(files["errors"].read_text())
        finally:
            for worker, _ in workers:
                if worker.poll() is None:
                    os.killpg(worker.pid, signal.SIGKILL)
                    worker.wait()
    return errors


def _stopped_at_the_budget(timeout_s: float, progress: Path) -> str:
    # What a worker stopped at the budget was doing, from its progress file (`_compile_worker`:
    # the launch it began last and when; the first launch of each shape also runs its wave
    # fitting's compiles): one launch on it for most of the budget is a compile or a run that
    # does not end, a launch far from the share's end with little time on it a share too big.
    said = f"a compile worker stopped at the budget ({timeout_s:.0f} s)"
    try:
        began = json.loads(progress.read_text())
        index, total, since = int(began["index"]), int(began["of"]), float(began["time"])
        launch = str(began["launch"])
    except (OSError, ValueError, KeyError, TypeError):  # no launch begun (or no file to read)
        return said
    on_it = time.time() - since
    if index >= total:
        return f"{said}, {on_it:.1f} s after beginning its last launch of {total}"
    return f"{said}, at launch {index + 1} of {total}, {on_it:.1f} s on it: {launch}"[:800]


def tune_decode(projections: dict[str, tuple[int, tuple[int, ...]]], *, rank: int,
                slots: int = 1, tokens: tuple[int, ...] | None = None,
                budget_s: float = 60.0, reps: int = 15, write: bool = True, jobs: int = 0,
                compile_threads: int = 0, codes: bool = False, time_us=None,
                progress=print) -> dict:
    """Tune the decode path's K1 and K2 for `projections` ({name: (K, output slices)}) with
    adapters of `rank` over `slots` slots at the `tokens` buckets (None: `default_buckets`,
    with one slot 1-64, with several 1-32), within `budget_s` seconds;
    `codes`: called as an engine that quantizes x itself calls it (`x_quantized`, x None: K1's
    settings are cached as `decode_shrink_codes`, K2's as the GEMM's for every path);
    write the winners into the cache (`cache_path`) unless `write` is False. With `jobs` > 1
    every candidate is first compiled in that many processes (in the budget); with
    `compile_threads` > 1 instead, in this process in that many threads. `time_us(fn)`
    replaces the GPU timer (tests). Returns the report: per cell the settings before and after
    and their times, and the seconds each projection took."""
    from epilora_kernels import fused
    from epilora_kernels.arch import device_support
    from epilora_kernels.dispatch import decode_max_tokens, timed_choice
    from epilora_kernels.workspace import Workspace

    if tokens is None:
        tokens = default_buckets(slots)
    served = decode_max_tokens(slots == 1)
    if not tokens or min(tokens) < 1 or max(tokens) > served:
        # beyond, the fused path serves the batch and would take these K2 settings
        raise ValueError(f"tokens {tuple(tokens)}: the decode path serves batches of 1 to "
                         f"{served} tokens with {slots} adapter slot(s)")
    support = device_support()
    device = torch.device("cuda") if not support.interpreter else torch.device("cpu")
    if time_us is None:
        time_us = graph_timer(reps, torch.empty(256 * 2**20, dtype=torch.uint8,
                                                device=device))
    workspace = Workspace.for_batches(device, max_tokens=max(tokens),
                                      max_out_features=max(sum(s) for _, s in
                                                           projections.values()),
                                      max_rank=rank, max_loras=slots)
    start = time.monotonic()
    one_slot = slots == 1
    compile_s, compile_errors = 0.0, []
    if jobs > 1 and compile_threads > 1:
        raise ValueError("compile in processes (jobs) or in threads (compile_threads), not both")
    if (jobs > 1 or compile_threads > 1) and not support.interpreter:
        launches = _launches(support, projections, tokens, rank, slots, codes)
        if jobs > 1:
            compile_errors = _compile_in_parallel(launches, rank, slots, codes, jobs, device,
                                                  timeout_s=budget_s)
            where = f"{jobs} processes"
        else:
            compile_errors = _compile_in_threads(launches, rank, slots, codes, compile_threads)
            where = f"{compile_threads} threads"
        compile_s = round(time.monotonic() - start, 1)
        progress(f"compiled the candidates in {where}: {compile_s} s, "
                 f"{len(compile_errors)} failed")
    table: dict = {"_meta": {"device": support.name, "tool": "epilora_kernels.tuner",
                             "rank": rank, "slots": slots, "codes": codes}}
    stale: list = []  # (op, shape key, bucket) of path choices this run's settings void
    report = {"device": support.name, "rank": rank, "slots": slots, "codes": codes, "cells": [],
              "seconds": {}, "budget_s": budget_s, "complete": True, "compile_s": compile_s,
              "compile_errors": compile_errors}
    for name, (k, slices) in projections.items():
        began = time.monotonic()
        n = sum(slices)
        for t in tokens:
            if time.monotonic() - start > budget_s:
                report["complete"] = False
                break
            x, weight, scale, lora, batch = _problem(t, k, slices, rank, slots, device)
            quantized = codes and fused.quantize(x)

            # The answer every candidate must give: the settings in use's where they run and
            # give a finite one, else the torch reference's.
            wanted: dict = {}

            def run(k1, k2, x=x, weight=weight, scale=scale, lora=lora, batch=batch, name=name,
                    t=t, quantized=quantized, wanted=wanted, baseline=False, path="decode"):
                def call():
                    return _decode(x, weight, scale, lora, batch, k1, k2, quantized, workspace,
                                   path)

                try:
                    answer = call()
                    whose, error = "", 0.0
                    if not baseline:
                        if not wanted:  # on the call's own inputs: x, or its codes
                            wanted["the torch reference's"] = None  # once, even if it fails
                            wanted["the torch reference's"] = reference.decode_lora_fp8_linear(
                                None if quantized else x, weight, scale, lora, batch,
                                x_quantized=quantized or None)
                        whose, want = next(iter(wanted.items()))
                        if want is None:
                            raise RuntimeError("no answer to hold it to: the torch reference "
                                               "failed")
                        error = _relative_error(answer, want)
                    if not error <= ANSWER_TOL or not bool(torch.isfinite(answer).all()):
                        report.setdefault("failed", []).append(
                            f"{name} {t} {k1} {k2}: a wrong answer ({error:.2e} off {whose}, "
                            "or not finite)")
                        return float("inf")
                    if baseline:
                        wanted["the settings in use's"] = answer
                    return time_us(call)
                except Exception as e:  # a candidate that does not compile or launch
                    failure = f"{name} {t} {k1} {k2}: {e!r}"[:800]
                    report.setdefault("failed", []).append(failure)
                    workspace.reset()
                    return float("inf")

            # What runs without this cell tuned: the table's or heuristic's settings, K2's
            # fitted to the waves.
            k1, k2 = fused.decode_settings(x, weight, scale, lora, batch, codes=codes)
            before = best = run(k1, k2, baseline=True)
            chosen = (k1, k2)
            for cand in k2_candidates(k2, n, k, slices, tokens=t):
                if time.monotonic() - start > budget_s:
                    report["complete"] = False  # this cell's search cut short
                    break
                us = run(chosen[0], cand)
                if us < best * (1 - MARGIN):
                    best, chosen = us, (chosen[0], cand)
            # Settings in use with the segment loop in flight (an earlier cache's): several
            # slots time them as shipped too; one slot ignores the loop: as shipped.
            shipped = dataclasses.replace(chosen[1], segment_stages=1)
            if shipped != chosen[1] and slots > 1:
                if time.monotonic() - start > budget_s:
                    report["complete"] = False
                else:
                    us = run(chosen[0], shipped)
                    if us < best * (1 - MARGIN):
                        best, chosen = us, (chosen[0], shipped)
            if slots == 1:
                chosen = (chosen[0], shipped)
            for cand in (k1_candidates(k1, k, rank, len(slices), tokens=t, codes=codes)
                         if k1_tuned(codes, slots, t) else ()):
                if time.monotonic() - start > budget_s:
                    report["complete"] = False
                    break
                us = run(cand, chosen[1])
                if us < best * (1 - MARGIN):
                    best, chosen = us, (cand, chosen[1])
            if best == float("inf"):  # nothing ran: leave the cell to the settings in use
                report.setdefault("untuned", []).append({"projection": name, "tokens": t})
                continue
            # Where the two paths are close (`dispatch.timed_choice`), the fused path with the
            # chosen GEMM settings (its K1 the launchers'; compiled here, not by the workers:
            # one kernel a cell) against the tuned decode path: `choose_path` takes the faster.
            path, fused_us, timed = None, None, timed_choice(t, batch, support)
            if timed:
                if time.monotonic() - start > budget_s:
                    report["complete"] = False
                else:
                    fused_us = run(None, chosen[1], path="fused")
                    path = "fused" if fused_us < best * (1 - MARGIN) else "decode"
            key = shape_key(n, k, rank, one_slot)
            for op, cfg in ((_k1_op(codes, slots, t), chosen[0]), ("lora_gemm", chosen[1])):
                table.setdefault(op, {}).setdefault(key, {})[str(t)] = dataclasses.asdict(cfg)
            if timed:
                # an earlier run's choices at this bucket were timed beside the GEMM settings
                # this one replaces (the other mode's too: K2's entries are both modes'), so
                # they go, but this run's own
                stale += [(op, key, str(t)) for op in PATH_OPS
                          if path is None or op != path_op(codes)]
            if path is not None:
                table.setdefault(path_op(codes), {}).setdefault(key, {})[str(t)] = {
                    "path": path, "slots": slots}
            report["cells"].append({"projection": name, "tokens": t,
                                    "before_us": None if before == float("inf") else before,
                                    "after_us": best, "k1": dataclasses.asdict(chosen[0]),
                                    "k2": dataclasses.asdict(chosen[1]), "path": path,
                                    "fused_us": None if fused_us in (None, float("inf"))
                                    else fused_us})
            k2 = chosen[1]
            fused_said = "" if path is None else f"; the fused path {fused_us:.1f} us: {path}"
            progress(f"tune {name} ({n}x{k}) r{rank} {t:3d} tokens: {before:7.1f} -> "
                     f"{best:7.1f} us (K2 {k2.block_m}x{k2.block_n}x{k2.block_k}, split "
                     f"{k2.split_k}, {k2.num_stages} stages{', swapped' if k2.swap_ab else ''}"
                     f"{f', {k2.segment_stages} segment stages' if k2.segment_stages > 1 else ''}"
                     f"{fused_said})")
        report["seconds"][name] = round(time.monotonic() - began, 1)
    if write:
        _write(support.name, table, stale)
    return report


def _write(device_name: str, table: dict, stale: list = ()) -> None:
    """Merge `table` into the device's cache file (shape keys replaced), atomically, less the
    `stale` (op, shape key, bucket) entries."""
    from epilora_kernels.launch import clear_table_cache

    validate_table(table)
    path = cache_path(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One writer at a time (an engine's ranks tune side by side): each merges into what the
    # last one wrote, read afresh under the lock, so none drops another's shapes.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # read afresh (not read_cache's memo, keyed by an mtime a write within its tick keeps)
        merged = _load(path) if path.is_file() else {}
        for op, shapes in table.items():
            if op == "_meta":
                merged.setdefault("_meta", {}).setdefault("runs", []).append(shapes)
                continue
            for key, buckets in shapes.items():  # bucket by bucket: an earlier run's stay
                merged.setdefault(op, {})[key] = {**merged.get(op, {}).get(key, {}), **buckets}
        for op, key, bucket in stale:
            merged.get(op, {}).get(key, {}).pop(bucket, None)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(merged, indent=1))
        tmp.replace(path)
    clear_table_cache()
