"""Import hygiene: importing a package must do no work (no CUDA init, no heavy imports)."""

import subprocess
import sys


def assert_clean_import(module: str, forbidden: tuple[str, ...] = ("vllm", "triton")) -> None:
    """Import `module` in a fresh interpreter; fail if CUDA got initialized or any of
    `forbidden` got imported along with it."""
    code = (
        f"import sys, torch, {module}; "
        "assert not torch.cuda.is_initialized(), 'CUDA initialized'; "
        f"bad = [m for m in {forbidden!r} if m in sys.modules]; "
        "assert not bad, f'imported: {bad}'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"import {module} is not clean:\n{result.stderr[-2000:]}")
