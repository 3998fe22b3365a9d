"""Compile, while the engine starts, the kernels each served layer will launch at every batch
size vLLM can run (EPILORA_VLLM_PRECOMPILE=1).

The first run of a batch size compiles the Triton kernels the layer's path launches there. vLLM
runs every CUDA-graph size eagerly once before capturing it (tens of compiles, most of the
plugin's graph-capture time: `dev/compile_variants.py` counts them), and batches above the
largest graph size (prefill, up to `max_num_batched_tokens`) run eagerly while serving: a
kernel first met there compiled in the middle of a request (vLLM's JIT monitor warned of
`_lora_gemm_kernel` in the online benchmark at d796919, p99 TTFT 1.6 s at 2 req/s). Here a
layer's compiles are queued as soon as its adapter buffers exist (vLLM wraps the model for LoRA
right after loading it, before its own torch.compile), for one background thread, one job per
distinct projection case (shapes, adapter slots, the plugin's modes, device and sizes: layers
of one shape share their kernels). A job runs the layer's own computation
(`EpiloraForward.warm`) at each size inside `epilora_kernels.compile_only(threads=...)`: the
kernels and arguments the forward will launch, compiled into Triton's caches in parallel
threads, nothing launched. Above the graph sizes, `eager_sizes` stands for every size.

The first real forward of any served layer (vLLM's profiling run, before any capture) waits for
every job, so no job allocates or synchronizes during a capture. A job that fails says why once
and leaves the compiles to the forward, as without it. The thread is a daemon: an engine that
fails to start exits without finishing the queue.

A later start runs, of a job an earlier start did whole, only the sizes that met kernels new to
that job: running the layer's computation over two thousand sizes costs seconds of Python even
when every kernel is in Triton's disk cache (11 s for Qwen3-8B's four cases at d70eddb, while
vLLM's own compile waited), and a few dozen sizes load the same kernels into Triton's in-memory
cache, so that nothing loads or compiles while serving. When every job is done, each one that
compiled all its sizes is recorded in the plugin's cache (`$EPILORA_CACHE_DIR/vllm/precompiled/`,
by default `~/.cache/epilora/vllm/precompiled/`) with the sizes whose calls met a kernel the job
had not met before (`compile_only`'s count: kernels found in memory, the tuner's say, count
too, so a record stands on its own), under a name made of the case and its sizes, the GPU, the
versions and the launch settings in force then (the kernels' tables and tuned cache, whole: a
case tuned later renames every record, and the next start runs every size once more). A record
is only as good as the versions it names: a development install whose code changed without its
version gets kernels compiled while the engine captures or serves, as without the precompile
(delete the folder).
"""

import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from importlib.metadata import version
from pathlib import Path

import torch

import epilora_kernels as ek
from epilora_vllm import _env, _files

logger = logging.getLogger("vllm.epilora_vllm")

# Compile threads per job: Triton's compiler and ptxas release the GIL, and vLLM's own
# torch.compile, which runs beside the jobs, compiles in processes of its own.
THREADS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass
class _Job:
    key: tuple  # the case's
    sizes: tuple[int, ...]  # the sizes it stands for
    forward: object  # the first layer of the case: its `warm` runs (None once done and waited)
    done: Future
    run: tuple[int, ...]  # the sizes it runs: `sizes`, or an earlier start's record of them
    recorded: bool  # from a record, or written to one
    compiled: bool = False  # every size of `run` compiled, no error
    new_kernels: list[int] = dataclasses.field(default_factory=list)  # sizes meeting new kernels


_jobs: dict[tuple, _Job] = {}  # (a case's key, its sizes) -> its job
_queue: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()
_lock = threading.Lock()
_worker: threading.Thread | None = None  # started with the first job (no thread at import)


