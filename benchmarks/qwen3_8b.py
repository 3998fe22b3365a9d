"""The benchmarks' model: one Qwen3-8B decoder layer's four projections (no torch: the docs
renderers read it too)."""

PROJECTIONS = {  # name: (K, output slices)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (12288, 12288)),
    "down": (12288, (4096,)),
}


def weight_bytes() -> int:
    """The layer's FP8 weights, one byte each."""
    return sum(k * sum(slices) for k, slices in PROJECTIONS.values())


def adapter_bytes(rank: int) -> int:
    """One adapter's bf16 A (rank x K per output slice) and B (each slice's width x rank)."""
    return sum(2 * rank * (k * len(slices) + sum(slices)) for k, slices in PROJECTIONS.values())
