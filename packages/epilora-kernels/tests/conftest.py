"""Without a GPU, the kernels run in Triton's interpreter: it must be chosen before the kernels'
module is imported (triton.jit reads TRITON_INTERPRET when it decorates)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# kernel_cases.py (shared by these tests and tests/gpu/) is imported by name; pytest's importlib
# mode does not put test folders on sys.path.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_user_tuner_cache(tmp_path_factory, monkeypatch):
    # The launchers overlay the user's tuner cache on the shipped tables: tests see neither a
    # cache of this machine's user nor one another's.
    from epilora_kernels import launch

    monkeypatch.setenv("EPILORA_CACHE_DIR", str(tmp_path_factory.mktemp("tuner-cache")))
    launch.clear_table_cache()
    yield
    launch.clear_table_cache()
