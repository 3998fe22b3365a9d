"""The GRPO loop on the H200: the engine's matched mode on epilora-kernels' W8A16 kernel, the
trainer's linear on its Triton kernels, two steps from rollout to the next rollout on the
published adapter (the CPU test's checks, tests/train_cases.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from train_cases import check_two_steps, tiny_fp8_model  # noqa: E402

pytestmark = pytest.mark.vllm


def test_two_steps_on_the_gpu(tmp_path):
    run = check_two_steps(tiny_fp8_model(tmp_path), tmp_path)
    assert all(r["peak_gpu_gib"] is not None for r in run.records)
    assert next(iter(run.params.values())).is_cuda
