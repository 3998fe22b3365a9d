# engine_cases.py (shared by these tests and tests/gpu/) is imported by name; pytest's importlib
# mode does not put test folders on sys.path.
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny FP8 and bf16 checkpoints and two adapters (engine_cases.make_checkpoints)."""
    from engine_cases import make_checkpoints

    return make_checkpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def served(checkpoints):
    """An eager FP8 engine with the plugin and layer 0's recorded calls (serve_and_record)."""
    from engine_cases import serve_and_record

    return serve_and_record(checkpoints, enforce_eager=True)
