"""The paths as torch custom ops (`epilora_kernels.ops`, Triton interpreter): each op returns the
bits of its `fused` function, leaves its inputs unchanged, passes torch's op checks (fake tensor,
autograd registration, AOT dispatch with dynamic shapes) and compiles with torch.compile as one
node, no graph break."""

import pytest
import torch

import epilora_kernels.ops as ops
from epilora_kernels import dispatch, fused
from epilora_testing import assert_bitwise_equal
from epilora_testing.hygiene import assert_clean_import

from kernel_cases import make_problem

PATHS = {  # op wrapper, the function it calls
    "dispatcher": (ops.lora_linear, dispatch.lora_linear),
    "decode": (ops.decode_lora_fp8_linear, fused.decode_lora_fp8_linear),
    "fused": (ops.fused_lora_fp8_linear, fused.fused_lora_fp8_linear),
    "w8a16": (ops.fused_lora_w8a16_linear, fused.fused_lora_w8a16_linear),
}
OPS = {"dispatcher": torch.ops.epilora.lora_linear,
       "decode": torch.ops.epilora.decode_lora_fp8_linear,
       "fused": torch.ops.epilora.fused_lora_fp8_linear,
       "w8a16": torch.ops.epilora.fused_lora_w8a16_linear}


def _problem():
    # Three slices, tokens with and without adapters, two slots.
    return make_problem(3, 9, 64, (32, 16, 16), 16, 2, "mixed_with_base")


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _tensors(args) -> list[torch.Tensor]:
    # The op's tensor arguments, those in lists included, in order.
    flat = [a if isinstance(a, list) else [a] for a in args]
    return [t for a in flat for t in a if isinstance(t, torch.Tensor)]


def _map_tensors(fn, args) -> list:
    return [[fn(t) if isinstance(t, torch.Tensor) else t for t in a] if isinstance(a, list)
            else fn(a) if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("path", PATHS)
def test_op_returns_the_functions_bits_and_leaves_its_inputs(path):
    op, function = PATHS[path]
    x, weight, w_scale, lora, batch = _problem()
    inputs = _tensors(ops._args(x, weight, w_scale, lora, batch))
    before = [_int_view(t).clone() for t in inputs]
    got = op(x, weight, w_scale, lora, batch)
    assert_bitwise_equal(got, function(x, weight, w_scale, lora, batch), name=f"{path} op")
    for i, (t, u) in enumerate(zip(inputs, before, strict=True)):
        assert torch.equal(_int_view(t), u), f"input tensor {i} changed"


@pytest.mark.parametrize("path", PATHS)
def test_op_passes_torch_op_checks(path):
    # torch's schema check is left out: it compares inputs with allclose, which CPU FP8 tensors
    # lack (the test above compares them bitwise instead).
    x, weight, w_scale, lora, batch = _problem()
    torch.library.opcheck(OPS[path].default, ops._args(x, weight, w_scale, lora, batch),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("path", PATHS)
def test_op_compiles_whole(path):
    # fullgraph: a graph break (Dynamo tracing into the launchers) would raise.
    op, _ = PATHS[path]
    x, weight, w_scale, lora, batch = _problem()

    def layer(x):
        return op(x, weight, w_scale, lora, batch).float() * 2

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert_bitwise_equal(compiled(x), layer(x), name=f"compiled {path} op")


def test_fake_output_has_the_paths_shape_and_dtype():
    x, weight, w_scale, lora, batch = _problem()
    with torch._subclasses.FakeTensorMode() as mode:
        args = _map_tensors(mode.from_tensor, ops._args(x, weight, w_scale, lora, batch))
        y = torch.ops.epilora.decode_lora_fp8_linear(*args)
    assert (tuple(y.shape), y.dtype) == ((9, 64), torch.bfloat16)


def test_the_dispatcher_op_takes_a_path():
    x, weight, w_scale, lora, batch = _problem()
    for path in ("fused", "w8a16", "hybrid"):
        assert_bitwise_equal(ops.lora_linear(x, weight, w_scale, lora, batch, path=path),
                             dispatch.lora_linear(x, weight, w_scale, lora, batch, path=path),
                             name=f"dispatcher op, {path}")


def test_import_registers_without_cuda():
    assert_clean_import("epilora_kernels.ops", forbidden=("vllm",))
