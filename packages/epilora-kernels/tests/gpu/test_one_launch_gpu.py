"""The decode path in one launch on the H200 (EPILORA_DECODE_ONE_LAUNCH=1): K2 whose first
programs are the shrink's, its GEMM programs waiting for their count before the epilogue.

On integer-valued operands every fp32 sum is exact, so the one launch (the shrink in its own
settings, split otherwise than K1's) must give the two launches' bits."""

import pytest
import torch

import epilora_kernels as ek
from epilora_kernels import fused, launch
from epilora_testing import assert_bitwise_equal
from epilora_testing.cuda_graphs import capture

from kernel_cases import make_integer_problem

CUDA = "cuda"
# Qwen3-8B's projections: (K, output slices)
SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
          "gate_up": (4096, (12288, 12288)), "down": (12288, (4096,))}


def _calls(seed, tokens, shape, mapping, swapped, operands):
    # One projection's operands and its call (bf16 x beside the codes, or the codes alone).
    k, slices = SHAPES[shape]
    x, codes, scales, weight, w_scale, _, lora, batch = make_integer_problem(
        seed, tokens, k, slices, 64, 1, mapping, device=CUDA)
    k2 = None
    if swapped:
        cfg = fused.decode_settings(x, weight, w_scale, lora, batch, codes=True)[1]
        k2 = launch.swap_candidate(cfg, sum(slices), k, slices, tokens)
        assert k2.swap_ab

    def call(projection=None):
        given = x if operands == "x+codes" else None
        if projection is not None:
            return projection(given, batch, path="decode", x_quantized=(codes, scales))
        return ek.decode_lora_fp8_linear(given, weight, w_scale, lora, batch,
                                         x_quantized=(codes, scales), k2_config=k2)

    return call, (weight, w_scale, lora)


@pytest.mark.parametrize("operands", ["codes", "x+codes"])
@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("tokens", [1, 4, 16, 32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_launch_gives_the_two_launches_bits(shape, tokens, swapped, operands,
                                                monkeypatch):
    mapping = "one_adapter" if tokens % 2 else "mixed_with_base"
    call, _ = _calls(31, tokens, shape, mapping, swapped, operands)
    want = call()
    monkeypatch.setenv("EPILORA_DECODE_ONE_LAUNCH", "1")
    workspace = ek.default_workspace(CUDA)
    for _ in range(3):
        assert_bitwise_equal(call(), want, name=f"one launch, {shape} at {tokens} tokens")
    torch.cuda.synchronize()
    assert workspace.is_clean()


def test_one_launch_stress_in_a_cuda_graph(monkeypatch):
    # Back to back, as an engine's decode step: the four projections at 1, 4, 16 and 32 tokens
    # in one CUDA graph on one workspace (each launch's GEMM programs spin on the count its
    # shrink programs release, and the last of them zeroes it for the next launch), replayed
    # 300 times: every output the bits of the two launches, the counters at rest.
    cases = [(shape, tokens) for tokens in (1, 4, 16, 32) for shape in SHAPES]
    calls = [_calls(40 + i, tokens, shape, "one_adapter" if tokens % 2 else "mixed_with_base",
                    i % 2 == 1, "codes") for i, (shape, tokens) in enumerate(cases)]
    wants = [call() for call, _ in calls]
    monkeypatch.setenv("EPILORA_DECODE_ONE_LAUNCH", "1")
    workspace = ek.Workspace.for_batches(CUDA, max_tokens=32, max_out_features=24576,
                                         max_rank=64, max_loras=1)
    projections = [ek.LoraProjection(*tensors, workspace=workspace) for _, tensors in calls]
    # the projections take their own settings (swapped or not): the same bits on these operands
    graph, outs = capture(lambda: [call(projection) for (call, _), projection
                                   in zip(calls, projections, strict=True)])
    for replay in range(300):
        graph.replay()
        if replay % 50 == 49:
            torch.cuda.synchronize()
            for (shape, tokens), out, want in zip(cases, outs, wants, strict=True):
                assert_bitwise_equal(out, want, name=f"replay {replay}: {shape}, {tokens}")
    torch.cuda.synchronize()
    assert workspace.is_clean()