def batch_sizes() -> tuple[int, ...]:
    """The batch sizes to compile for in this engine, ascending: vLLM's CUDA-graph sizes, then
    `eager_sizes` above the largest up to `max_num_batched_tokens` (none under enforce_eager,
    where the first batches compile, as without the plugin)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    graphs = sorted(size for size in config.compilation_config.cudagraph_capture_sizes or ()
                    if size > 0)
    if not graphs:
        return ()
    return (*graphs, *eager_sizes(graphs[-1], config.scheduler_config.max_num_batched_tokens))


def eager_sizes(above: int, most: int) -> tuple[int, ...]:
    """Sizes whose kernels are those of every batch of `above + 1` to `most` tokens: each
    multiple of 16 and the size before it, and `most`. Triton specializes an integer argument
    on its divisibility by 16, and the kernels' launch settings change only where a count of
    row tiles (16 rows or more) or a launch table's token bucket does, at multiples of 16
    tokens (a tuned bucket above 512 tokens that is not one would break this; the shipped
    tables have none). `dev/compile_variants.py --check-eager` compares them with every size
    (Qwen3-8B and Llama-3.1-8B to 8192 tokens: no kernel outside them)."""
    sizes = {size for top in range(16 * (above // 16 + 1), most + 1, 16)
             for size in (top - 1, top) if size > above}
    return tuple(sorted(sizes | ({most} if most > above else set())))


def start(forward, key: tuple, sizes: tuple[int, ...]) -> Future:
    """The job compiling `forward`'s kernels at `sizes`, queued unless one of the same case
    `key` and sizes exists (then that one); an earlier start's record of it cuts it to the
    sizes that met new kernels."""
    global _worker
    with _lock:
        if (key, sizes) not in _jobs:
            earlier = _read_record(forward, key, sizes)
            job = _jobs[key, sizes] = _Job(key, sizes, forward, Future(),
                                           run=sizes if earlier is None else earlier,
                                           recorded=earlier is not None)
            if not job.run:  # an earlier start's job met no kernel of its own
                job.compiled = True
                job.done.set_result(None)
            else:
                _queue.put(job)
                if _worker is None:
                    _worker = threading.Thread(target=_work, name="epilora-precompile",
                                               daemon=True)
                    _worker.start()
        return _jobs[key, sizes].done


def wait_all() -> None:
    """Until every job queued so far is done; then record each whole one not recorded yet, and
    let go of its layer (a job outlives its engine: kept, it would keep the layer's weights and
    adapter buffers from being freed when the engine is)."""
    with _lock:
        jobs = list(_jobs.values())
    for job in jobs:
        job.done.result()
    for job in jobs:
        if not job.recorded and job.compiled:
            job.recorded = True  # written or not, once
            _write_record(job)
        job.forward = None


def _work() -> None:
    while True:
        job = _queue.get()
        if job.done.set_running_or_notify_cancel():
            job.compiled = _compile(job)
            job.done.set_result(None)


def _compile(job: _Job) -> bool:
    key, run = job.key, job.run
    begin = time.perf_counter()
    new_kernels, counted = [], [0]

    def after(tokens: int) -> None:
        if compiles.variants > counted[0]:
            new_kernels.append(tokens)
            counted[0] = compiles.variants

    try:
        with (torch.cuda.device(job.forward.layer.device),  # a thread's device is 0 until set
              ek.compile_only(threads=THREADS) as compiles):
            job.forward.warm(run, after=after)
    except Exception as e:  # noqa: BLE001 - an optimization: the forward compiles without it
        logger.warning("epilora precompile: %s stopped (%s: %s); the forward compiles what is "
                       "left", key, type(e).__name__, str(e)[:300])
        return False
    job.new_kernels = new_kernels
    logger.info("epilora precompile: %s: the kernels of %d batch sizes (%d-%d tokens%s) in "
                "%.1f s", key, len(run), run[0], run[-1],
                f"; {len(job.sizes)} sizes, an earlier start's record" if job.recorded else "",
                time.perf_counter() - begin)
    return True


def _record_path(forward, key: tuple, sizes: tuple[int, ...]) -> Path | None:
    # The record's path (module docstring), or None (said) where it cannot be named.
    try:
        import triton

        identity = [repr(key), list(sizes), *_settings(forward.layer.device),
                    torch.__version__, triton.__version__,
                    *(f"{name}-{version(name)}" for name in ("epilora-kernels", "epilora-vllm"))]
        digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]
    except Exception as e:  # noqa: BLE001 - no record: every size compiles, as before records
        logger.warning("epilora precompile: no record of %s (%s: %s)", key, type(e).__name__, e)
        return None
    return Path(_env.cache_dir()) / "precompiled" / f"{digest}.json"


def _settings(device: torch.device) -> list[str]:
    # The GPU and the launch settings in force on it (the kernels' tables and tuned cache).
    if device.type != "cuda":
        return [device.type]
    from epilora_kernels.launch import settings_identity

    name = torch.cuda.get_device_name(device)
    return [name, settings_identity(name)]


def _read_record(forward, key: tuple, sizes: tuple[int, ...]) -> tuple[int, ...] | None:
    # An earlier start's record of this job: the sizes to run, or None (none, or unreadable).
    path = _record_path(forward, key, sizes)
    try:
        if path is None or not path.is_file():
            return None
        run = json.loads(path.read_text())["new_kernels"]
        if not all(type(tokens) is int and tokens in sizes for tokens in run):
            raise ValueError("sizes outside the job's")
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("epilora precompile: the record %s is not usable (%s); every size "
                       "compiles", path, e)
        return None
    return tuple(run)


def _write_record(job: _Job) -> None:
    # Named by the settings now, every case tuned, as a later start sees them.
    path = _record_path(job.forward, job.key, job.sizes)
    if path is None:
        return
    try:
        _files.write_json(path, {"case": repr(job.key), "sizes": [
            job.sizes[0], job.sizes[-1], len(job.sizes)], "new_kernels": job.new_kernels})
    except OSError as e:  # a read-only cache: every start compiles every size
        logger.warning("epilora precompile: no record of %s (%s)", job.key, e)
