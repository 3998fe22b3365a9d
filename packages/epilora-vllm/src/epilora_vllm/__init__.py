"""epilora-vllm: the vLLM 0.26 plugin that will serve LoRA tenants through epilora-kernels.

Status: skeleton. The plugin (a `vllm.general_plugins` entry point replacing vLLM's LoRA
linear layers) is not written yet, so no entry point is declared and installing this package
changes nothing in vLLM.
"""

__version__ = "0.1.0"
__all__: list[str] = []
