"""epilora-rl: GRPO LoRA training on the serving engine's own FP8 weights.

Status: skeleton. No trainer is implemented yet.
"""

__all__: list[str] = []


def __getattr__(name: str):
    if name == "__version__":  # the version lives in pyproject.toml only
        from importlib.metadata import version

        return version("epilora-rl")
    raise AttributeError(f"module 'epilora_rl' has no attribute {name!r}")
