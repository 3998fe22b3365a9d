"""epilora-rl: GRPO LoRA training on the serving engine's own FP8 weights.

The training linear (`fp8_lora_linear`, `Fp8LoraLinear`): the matched engine's W8A16 forward
on FP8 weights the engine owns, with a backward through the frozen codes and the adapter
(Triton on the GPU, `epilora_rl.reference` twins on the CPU). The model over the engine's
tensors (`epilora_rl.model`), GRPO's objective (`epilora_rl.grpo`), the loop
(`epilora_rl.trainer`) and the CLI (`epilora-rl train --config run.toml`) are its submodules.
"""

from typing import TYPE_CHECKING

_PUBLIC = {"epilora_rl.linear": ("Bf16LoraLinear", "Fp8LoraLinear", "LoraLinear",
                                 "fp8_lora_linear")}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = ["Bf16LoraLinear", "Fp8LoraLinear", "LoraLinear", "fp8_lora_linear"]

if TYPE_CHECKING:
    from epilora_rl.linear import Bf16LoraLinear, Fp8LoraLinear, LoraLinear, fp8_lora_linear


def __getattr__(name: str):
    if name == "__version__":  # the version lives in pyproject.toml only
        from importlib.metadata import version

        return version("epilora-rl")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'epilora_rl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
