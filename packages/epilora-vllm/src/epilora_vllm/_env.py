"""The environment variables epilora-vllm reads, all here, read at call time (not import).

vLLM's own `VLLM_PLUGINS` (a comma-separated allowlist of plugin names; ours are `epilora`, the
layers, and `epilora-server`, the server's middlewares, which vLLM loads only when named) also
turns the plugin off: vLLM then never calls `register`.
"""

import os


def disabled() -> bool:
    """EPILORA_VLLM_DISABLE=1: `register` does nothing, every layer stays vLLM's own."""
    return os.environ.get("EPILORA_VLLM_DISABLE", "0") == "1"


def matched() -> bool:
    """EPILORA_VLLM_MATCHED=1: the matched mode, every layer the plugin serves computes W8A16
    (bf16 activations, the FP8 weight widened in registers, fp32 accumulation): the RL
    trainer's arithmetic, with or without an adapter; and vLLM's own FP8 linears take the
    plugin's W8A16 kernel (`epilora_vllm.matched_linear`)."""
    return os.environ.get("EPILORA_VLLM_MATCHED", "0") == "1"


def path() -> str | None:
    """EPILORA_VLLM_PATH=decode|fused|hybrid|w8a16: one path for every batch (benchmarks and
    debugging; default: the kernels' dispatcher picks per batch)."""
    return os.environ.get("EPILORA_VLLM_PATH") or None


QUANTIZE_MODES = ("codes", "vllm", "kernels")


def quantize() -> str:
    """EPILORA_VLLM_QUANTIZE: who quantizes a served layer's activations on the GPU, and what
    the adapters' shrink reads.

    * `codes` (default): vLLM's own per-token quantization (the layer's QuantFP8) runs before
      the op, which takes its codes and scales only; the shrink reads the codes too,
      `h = s_t (q_t A^T)`. Nothing but the quantization reads the bf16 activations, so vLLM's
      compiler fuses it into the RMSNorm or SiLU before, as without LoRA.
    * `vllm`: vLLM quantizes as in `codes`; the shrink reads the bf16 activations (stock
      vLLM's LoRA arithmetic), which keeps the RMSNorm's bf16 output alive: vLLM's compiler
      then makes the quantization a kernel of its own.
    * `kernels`: the kernels' K1 quantizes the bf16 activations (bit for bit as vLLM) and
      shrinks them.
    """
    value = os.environ.get("EPILORA_VLLM_QUANTIZE", "codes")
    if value not in QUANTIZE_MODES:
        raise ValueError(f"EPILORA_VLLM_QUANTIZE={value!r}: expected one of {QUANTIZE_MODES}")
    return value


def dispatch() -> str:
    """EPILORA_VLLM_DISPATCH=rule|timed: how a batch's path is chosen where EPILORA_VLLM_PATH
    names none. `rule` (default): the kernels' `choose_path` (thresholds on the batch's size and
    slots, and with several slots at 9-32 tokens the start's tuner's timed choice).
    `timed`: the fastest of the kernels' paths and vLLM's own LoRA kernels, timed per projection
    shape and token bucket on the layer's own weights and batch while the engine starts (vLLM's
    profiling run and its warm-up runs before capturing), and kept on disk
    (`epilora_vllm.dispatch`)."""
    value = os.environ.get("EPILORA_VLLM_DISPATCH", "rule")
    if value not in ("rule", "timed"):
        raise ValueError(f"EPILORA_VLLM_DISPATCH={value!r}: expected 'rule' or 'timed'")
    return value


def precompile() -> bool:
    """EPILORA_VLLM_PRECOMPILE (1, the default; 0 off): compile the kernels each served layer
    will launch at vLLM's CUDA-graph sizes in background threads while the engine starts
    (`epilora_vllm.precompile`)."""
    return _switch("EPILORA_VLLM_PRECOMPILE")


def tune() -> bool:
    """EPILORA_VLLM_TUNE (1, the default; 0 off): tune the decode path's launch settings for
    each projection shape the engine serves that the kernels' table and cache do not have, while
    the engine starts (`epilora_vllm.tuning`)."""
    return _switch("EPILORA_VLLM_TUNE")


def tune_budget_s() -> float:
    """EPILORA_VLLM_TUNE_BUDGET_S (30, the default): the engine-start tuner's bound per
    projection case, in seconds, its candidates' compiles included (`epilora_vllm.tuning`); a
    case cut short keeps the settings it found so far for the buckets it finished."""
    value = os.environ.get("EPILORA_VLLM_TUNE_BUDGET_S", "30")
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"EPILORA_VLLM_TUNE_BUDGET_S={value!r}: expected a positive number "
                         "of seconds")
    return seconds


def tune_compile() -> str:
    """EPILORA_VLLM_TUNE_COMPILE=threads|processes (default threads): where the engine-start
    tuner compiles its candidates before timing them: in 8 threads of the engine's process, or
    in worker processes started as commands (`epilora_kernels._compile_worker`; each makes a
    CUDA context of its own while it runs). Whether the processes are the faster on the H200's
    host (the compiles take most of a case's tuning) is not measured yet: not the default."""
    value = os.environ.get("EPILORA_VLLM_TUNE_COMPILE", "threads")
    if value not in ("threads", "processes"):
        raise ValueError(f"EPILORA_VLLM_TUNE_COMPILE={value!r}: expected 'threads' or "
                         "'processes'")
    return value


def prefetch_bytes() -> int:
    """EPILORA_VLLM_PREFETCH_MIB (0, the default: off): at decode sizes each served projection's
    GEMM pulls up to this many MiB of the next served projection's weight into L2
    (`epilora_kernels.L2Prefetch`: lines of every row; when: EPILORA_VLLM_PREFETCH_AT). Off
    until an H200 run has timed it."""
    value = os.environ.get("EPILORA_VLLM_PREFETCH_MIB", "0")
    if not value.isdigit():
        raise ValueError(f"EPILORA_VLLM_PREFETCH_MIB={value!r}: expected a whole number of MiB")
    return int(value) << 20


def prefetch_at() -> str:
    """EPILORA_VLLM_PREFETCH_AT=end|start (default end): when a GEMM pulls the next layer's
    weight into L2 (with EPILORA_VLLM_PREFETCH_MIB): past its K loop, during the engine's
    kernels between the two GEMMs, or before it, beside its own weight stream
    (`epilora_kernels.L2Prefetch`'s `at`)."""
    value = os.environ.get("EPILORA_VLLM_PREFETCH_AT", "end")
    if value not in ("end", "start"):
        raise ValueError(f"EPILORA_VLLM_PREFETCH_AT={value!r}: expected 'end' or 'start'")
    return value


def _switch(name: str) -> bool:
    # An on/off variable, on unless set to 0; any other value is refused.
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected '0' or '1'")
    return value == "1"


def cache_dir() -> str:
    """EPILORA_CACHE_DIR (as epilora-kernels reads it): the timed dispatch's choices go to its
    `vllm/` folder (default: $XDG_CACHE_HOME/epilora, else ~/.cache/epilora, then `vllm/`)."""
    root = os.environ.get("EPILORA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "epilora")
    return os.path.join(root, "vllm")


def vllm_dual_stream() -> bool:
    """vLLM's own VLLM_LORA_ENABLE_DUAL_STREAM, as vLLM reads it (`vllm.envs`): whether its LoRA
    path runs the shrink on a second stream (the timed dispatch's choices depend on it)."""
    from vllm import envs

    return bool(envs.VLLM_LORA_ENABLE_DUAL_STREAM)
