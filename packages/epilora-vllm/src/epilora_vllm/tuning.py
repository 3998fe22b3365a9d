"""The kernels' tuner at engine start (EPILORA_VLLM_TUNE=1, the default; 0 off).

For each projection case a served layer belongs to (shape, adapter rank and slots, and whether
the shrink reads vLLM's codes), `epilora_kernels.tuner.tune_decode` times the decode path's
launch settings on the GPU at the decode token buckets and writes the winners into the kernels'
cache (per GPU and versions, in the user's cache directory), unless the shipped table or an
earlier start's cache already holds settings tuned on that very shape: a later start tunes
nothing. The shipped table was tuned with the kernels quantizing (EPILORA_VLLM_QUANTIZE=kernels);
in the default `codes` mode the GEMM streams its weights from its start, and the shrink's best
settings differ (docs/kernels.md).

It runs while vLLM wraps the model for LoRA, when the case's first layer gets its adapter
buffers, before that case's compiles are queued (`epilora_vllm.precompile`: they compile the
tuned settings), and vLLM waits for it: the tuner times CUDA graphs, and a capture running
beside vLLM's main thread broke vLLM's own compile there (PyTorch's CUDA random generator is
registered with a capture for the whole process: Inductor's random inputs then failed with
"Offset increment outside graph capture", on the H200 at e2fb500). It runs in a thread of its
own (vLLM's sleep mode routes the main thread's allocations to its weights pool, as
`forward.size_workspace` explains), its candidates compiled first in threads of the engine's
process or, with EPILORA_VLLM_TUNE_COMPILE=processes, in worker processes started as commands
(vLLM's engine core is a daemonic process, which multiprocessing may not start children from).
"""

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from epilora_vllm import _env

logger = logging.getLogger("vllm.epilora_vllm")

COMPILE_THREADS = 8


def compile_processes() -> int:
    """The compile workers of EPILORA_VLLM_TUNE_COMPILE=processes: half the CPUs this process
    may use (the others' engine ranks tune beside it), 2 to 8."""
    import os

    return min(8, max(2, len(os.sched_getaffinity(0)) // 2))


def needed(forward) -> bool:
    """Whether `forward`'s layer would use tuned decode settings it does not have yet: on a GPU
    with the decode path (sm_90), a mode that takes it, and a shape not tuned already."""
    import epilora_kernels as ek
    from epilora_kernels import tuner

    layer, lora, mode = forward.layer, forward.lora, forward.mode
    if layer.device.type != "cuda" or mode.matched or mode.path not in (None, "decode"):
        return False
    if not ek.device_support(layer.device).pdl:
        return False
    return tuner.needs_tuning(lora.out_features, lora.in_features, lora.max_rank,
                              slots=lora.max_loras, codes=mode.vllm_quantizes,
                              device=layer.device)


_tried: set[tuple] = set()  # the cases this process tuned, or tried to (a failure: once)


def tune(forward) -> None:
    """Tune `forward`'s projection case on its layer's GPU, in a thread of its own while the
    caller waits, once per case in a process; log what it cost and found. A failure says why
    and leaves the settings as they were."""
    lora, mode = forward.lora, forward.mode
    case = (str(forward.layer.device), lora.in_features, tuple(lora.output_slices),
            lora.max_rank, lora.max_loras, mode.vllm_quantizes)
    if case in _tried:
        return
    # bad values stop the start here, saying why
    budget_s, compile_in = _env.tune_budget_s(), _env.tune_compile()
    _tried.add(case)
    with ThreadPoolExecutor(1, thread_name_prefix="epilora-tune") as thread:
        thread.submit(_tune, forward, budget_s, compile_in).result()


def _tune(forward, budget_s: float, compile_in: str) -> None:
    from epilora_kernels import tuner

    # vLLM's codes given (`codes` and `vllm` modes): K2 streams from its start, whether the
    # shrink reads the codes or x; the tuner times that regime with the codes alone.
    lora, codes = forward.lora, forward.mode.vllm_quantizes
    case = f"{lora.out_features}x{lora.in_features} r{lora.max_rank} l{lora.max_loras}" + (
        " on codes" if codes else "")
    where = ({"jobs": compile_processes()} if compile_in == "processes"
             else {"compile_threads": COMPILE_THREADS})
    begin = time.perf_counter()
    try:
        with torch.cuda.device(forward.layer.device):
            # 1-32 tokens, not the library's default, which adds one slot's 64: its compiles
            # (about 29% more launches) inside a case's start budget are not measured yet
            report = tuner.tune_decode(
                {case: (lora.in_features, tuple(lora.output_slices))}, rank=lora.max_rank,
                slots=lora.max_loras, tokens=tuner.DECODE_BUCKETS, codes=codes,
                budget_s=budget_s,
                progress=logger.debug, **where)
            # the candidates' buffers and graphs back to the GPU before vLLM sizes its cache
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - an optimization: the shipped settings serve
        logger.warning("epilora tune: %s stopped (%s: %s); the shipped settings serve it",
                       case, type(e).__name__, str(e)[:300])
        return
    cells = report["cells"]
    if not cells:  # nothing written: the next start tries again
        logger.warning("epilora tune: %s found nothing within %.0f s (compiles %.1f s); the "
                       "shipped settings serve it and the next start tunes again "
                       "(EPILORA_VLLM_TUNE=0: never; EPILORA_VLLM_TUNE_BUDGET_S: more time)", case,
                       budget_s, report["compile_s"])
        return
    faster = [c["after_us"] / c["before_us"] for c in cells if c["before_us"]]
    swapped = sum(c["k2"].get("swap_ab", False) for c in cells)
    compiled_in = (f"{where['jobs']} processes" if "jobs" in where
                   else f"{where['compile_threads']} threads")
    logger.info("epilora tune: %s in %.1f s (compiles %.1f s in %s, %d failed; %s): %d token "
                "buckets, the decode path %.3f of its time before (mean; best %.3f); K2 swapped "
                "in %d; %d candidates refused or failed", case,
                time.perf_counter() - begin, report["compile_s"], compiled_in,
                len(report.get("compile_errors", [])),
                "complete" if report["complete"] else "budget reached", len(cells),
                sum(faster) / len(faster) if faster else 1.0, min(faster, default=1.0), swapped,
                len(report.get("failed", [])))
