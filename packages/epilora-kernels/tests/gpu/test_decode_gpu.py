"""The decode path on the H200: K1, then K2 as its programmatic dependent (PDL), waiting for K1's
count of quantized rows before its K loop and for K1 before its epilogue. Its output must equal
the same kernels serialized and the fused path bit for bit, run to run, and inside a CUDA graph
(where the launch becomes a programmatic edge), and leave the shared counters at zero. The fused
path launched with PDL (K2 waiting for all of K1 first) must equal its serialized launch."""

import pytest
import torch

from epilora_kernels import fused, reference, workspace
from epilora_kernels.launch import LaunchConfig, rank_block
from epilora_testing import assert_bitwise_equal
from epilora_testing.cuda_graphs import capture

from kernel_cases import make_problem, relative_error

CASES = [  # (tokens, K, slices, rank, max_loras)
    (1, 4096, (4096, 1024, 1024), 64, 4),
    (4, 4096, (4096,), 16, 4),
    (16, 4096, (2048, 2048), 128, 4),
    (32, 2048, (1024,), 64, 32),
    (64, 2048, (1024, 1024), 128, 4),  # beyond DECODE_SHRINK_MAX_TOKENS: the fused K1 settings
]


def _assert_counters_at_rest():
    # Every stream's buffer (the graph's capture stream has its own).
    for key, ws in workspace._defaults.items():
        assert ws.is_clean(), (key, ws.counters(0).nonzero().flatten().tolist()[:8])


def _assert_graph_replays_equal(fn, want, replays: int, name: str = "graph replay"):
    # fn captured in a CUDA graph (PDL launches become programmatic edges), replayed.
    graph, out = capture(fn)
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, want, name=name)
        _assert_counters_at_rest()


def _k2_config(split_k: int | None, rank: int):
    # None: the launch table's (or the heuristic's) choice; else a decode tile with split-K.
    if split_k is None:
        return None
    return LaunchConfig(block_m=16, block_n=64, block_k=256, block_r=max(16, rank),
                        split_k=split_k, num_stages=4)


@pytest.mark.parametrize("split_k", [None, 1, 4], ids=lambda s: f"split{s or 'auto'}")
@pytest.mark.parametrize("shape", CASES, ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}")
def test_decode_equals_serialized_and_fused_bitwise(shape, split_k):
    t, k, slices, rank, max_loras = shape
    x, weight, w_scale, lora, batch = make_problem(0, t, k, slices, rank, max_loras,
                                                   "one_token_each", device="cuda")
    k2 = _k2_config(split_k, rank)
    decode = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=True,
                                          k2_config=k2)
    serialized = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=False,
                                              k2_config=k2)
    assert_bitwise_equal(decode, serialized, name="decode vs serialized")
    # The fused path with the same K1 split (the paths' tables may choose different ones).
    k1 = LaunchConfig(block_m=16, block_k=256, block_r=rank_block(rank), split_k=4,
                      num_stages=2)
    fused_y = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1,
                                          k2_config=k2)
    decode_k1 = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1,
                                             k2_config=k2)
    assert_bitwise_equal(decode_k1, fused_y, name="decode vs fused")
    for _ in range(10):  # a race in the counters would show as a changed bit
        again = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=True,
                                             k2_config=k2)
        assert_bitwise_equal(again, decode, name="repeat")
    torch.cuda.synchronize()
    _assert_counters_at_rest()
    want = reference.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert relative_error(decode, want) < 1e-2


@pytest.mark.parametrize("split_k", [None, 4], ids=lambda s: f"split{s or 'auto'}")
def test_decode_in_a_cuda_graph_equals_eager(split_k):
    x, weight, w_scale, lora, batch = make_problem(1, 8, 4096, (4096, 1024, 1024), 64, 4,
                                                   "mixed_with_base", device="cuda")
    k2 = _k2_config(split_k, 64)
    eager = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=k2)
    _assert_graph_replays_equal(
        lambda: fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=k2),
        eager, 5)


@pytest.mark.parametrize("shape", [*CASES, (256, 4096, (4096, 1024, 1024), 128, 1)],
                         ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}")
