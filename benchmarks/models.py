"""The benchmarks' models: one decoder layer's four projections of each (no torch: the docs
renderers read it too). Shapes from each model's config.json: hidden size, intermediate size,
attention heads and KV heads of 128 dimensions."""


def decoder_layer(hidden: int, intermediate: int, heads: int, kv_heads: int,
                  head_dim: int = 128) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{projection: (K, output slices)} of one decoder layer (vLLM's fused qkv and gate_up)."""
    return {"qkv": (hidden, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)),
            "o": (heads * head_dim, (hidden,)),
            "gate_up": (hidden, (intermediate, intermediate)),
            "down": (intermediate, (hidden,))}


MODELS = {
    "qwen3-8b": decoder_layer(4096, 12288, 32, 8),
    "llama3.1-8b": decoder_layer(4096, 14336, 32, 8),
    "qwen2.5-7b": decoder_layer(3584, 18944, 28, 4),
}
PROJECTIONS = MODELS["qwen3-8b"]  # the model the kernels were first tuned on


def weight_bytes(projections: dict = PROJECTIONS) -> int:
    """The layer's FP8 weights, one byte each."""
    return sum(k * sum(slices) for k, slices in projections.values())


def adapter_bytes(rank: int, projections: dict = PROJECTIONS) -> int:
    """One adapter's bf16 A (rank x K per output slice) and B (each slice's width x rank)."""
    return sum(2 * rank * (k * len(slices) + sum(slices)) for k, slices in projections.values())
