"""vLLM 0.26.0's Punica op tests (`tests/lora/test_punica_ops.py`) on epilora-kernels' shrink and
expand: vLLM's test functions, data, references and tolerances unchanged, its `triton_ops`
module rebound to `vllm_suite.EpiloraPunicaOps` (vLLM's metadata and weights handed to the
kernels as they are).

On a GPU (marked `gpu`) vLLM's two grids whole: `test_kernels` (1-32 sequences of 128 tokens,
1-128 adapters, ranks 1-256, 1-3 slices, 2049 features) and `test_kernels_hidden_size` (vLLM's
list of models' hidden sizes at tensor-parallel fractions, rank 32); fp16 cases and ranks above
the kernels' largest are skipped with the reason. On a CPU, where the kernels' torch twins
compute, a subset of the first grid. Beside them, what vLLM's grids leave out, on both: tokens
without an adapter and an expand that does not add."""

import pytest
import torch
from vllm_suite import EpiloraPunicaOps, load_punica_ops, reset_default_device  # noqa: F401

pt = load_punica_ops()
ON_GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.vllm, *([pytest.mark.gpu] if ON_GPU else [])]

GRID = pt.test_params if ON_GPU else {"hidden_sizes": [2049], "batches": [1, 4],
                                      "num_loras": [1, 8], "max_ranks": [1, 16, 64, 256]}


@pytest.fixture(autouse=True)
def epilora_ops(monkeypatch):
    monkeypatch.setattr(pt, "triton_ops", EpiloraPunicaOps())
    if not ON_GPU:  # vLLM's test selects its device as an accelerator's, which a CPU is not
        monkeypatch.setattr(torch.accelerator, "set_device_index", lambda device: None)


@pytest.mark.usefixtures("reset_default_device")
@pytest.mark.parametrize("batches", GRID["batches"])
@pytest.mark.parametrize("num_loras", GRID["num_loras"])
@pytest.mark.parametrize("rank", GRID["max_ranks"])
@pytest.mark.parametrize("hidden_size", GRID["hidden_sizes"])
@pytest.mark.parametrize("nslices", [1, 2, 3])
@pytest.mark.parametrize("dtype", pt.DTYPES)
@pytest.mark.parametrize("op_type", ["shrink", "expand"])
def test_kernels(batches, num_loras, rank, hidden_size, nslices, dtype, op_type):
    pt.test_kernels(batches, num_loras, rank, hidden_size, nslices, dtype, pt.DEVICES[0],
                    pt.SEED[0], op_type)


def _without_adapter(generate, sequences):
    # vLLM's data with its first `sequences` sequences' tokens given no adapter (-1), in the
    # metadata and in its reference's per-sequence mapping (which skips them): vLLM's own data
    # gives every token one.
    def generated(*args, **kwargs):
        data = generate(*args, **kwargs)
        count = min(sequences, data.seq_len_tensor.numel())
        data.prompt_lora_mapping[:count] = -1
        data.token_lora_mapping[:int(data.seq_len_tensor[:count].sum())] = -1
        return data

    return generated


@pytest.mark.usefixtures("reset_default_device")
@pytest.mark.parametrize(("op_type", "sequences", "add_inputs"), [
    ("shrink", 1, None), ("shrink", 4, None),
    ("expand", 1, True), ("expand", 1, False), ("expand", 4, False)])
def test_tokens_without_an_adapter_and_an_expand_that_does_not_add(monkeypatch, op_type,
                                                                  sequences, add_inputs):
    # What vLLM's grids leave out: tokens without an adapter (one sequence of four, or all four:
    # vLLM's ops then return at once) and an expand that writes its product alone. vLLM's
    # checks and references, on a subset of test_kernels' shapes (three slices of 2049).
    monkeypatch.setattr(pt, "generate_data_for_nslices",
                        _without_adapter(pt.generate_data_for_nslices, sequences))
    torch.set_default_device(pt.DEVICES[0])
    common = dict(batches=4, num_loras=8, rank=16, hidden_size=2049, nslices=3,
                  dtype=torch.bfloat16, device=pt.DEVICES[0], seq_length=32)
    if op_type == "shrink":
        pt.check_lora_shrink_kernel(**common, scaling=0.5)
    else:
        pt.check_lora_expand_kernel(**common, add_inputs=add_inputs)


if ON_GPU:  # vLLM's hidden-size grid (2,700 cases): the GPU session's
    @pytest.mark.usefixtures("reset_default_device")
    @pytest.mark.parametrize("hidden_size", sorted(pt.hs_test_params["hidden_sizes"]))
    @pytest.mark.parametrize("nslices", [1, 2, 3])
    @pytest.mark.parametrize("dtype", pt.DTYPES)
    @pytest.mark.parametrize("op_type", ["shrink", "expand"])
    def test_kernels_hidden_size(hidden_size, nslices, dtype, op_type):
        params = pt.hs_test_params
        pt.test_kernels_hidden_size(params["batches"][0], params["num_loras"][0],
                                    params["max_ranks"][0], hidden_size, nslices, dtype,
                                    pt.DEVICES[0], pt.SEED[0], op_type)
