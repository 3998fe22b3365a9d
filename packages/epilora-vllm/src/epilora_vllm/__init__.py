"""epilora-vllm: the vLLM 0.26 plugin that will serve LoRA tenants through epilora-kernels.

Status: skeleton. The plugin (a `vllm.general_plugins` entry point replacing vLLM's LoRA
linear layers) is not written yet, so no entry point is declared and installing this package
changes nothing in vLLM.
"""

__all__: list[str] = []


def __getattr__(name: str):
    if name == "__version__":  # the version lives in pyproject.toml only
        from importlib.metadata import version

        return version("epilora-vllm")
    raise AttributeError(f"module 'epilora_vllm' has no attribute {name!r}")
