"""The environment variables epilora-kernels reads, all here, read at call time (not import)."""

import os


def triton_interpreter() -> bool:
    """TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_tables() -> bool:
    """EPILORA_LAUNCH_TABLES=0: ignore the shipped launch tables, every launch setting from the
    heuristic (how the benchmarks measure it alone; default 1)."""
    return os.environ.get("EPILORA_LAUNCH_TABLES", "1") != "0"


def cache_dir() -> str:
    """EPILORA_CACHE_DIR: where the tuner writes its launch settings and the launchers read them
    (default: $XDG_CACHE_HOME/epilora/kernels, else ~/.cache/epilora/kernels)."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                           "epilora", "kernels")
    return os.environ.get("EPILORA_CACHE_DIR") or default


def decode_after_previous() -> bool:
    """EPILORA_DECODE_AFTER_PREVIOUS=1 (default 0; no gain on the H200): the decode path's K1
    is launched as the programmatic dependent of whatever kernel precedes it on the stream, so
    that its launch overlaps that kernel's end; K1 waits for that kernel before anything else,
    triggering K2 included (`fused.decode_lora_fp8_linear`)."""
    return os.environ.get("EPILORA_DECODE_AFTER_PREVIOUS", "0") == "1"


def tune_swap_ab() -> bool:
    """EPILORA_TUNE_SWAP_AB (1, the default; 0 off): the tuner also tries K2's decode tiles as
    the transposed product (`LaunchConfig.swap_ab`, `launch.swap_candidates`)."""
    return os.environ.get("EPILORA_TUNE_SWAP_AB", "1") != "0"


def decode_one_launch() -> bool:
    """EPILORA_DECODE_ONE_LAUNCH=1 (default 0): the decode path on FP8 codes the caller made,
    one adapter slot, runs as one launch, the shrink's programs first in K2's grid
    (`fused.one_launch`)."""
    return os.environ.get("EPILORA_DECODE_ONE_LAUNCH", "0") == "1"


def gather_segments() -> str:
    """EPILORA_GATHER_SEGMENTS (default 0): whether K2's decode tiles with several adapter
    slots add each row's adapter from its own slot's B, summed in registers, instead of an MMA
    per adapter segment (`_tiling.gather_segments`): `fit` in 16-row tiles whose rows' slices
    of B fit a budget of L1, 1 in every tile of 32 rows or fewer, 0 never. Off by default:
    on setups its rule was not read from, `fit` lost up to 8% of the layer's time (4 slots
    of rank 32 on Qwen2.5-7B's shapes) where it gained up to 9% on others (docs/kernels-history.md,
    item 55)."""
    value = os.environ.get("EPILORA_GATHER_SEGMENTS", "0")
    if value not in ("0", "1", "fit"):
        raise ValueError(f"EPILORA_GATHER_SEGMENTS={value!r}: expected 0, 1 or fit")
    return value


def epilogue_halves() -> str:
    """EPILORA_EPILOGUE_HALVES (default `auto`): K2's epilogue in FP8 tiles of 64 rows or more
    keeps the rounded base in registers and adds the adapters' delta one half of the tile's
    columns at a time, instead of parking the base or the delta in y and reading it back
    (`_tiling.epilogue_halves`): `auto` with one adapter slot from 65 tokens and with several
    of rank 32 or less from 32 tokens a slot (and 65 in all), `1` one slot at any size, `all`
    several slots too at any size, `0` never (the epilogue as before 2026-12-05)."""
    value = os.environ.get("EPILORA_EPILOGUE_HALVES", "auto")
    if value not in ("0", "1", "all", "auto"):
        raise ValueError(f"EPILORA_EPILOGUE_HALVES={value!r}: expected auto, 0, 1 or all")
    return value


def epilogue_early() -> str:
    """EPILORA_EPILOGUE_EARLY (default 0; untimed): where K2's epilogue runs in halves with one
    adapter slot and h is whole before its K loop (the fused path), `1` loads the epilogue's
    operands (the tile's rows of h, its columns of B) before the K loop and holds them there,
    so that no load waits after it (`_tiling.epilogue_early`); `0` loads them after the loop."""
    value = os.environ.get("EPILORA_EPILOGUE_EARLY", "0")
    if value not in ("0", "1"):
        raise ValueError(f"EPILORA_EPILOGUE_EARLY={value!r}: expected 0 or 1")
    return value


def delta_kernel() -> str:
    """EPILORA_DELTA_KERNEL (default `auto`): where K2 would sum several slots' delta before
    its K loop (`DELTA_FIRST`: 64- and 128-row FP8 tiles, h whole), a kernel of its own writes
    it into y first (`_launchers.launch_delta`) and K2, waiting for it before its K loop, only
    adds it. `auto`: where the batch has at most `_launchers.DELTA_TOKENS_PER_SLOT` tokens a
    slot held (`_launchers.use_delta_kernel`); `1`: wherever the delta goes first; `0`: never
    (K2 sums it, as before 2026-12-06). Read at each launch by `lora_linear`, when made by a
    `LoraProjection`."""
    value = os.environ.get("EPILORA_DELTA_KERNEL", "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"EPILORA_DELTA_KERNEL={value!r}: expected 0, 1 or auto")
    return value
