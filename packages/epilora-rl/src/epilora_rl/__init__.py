"""epilora-rl: GRPO LoRA training on the serving engine's own FP8 weights.

Status: skeleton. No trainer is implemented yet.
"""

__version__ = "0.1.0"
__all__: list[str] = []
