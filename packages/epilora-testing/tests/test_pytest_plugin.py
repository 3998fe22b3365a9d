"""The pytest plugin's gating, run in a child pytest (pytester): a GPU session must not pass by
skipping what it was meant to run."""

import pytest

pytest_plugins = ["pytester"]

# The child session sees a CUDA device and no vLLM, whatever this machine has. It runs in a
# process of its own: in this one, the patches would outlive it (every later vllm-marked test of
# the run skipped as if vLLM were absent).
CONFTEST = """
import importlib.util
import torch

torch.cuda.is_available = lambda: True
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "vllm" else _find_spec(name, *a)
"""
TEST = """
import pytest

@pytest.mark.vllm
def test_needs_vllm():
    pass
"""


@pytest.mark.parametrize(("args", "outcome"), [((), {"skipped": 1}),
                                               (("--require-gpu",), {"errors": 1})])
def test_vllm_gpu_tests_fail_rather_than_skip_under_require_gpu(pytester, args, outcome):
    pytester.makeconftest(CONFTEST)
    pytester.mkdir("gpu")
    (pytester.path / "gpu" / "test_engine.py").write_text(TEST)
    result = pytester.runpytest_subprocess("-p", "epilora", "-p", "no:cacheprovider", *args)
    result.assert_outcomes(**outcome)


def test_vllm_cpu_tests_still_skip_without_vllm_under_require_gpu(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_cpu=TEST)
    pytester.runpytest_subprocess("-p", "epilora", "-p", "no:cacheprovider",
                       "--require-gpu").assert_outcomes(skipped=1)
