"""The environment variables epilora-vllm reads, all here, read at call time (not import).

vLLM's own `VLLM_PLUGINS` (a comma-separated allowlist of plugin names; ours is `epilora`)
also turns the plugin off: vLLM then never calls `register`.
"""

import os


def disabled() -> bool:
    """EPILORA_VLLM_DISABLE=1: `register` does nothing, every layer stays vLLM's own."""
    return os.environ.get("EPILORA_VLLM_DISABLE", "0") == "1"


def matched() -> bool:
    """EPILORA_VLLM_MATCHED=1: the matched mode, every layer the plugin serves computes W8A16
    (bf16 activations, the FP8 weight widened in registers, fp32 accumulation): the RL
    trainer's arithmetic, with or without an adapter."""
    return os.environ.get("EPILORA_VLLM_MATCHED", "0") == "1"


def path() -> str | None:
    """EPILORA_VLLM_PATH=decode|fused|hybrid|w8a16: one path for every batch (benchmarks and
    debugging; default: the kernels' dispatcher picks per batch)."""
    return os.environ.get("EPILORA_VLLM_PATH") or None