def test_fused_path_with_pdl_equals_serialized_bitwise(shape):
    # The fused path launches K2 as K1's programmatic dependent, waiting for all of K1 before
    # its K loop: the bits of the serialized launch, eager and replayed in a CUDA graph.
    t, k, slices, rank, max_loras = shape
    x, weight, w_scale, lora, batch = make_problem(2, t, k, slices, rank, max_loras,
                                                   "mixed_with_base", device="cuda")
    serialized = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=False)
    for _ in range(5):
        eager = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=True)
        assert_bitwise_equal(eager, serialized, name="fused with PDL vs serialized")
    _assert_graph_replays_equal(
        lambda: fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch), serialized, 3)


# One adapter slot on the layer's shapes, as the decode benchmark runs them (K2's one-slot
# epilogue, the launch table's settings: split-K K2 tiles at 4-8 tokens, down's 12288-wide rows).
ONE_ADAPTER = [(4, 4096, (4096, 1024, 1024), 128), (8, 4096, (4096, 1024, 1024), 128),
               (4, 12288, (4096,), 64), (8, 4096, (12288, 12288), 128)]


@pytest.mark.parametrize("shape", ONE_ADAPTER,
                         ids=lambda s: f"T{s[0]}-K{s[1]}-N{sum(s[2])}-r{s[3]}")
def test_decode_with_one_adapter_on_the_layers_shapes(shape):
    t, k, slices, rank = shape
    x, weight, w_scale, lora, batch = make_problem(4, t, k, slices, rank, 1, "one_adapter",
                                                   device="cuda")
    serialized = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=False)
    for _ in range(5):
        eager = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
        assert_bitwise_equal(eager, serialized, name="decode vs serialized")
    _assert_graph_replays_equal(
        lambda: fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch), serialized, 3)
    want = reference.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert relative_error(serialized, want) < 1e-2


def test_decode_op_compiled_and_in_a_cuda_graph_equals_the_function():
    # The decode path as a torch custom op (epilora_kernels.ops), compiled whole the way a
    # compiled model would call it and captured in a CUDA graph: the function's eager bits.
    import epilora_kernels.ops as ops

    x, weight, w_scale, lora, batch = make_problem(1, 8, 4096, (4096, 1024, 1024), 64, 4,
                                                   "mixed_with_base", device="cuda")
    eager = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    compiled = torch.compile(lambda x: ops.decode_lora_fp8_linear(x, weight, w_scale, lora,
                                                                  batch),
                             backend="aot_eager", fullgraph=True)
    assert_bitwise_equal(compiled(x), eager, name="compiled op")
    _assert_graph_replays_equal(lambda: compiled(x), eager, 3, name="compiled op, graph replay")


# The decode path's K1 beyond 32 tokens from tune_layer.py's candidates: few programs over 32-64
# rows and the whole rank (or 64 of it), K2 started beside them.
PREFILL_K1 = [LaunchConfig(block_m=64, block_k=128, block_r=128, split_k=4, num_warps=8),
              LaunchConfig(block_m=64, block_k=64, block_r=128, split_k=1, num_stages=3),
              LaunchConfig(block_m=32, block_k=128, block_r=64, split_k=8)]


@pytest.mark.parametrize("k1", PREFILL_K1, ids=lambda c: f"{c.block_m}x{c.block_r}s{c.split_k}")
@pytest.mark.parametrize("t", [64, 256])
def test_decode_path_beyond_32_tokens_with_few_k1_programs(t, k1):
    x, weight, w_scale, lora, batch = make_problem(3, t, 4096, (4096, 1024, 1024), 128, 4,
                                                   "mixed_with_base", device="cuda")
    serialized = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=False,
                                              k1_config=k1)
    for _ in range(5):
        eager = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1)
        assert_bitwise_equal(eager, serialized, name="decode vs serialized")
    assert_bitwise_equal(fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                     k1_config=k1), serialized,
                         name="decode vs fused")
    _assert_graph_replays_equal(
        lambda: fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1),
        serialized, 3)
    want = reference.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert relative_error(serialized, want) < 1e-2
