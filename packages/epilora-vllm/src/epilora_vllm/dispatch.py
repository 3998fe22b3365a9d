"""Timed dispatch (EPILORA_VLLM_DISPATCH=timed): per projection shape and token bucket, the
fastest of the kernels' paths (decode, fused, hybrid) and vLLM's own LoRA kernels (`vllm`: vLLM's
FP8 GEMM, then its Punica shrink and expand), timed on the layer's own weights and batch, each in
a CUDA graph replayed (`epilora_kernels.tuner.graph_timer`).

Only the token buckets an engine runs while it starts are timed (`start_buckets`: vLLM's
profiling run, and the eager warm-up run it makes before capturing each graph size), the first
time one is seen outside a CUDA-graph capture; inside a capture, and for any other bucket not yet
in the file, the kernels' rule (`choose_path`) answers, so serving never stops to time. The
choices are kept in a JSON file per GPU and versions (`cache_path`), written after each new
choice, so a later start times nothing. Each choice is logged with every candidate's time.

Buckets: the token count rounded up to a power of two (a batch of 24 tokens takes the 32-token
bucket's path).
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from epilora_vllm import _env, _files

logger = logging.getLogger("vllm.epilora_vllm")

CANDIDATES = ("decode", "fused", "hybrid", "vllm")
DECODE_MAX_TOKENS = 64  # the decode path is a candidate up to this many tokens
REPS = 10  # graph replays per candidate
FLUSH_BYTES = 64 * 2**20  # zeroed before each replay: more than the H100/H200 L2 (50 MB)


def bucket(tokens: int) -> int:
    """The power of two at or above `tokens` (at least 1)."""
    if tokens < 1:
        raise ValueError(f"a batch of {tokens} tokens has no bucket")
    return 1 << (tokens - 1).bit_length()


def start_buckets(capture_sizes, max_batched_tokens: int) -> frozenset[int]:
    """The buckets of the batches vLLM runs eagerly while it starts: each CUDA-graph size
    (warmed up before its capture) and the profiling run's (`max_num_batched_tokens`)."""
    return frozenset(bucket(size) for size in (*capture_sizes, max_batched_tokens) if size > 0)


@dataclass(frozen=True)
class Case:
    """What a choice is made for: a projection's shape and adapter buffers, the engine's modes
    that change a candidate's time, and a token bucket."""

    in_features: int
    output_slices: tuple[int, ...]
    max_rank: int
    max_loras: int  # K2's epilogue for one slot is another kernel than for several
    per_channel: bool  # one weight scale per output channel
    quantize: str  # EPILORA_VLLM_QUANTIZE (where the activations are quantized and shrunk)
    dual_stream: bool  # vLLM's dual-stream LoRA (its own path's speed)
    tokens: int  # the bucket

    def key(self) -> str:
        slices = "+".join(str(w) for w in self.output_slices)
        quantize = {"kernels": "", "vllm": "/vllm-quant"}.get(self.quantize,
                                                             f"/{self.quantize}")
        modes = "".join((quantize,
                         "/dual-stream" if self.dual_stream else ""))
        return (f"{slices}x{self.in_features}/r{self.max_rank}/l{self.max_loras}/"
                f"{'channel' if self.per_channel else 'tensor'}{modes}/t{self.tokens}")


def cache_path(device_name: str) -> Path:
    """The choices' file for `device_name` and the versions that make the paths' speed."""
    from importlib.metadata import version

    import triton
    import vllm

    name = "_".join(device_name.replace("-", " ").split())
    versions = (f"torch-{torch.__version__.split('+')[0]}_triton-{triton.__version__}_"
                f"vllm-{vllm.__version__}_epilora-kernels-{version('epilora-kernels')}_"
                f"epilora-vllm-{version('epilora-vllm')}")
    return Path(_env.cache_dir()) / f"dispatch__{name}__{versions}.json"


def _capturing() -> bool:
    # Whether this thread's stream is being captured into a CUDA graph (never without CUDA).
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TimedDispatch:
    """The choices of one device: read from `path` (if it exists), timed where missing, written
    back after each new one. `time_us(fn)`: a candidate's time (default: graph replays with
    the L2 flushed, made on first use)."""

    def __init__(self, path: Path, time_us: Callable[[Callable], float] | None = None) -> None:
        self.path = Path(path)
        self._time_us = time_us
        self._unwritable = False
        self.choices: dict[str, dict] = {}
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                if not isinstance(data, dict) or not all(
                        isinstance(v, dict) and v.get("path") in CANDIDATES
                        for v in data.values()):
                    raise ValueError(f"each case needs a 'path' of {CANDIDATES}")
            except (ValueError, json.JSONDecodeError) as e:
                raise ValueError(f"the timed dispatch's file {self.path} is not valid ({e}); "
                                 "delete it to time again") from e
            self.choices = data

    def choose(self, case: Case, candidates: Callable[[], dict[str, Callable[[], object]]],
               fallback: str, may_time: bool = True) -> tuple[str, bool]:
        """(the path for `case`, whether it is the dispatch's choice): the recorded choice, else
        with `may_time` the fastest of `candidates()` (name -> a call of that path on the batch
        at hand, asked for only when timing) timed now, else (not `may_time`, inside a
        CUDA-graph capture, or no candidate ran) `fallback`, not a choice. A candidate that
        raises is left out, its reason logged and kept in the file."""
        key = case.key()
        if key in self.choices:
            return self.choices[key]["path"], True
        if not may_time or _capturing():
            return fallback, False
        runs = candidates()
        time_us = self._timer() if runs else None
        times, failed = {}, {}
        for name, run in runs.items():
            if name not in CANDIDATES:
                raise ValueError(f"unknown path {name!r}; expected one of {CANDIDATES}")
            try:
                times[name] = round(time_us(run), 2)
            except Exception as e:  # noqa: BLE001 - a candidate that cannot run is no candidate
                failed[name] = f"{type(e).__name__}: {e}"[:200]
        if not times:
            logger.warning("epilora dispatch: %s: no candidate ran (%s); using %s", key,
                           failed, fallback)
            return fallback, False
        best = min(times, key=times.get)
        self.choices[key] = {"path": best, "us": times, **({"failed": failed} if failed else {})}
        logger.info("epilora dispatch: %s: %s -> %s", key,
                    ", ".join(f"{name} {us:.1f} us" for name, us in times.items()), best)
        self._save()
        return best, True

    def _timer(self) -> Callable[[Callable], float]:
        if self._time_us is None:
            from epilora_kernels.tuner import graph_timer

            flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8,
                                device=torch.cuda.current_device())
            self._time_us = graph_timer(REPS, flush)
        return self._time_us

    def _save(self) -> None:
        # Atomically: a start killed mid-write leaves the previous file; merged into the file
        # as another rank may have written it since. A file that cannot be written (a
        # read-only cache directory) costs the next start its timing, not this engine its
        # step: said once, the choices kept in memory.
        try:
            _files.merge_json(self.path, self.choices, indent=1, sort_keys=True)
        except OSError as e:
            if not self._unwritable:
                logger.warning("epilora dispatch: cannot write %s (%s): the choices stay in "
                               "this process only", self.path, e)
            self._unwritable = True


_dispatchers: dict = {}  # device index -> its TimedDispatch


def for_device(device: torch.device) -> TimedDispatch:
    """The process's dispatcher of `device` (its choices' file read once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _dispatchers:
        _dispatchers[index] = TimedDispatch(cache_path(torch.cuda.get_device_name(index)))
    return _dispatchers[index]
