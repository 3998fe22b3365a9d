"""The environment variables epilora-kernels reads, all here, read at call time (not import)."""

import os


def triton_interpreter() -> bool:
    """TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
