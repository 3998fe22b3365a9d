"""The environment variables epilora-kernels reads, all here, read at call time (not import)."""

import os


def triton_interpreter() -> bool:
    """TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_tables() -> bool:
    """EPILORA_LAUNCH_TABLES=0: ignore the shipped launch tables, every launch setting from the
    heuristic (how the benchmarks measure it alone; default 1)."""
    return os.environ.get("EPILORA_LAUNCH_TABLES", "1") != "0"
