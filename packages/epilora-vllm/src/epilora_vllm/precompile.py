"""Compile, while the engine starts, the kernels each served layer will launch at vLLM's
CUDA-graph sizes (EPILORA_VLLM_PRECOMPILE=1).

vLLM runs every CUDA-graph size eagerly once before capturing it, and the first run of a size
compiles the Triton kernels the layer's path launches there: tens of compiles, most of the
plugin's graph-capture time (`dev/compile_variants.py` counts them). Here a layer's compiles
are queued as soon as its adapter buffers exist (vLLM wraps the model for LoRA right after
loading it, before its own torch.compile), for one background thread, one job per distinct
projection case (shapes, adapter slots, the plugin's modes, device and sizes: layers of one
shape share their kernels). A job runs the layer's own computation (`EpiloraForward.warm`) at
each size inside `epilora_kernels.compile_only(threads=...)`: the kernels and arguments the
capture will launch, compiled into Triton's caches in parallel threads, nothing launched.
Only the graph sizes (at most 512 tokens, buffers of tens of MB): vLLM's profiling run (dummy
adapters at `max_num_batched_tokens`) compiles its own size's kernels in the main thread, a
few, before any capture; compiled here, that size's buffers would be hundreds of MB.

The first real forward of any served layer (vLLM's profiling run, before any capture) waits for
every job, so no job allocates or synchronizes during a capture. A job that fails says why once
and leaves the compiles to the forward, as without it. The thread is a daemon: an engine that
fails to start exits without finishing the queue.
"""

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future

import torch

import epilora_kernels as ek

logger = logging.getLogger("vllm.epilora_vllm")

# Compile threads per job: Triton's compiler and ptxas release the GIL, and vLLM's own
# torch.compile, which runs beside the jobs, compiles in processes of its own.
THREADS = min(8, os.cpu_count() or 1)

_jobs: dict[tuple, Future] = {}  # a case's key -> its job
_queue: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
_lock = threading.Lock()
_worker: threading.Thread | None = None  # started with the first job (no thread at import)


def graph_sizes() -> tuple[int, ...]:
    """vLLM's CUDA-graph sizes for this engine, ascending (none under enforce_eager)."""
    from vllm.config import get_current_vllm_config

    sizes = get_current_vllm_config().compilation_config.cudagraph_capture_sizes or ()
    return tuple(sorted(size for size in sizes if size > 0))


def start(forward, key: tuple, sizes: tuple[int, ...]) -> Future:
    """The job compiling `forward`'s kernels at `sizes`, queued unless one of the same case
    `key` exists (then that one)."""
    global _worker
    with _lock:
        if key not in _jobs:
            _jobs[key] = Future()
            _queue.put((forward, key, sizes, _jobs[key]))
            if _worker is None:
                _worker = threading.Thread(target=_work, name="epilora-precompile", daemon=True)
                _worker.start()
        return _jobs[key]


def wait_all() -> None:
    """Until every job queued so far is done."""
    with _lock:
        jobs = list(_jobs.values())
    for job in jobs:
        job.result()


def _work() -> None:
    while True:
        forward, key, sizes, job = _queue.get()
        if job.set_running_or_notify_cancel():
            _compile(forward, key, sizes)
            job.set_result(None)


def _compile(forward, key: tuple, sizes: tuple[int, ...]) -> None:
    begin = time.perf_counter()
    try:
        with (torch.cuda.device(forward.layer.device),  # a thread's device is 0 until set
              ek.compile_only(threads=THREADS)):
            for tokens in sizes:
                forward.warm(tokens)
    except Exception as e:  # noqa: BLE001 - an optimization: the forward compiles without it
        logger.warning("epilora precompile: %s stopped (%s: %s); the forward compiles what is "
                       "left", key, type(e).__name__, str(e)[:300])
        return
    logger.info("epilora precompile: %s: the kernels of %d batch sizes (%d-%d tokens) in %.1f s",
                key, len(sizes), sizes[0], sizes[-1], time.perf_counter() - begin)
