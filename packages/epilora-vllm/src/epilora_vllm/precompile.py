"""Compile, while the engine starts, the kernels each served layer will launch at vLLM's batch
sizes (EPILORA_VLLM_PRECOMPILE=1).

vLLM runs every CUDA-graph size eagerly once before capturing it, and the first run of a size
compiles the Triton kernels the layer's path launches there: tens of compiles, a large part of
the plugin's graph-capture time (`dev/compile_variants.py` counts them). Here a layer's
compiles start as soon as its adapter buffers exist (vLLM wraps the model for LoRA right after
loading it, before its own torch.compile), in one background thread per process, one job per
distinct projection case (shapes, adapter slots, the plugin's modes; layers of one shape share
their kernels). A job runs the layer's own computation (`EpiloraForward.warm`) for each size
inside `epilora_kernels.compile_only()`: the kernels and arguments the capture will launch,
compiled into Triton's caches, nothing launched. The layer's first real forward (vLLM's
profiling run) waits for its job; a job that fails says why once and leaves the compiles to the
forward, as without it.
"""

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import epilora_kernels as ek

logger = logging.getLogger("vllm.epilora_vllm")

_pool: ThreadPoolExecutor | None = None  # made on the first job (no thread at import)
_jobs: dict[tuple, Future] = {}  # a case's key -> its job


def batch_sizes() -> list[int]:
    """The token counts an engine runs while it starts: each CUDA-graph size (ascending) and
    the profiling run's `max_num_batched_tokens`."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    sizes = set(config.compilation_config.cudagraph_capture_sizes or ())
    sizes.add(config.scheduler_config.max_num_batched_tokens)
    return sorted(size for size in sizes if size > 0)


def start(forward, key: tuple, sizes: list[int]) -> Future:
    """The job compiling `forward`'s kernels at `sizes`, started unless one of the same case
    `key` exists (then that one)."""
    global _pool
    if key not in _jobs:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="epilora-precompile")
        _jobs[key] = _pool.submit(_compile, forward, key, sizes)
    return _jobs[key]


def _compile(forward, key: tuple, sizes: list[int]) -> None:
    begin = time.perf_counter()
    device = forward.layer.device
    try:
        with torch.cuda.device(device), ek.compile_only():  # a new thread's device is 0
            for tokens in sizes:
                forward.warm(tokens)
    except Exception as e:  # noqa: BLE001 - an optimization: the forward compiles without it
        logger.warning("epilora precompile: %s stopped (%s: %s); the forward compiles what is "
                       "left", key, type(e).__name__, str(e)[:300])
        return
    logger.info("epilora precompile: %s: the kernels of %d batch sizes (%d-%d tokens) in "
                "%.1f s", key, len(sizes), sizes[0], sizes[-1], time.perf_counter() - begin)
