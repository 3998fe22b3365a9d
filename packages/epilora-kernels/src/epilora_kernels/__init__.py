"""epilora-kernels: Triton kernels for multi-adapter LoRA on low-precision bases.

Status: skeleton. No kernel is implemented yet; the fused, decode and hybrid kernels are the
subject of the open kernels issues. This package will import neither vLLM nor epilora-vllm, and
its kernels will be tested bitwise against epilora-quant.
"""

__version__ = "0.1.0"
__all__: list[str] = []
