"""Every vLLM name the plugin uses, in one place: the one module to change for another vLLM.

The plugin is written against vLLM 0.26.0's Python sources (its LoRA layer classes, Punica
metadata, FP8 linear kernels, forward context and custom-op helper); `check_version` refuses
another minor version with the reason, rather than serve it with internals it was not tested on.
"""

SUPPORTED = ("0.26.",)


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_version() -> str | None:
    """None when the installed vLLM is one the plugin serves, else why not."""
    try:
        version = vllm_version()
    except ImportError as e:
        return f"vLLM is not importable ({e})"
    if not version.startswith(SUPPORTED):
        return (f"vLLM {version} is installed; epilora-vllm serves vLLM "
                f"{' or '.join(v + 'x' for v in SUPPORTED)} only")
    return None
