import subprocess
import sys


def test_import_touches_neither_triton_vllm_nor_cuda():
    code = (
        "import sys, epilora_quant, torch; "
        "assert not torch.cuda.is_initialized(); "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
