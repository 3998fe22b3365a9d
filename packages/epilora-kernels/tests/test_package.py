import subprocess
import sys

import epilora_kernels


def test_version_matches_metadata():
    from importlib.metadata import version

    assert epilora_kernels.__version__ == version("epilora-kernels")


def test_import_has_no_side_effects():
    # Importing the package must neither initialize CUDA nor pull in vLLM or Triton.
    code = (
        "import sys, epilora_kernels, torch; "
        "assert not torch.cuda.is_initialized(); "
        "assert 'vllm' not in sys.modules, 'vllm imported'; "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
