"""epilora-kernels: Triton kernels for multi-adapter LoRA on FP8 bases.

The fused path (K1: quantize + shrink; K2: FP8 GEMM with the adapters' up-projection in its
epilogue), the W8A16 path and the hybrid kernels are in `epilora_kernels.fused`, their torch
twins in `epilora_kernels.reference`, the inputs in `epilora_kernels.batch`; the paths as torch
custom ops (one node to torch.compile) in `epilora_kernels.ops`, registered when it is imported.
Correct and tested (CPU interpreter and H200); the status of the performance targets is in
docs/kernels.md. This package imports neither vLLM nor epilora-vllm; importing it compiles
nothing.
"""

__version__ = "0.1.0"
__all__: list[str] = []
