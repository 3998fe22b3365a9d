"""The kernels' tuner at engine start (EPILORA_VLLM_TUNE=1, the default; 0 off).

For each projection case a served layer belongs to (shape, adapter rank and slots, and whether
the shrink reads vLLM's codes), `epilora_kernels.tuner.tune_decode` times the decode path's
launch settings on the GPU at the decode token buckets and writes the winners into the kernels'
cache (per GPU and versions, in the user's cache directory), unless the shipped table or an
earlier start's cache already holds settings tuned on that very shape: a later start tunes
nothing. It runs in `epilora_vllm.precompile`'s background thread, first in each case's job, so
the compiles that follow are of the tuned settings; its candidates compile in that thread's
process (threads, no processes spawned inside vLLM's worker). The shipped table was tuned with
the kernels quantizing (EPILORA_VLLM_QUANTIZE=kernels); in the default `codes` mode the GEMM
streams its weights from its start, and the shrink's best settings differ (docs/kernels.md).
"""

import logging
import time

import torch

logger = logging.getLogger("vllm.epilora_vllm")

BUDGET_S = 30.0  # per projection case: the whole search's bound, compiles included
COMPILE_THREADS = 8


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
    return not tuner.tuned(lora.out_features, lora.in_features, lora.max_rank,
                           slots=lora.max_loras, codes=mode.shrink_codes, device=layer.device)


def tune(forward) -> None:
    """Tune `forward`'s projection case (in the calling thread, on its layer's GPU) and log
    what it cost and found; a failure says why and leaves the settings as they were."""
    from epilora_kernels import tuner

    lora, codes = forward.lora, forward.mode.shrink_codes
    case = f"{lora.out_features}x{lora.in_features} r{lora.max_rank} l{lora.max_loras}" + (
        " on codes" if codes else "")
    begin = time.perf_counter()
    try:
        with torch.cuda.device(forward.layer.device):
            report = tuner.tune_decode(
                {case: (lora.in_features, tuple(lora.output_slices))}, rank=lora.max_rank,
                slots=lora.max_loras, codes=codes, budget_s=BUDGET_S,
                compile_threads=COMPILE_THREADS, progress=logger.debug)
    except Exception as e:  # noqa: BLE001 - an optimization: the shipped settings serve
        logger.warning("epilora tune: %s stopped (%s: %s); the shipped settings serve it",
                       case, type(e).__name__, str(e)[:300])
        return
    finally:  # the candidates' buffers and graphs back to the GPU before vLLM sizes its cache
        torch.cuda.empty_cache()
    cells = report["cells"]
    faster = [c["after_us"] / c["before_us"] for c in cells if c["before_us"]]
    logger.info("epilora tune: %s in %.1f s (compiles %.1f s, %s): %d token buckets, the decode "
                "path %.3f of its time before (mean; best %.3f)", case,
                time.perf_counter() - begin, report["compile_s"],
                "complete" if report["complete"] else "budget reached", len(cells),
                sum(faster) / len(faster) if faster else 1.0, min(faster, default=1.0))
