"""Compile, for sm_90 and without a GPU, every kernel launch that `epilora_kernels.fused` makes,
with the arguments its launchers really pass (run as a script, TRITON_INTERPRET unset: see
test_compile_sm90.py). The launchers run on CPU tensors with the kernels' `run` replaced by a
recorder; each recorded launch is then compiled from its argument types and constexprs. This
catches what the interpreter cannot: a pointer of the wrong type in a branch that never runs."""

import dataclasses
import functools
import json
import os

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

import epilora_kernels
from epilora_kernels import _fast_launch, _fused_kernels, dispatch, fused
from epilora_kernels.arch import DeviceSupport
from epilora_kernels.launch import LaunchConfig

from kernel_cases import make_problem

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8"}
OPTIONS = ("num_warps", "num_stages", "launch_pdl")


# The device the launchers are told they run on: sm_90 with PDL and TMA, no launch table of its
# own (its architecture's, the H200's, where it has the shape).
SM90 = DeviceSupport("aot-sm90", (9, 0), fp8_mma=True, pdl=True, tma=True, interpreter=False)


def record_launches(launch, grids: list | None = None,
                    warmups: list | None = None) -> list[tuple]:
    """(kernel, args, kwargs) of every launch `launch()` makes, the launchers told the CPU
    tensors are on an sm_90 device; their grids go to `grids`, whether each was a compile
    without a run (Triton's `warmup`) to `warmups`."""
    calls = []
    kernels = (_fused_kernels._quantize_shrink_kernel, _fused_kernels._lora_gemm_kernel,
               _fused_kernels._segment_delta_kernel)
    for kernel in kernels:
        def recorder(*args, grid, warmup, _kernel=kernel, **kwargs):
            calls.append((_kernel, args, kwargs))
            if grids is not None:
                grids.append(tuple(grid))
            if warmups is not None:
                warmups.append(warmup)

        kernel.run = recorder
    supports = fused.device_support, dispatch.device_support
    fused.device_support = dispatch.device_support = lambda device=None: SM90
    # Every launch through Triton's `run` (the recorder): the fast path past it asks the CUDA
    # driver for the current device first.
    fast, template = _fast_launch.launch, _fast_launch.Template.launch
    _fast_launch.launch = lambda kernel, grid, arguments: kernel[grid](**arguments)
    _fast_launch.Template.launch = lambda self, grid, tensors: self.kernel[grid](
        **self.arguments(tensors))
    try:
        launch()
    finally:
        _fast_launch.launch, _fast_launch.Template.launch = fast, template
        fused.device_support, dispatch.device_support = supports
        for kernel in kernels:
            del kernel.run  # back to the class's method
    return calls


def compile_launch(kernel, args, kwargs) -> str:
    """Compile one recorded launch for sm_90; returns its PTX (`compile_launch_full`)."""
    return compile_launch_full(kernel, args, kwargs).asm["ptx"]


def compile_launch_full(kernel, args, kwargs):
    """Compile one recorded launch for sm_90; returns Triton's compiled kernel. Pointers and
    integers that are multiples of 16 are marked so, as Triton's launcher specializes them at
    run time (not those the kernel marks `do_not_specialize`): without it the K loops' loads
    cannot become asynchronous copies and the PTX is not the GPU's."""
    values = dict(zip(kernel.arg_names, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    for param in kernel.params:  # arguments the launch left at their defaults, as Triton does
        if param.has_default and not param.is_constexpr and param.name not in values:
            values[param.name] = param.default
    # constexprs, and None (Triton makes a None argument a constexpr)
    constexprs = {p.name: values[p.name] for p in kernel.params
                  if p.name in values and (p.is_constexpr or values[p.name] is None)}
    for param in kernel.params:  # the launch left them at their defaults, as Triton would
        if param.is_constexpr and param.has_default and param.name not in constexprs:
            constexprs[param.name] = param.default
    options = {k: v for k, v in kwargs.items() if k in OPTIONS and k != "launch_pdl"}
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            continue
        value = values[name]
        if isinstance(value, TensorDescriptor):  # a host TMA descriptor: no alignment mark
            block = ",".join(str(size) for size in value.block_shape)
            signature[name] = f"tensordesc<{DTYPES[value.base.dtype]}[{block}]>"
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + DTYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        else:
            signature[name] = "i32"
            aligned = value % 16 == 0 and not kernel.params[index].do_not_specialize
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options=options)


def main() -> None:
    x, weight, w_scale, lora, batch = make_problem(0, 5, 256, (64, 32, 32), 16, 4,
                                                   "mixed_with_base")
    split = LaunchConfig(block_m=16, block_n=32, block_k=64, block_r=16, split_k=2)
    wide = make_problem(0, 2, 12288, (32,), 16, 1, "one_adapter")  # the down projection's K
    channel_scales = torch.ones(weight.shape[0])
    eight_warps = LaunchConfig(block_m=16, block_k=128, block_r=16, split_k=8, num_warps=8)
    # the decode path in one launch (EPILORA_DECODE_ONE_LAUNCH): one slot, the caller's codes,
    # the shrink reading them or bf16 x, the GEMM in swapped tiles and split
    one = make_problem(0, 5, 256, (128, 64, 64), 16, 1, "one_adapter")
    one_codes = (one[0].to(torch.float8_e4m3fn), torch.ones(5, 1))
    wide_slices = make_problem(0, 5, 256, (128, 64, 64), 16, 4, "mixed_with_base")  # 64-wide
    swapped = LaunchConfig(block_m=16, block_n=64, block_k=128, block_r=16, num_stages=4,
                           swap_ab=True)
    # K1's shrink programs each taking every slice (LaunchConfig.slices_together), split
    together = LaunchConfig(block_m=16, block_k=64, block_r=16, split_k=2, slices_together=True)
    # EPILORA_DELTA_KERNEL: eight slots in 64-row K2 tiles, where the delta goes first: K1,
    # the delta kernel, K2 adding it (rank 16 whole, and rank 128 in two steps)
    slots = make_problem(0, 70, 256, (64, 32, 32), 16, 8, "one_token_each")
    slots_128 = make_problem(0, 70, 256, (64, 32, 32), 128, 8, "one_token_each")
    slots_8 = make_problem(0, 70, 256, (64, 32, 32), 8, 8, "one_token_each")  # rank tile 16
    prefill = LaunchConfig(block_m=64, block_n=32, block_k=64, block_r=16, num_stages=3)
    # EPILORA_EPILOGUE_EARLY: one slot's epilogue in halves from h and B loaded before the K loop
    one_slot = make_problem(0, 70, 256, (64, 32, 32), 16, 1, "mixed_with_base")
    launchers = {
        "quantize": lambda: fused.quantize(x),
        "fp8_gemm_from_bf16": lambda: fused.fp8_gemm_from_bf16(x, weight, w_scale),
        "fused": lambda: fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch),
        "fused_split_k": lambda: fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                             k2_config=split),
        "decode": lambda: fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch),
        "decode_split_k": lambda: fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                               k2_config=split),
        # dev/decode_timeline.py's launches: clocks in both kernels, K2 warming L2
        "decode_traced": lambda: fused._linear(
            0, x, weight, w_scale, lora, batch, None, None, decode=True, pdl=True, warm_l2=512,
            traces=(torch.zeros(256, 8, dtype=torch.int64),
                    torch.zeros(256, 8, dtype=torch.int64))),
        # K1 with 8 warps quantizes a 12288-wide row in one pass (a 16384 block)
        "k1_eight_warps_wide": lambda: fused.quantize_and_shrink(
            wide[0], wide[3], wide[4], config=eight_warps),
        "w8a16": lambda: fused.fused_lora_w8a16_linear(x, weight, w_scale, lora, batch),
        "k1_slices_together": lambda: (
            fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=together),
            fused.decode_lora_fp8_linear(None, *one[1:], x_quantized=one_codes,
                                         k1_config=together)),
        # several slots' decode tiles adding each row's adapter by its slot (unswapped, swapped)
        "decode_gathered": lambda: _with_env("EPILORA_GATHER_SEGMENTS", lambda: (
            fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch),
            fused.decode_lora_fp8_linear(*wide_slices, k2_config=swapped))),
        "decode_one_launch": lambda: _with_env("EPILORA_DECODE_ONE_LAUNCH", lambda: (
            fused.decode_lora_fp8_linear(None, *one[1:], x_quantized=one_codes),
            fused.decode_lora_fp8_linear(one[0], *one[1:], x_quantized=one_codes,
                                         k2_config=swapped),
            fused.decode_lora_fp8_linear(None, *one[1:], x_quantized=one_codes,
                                         k2_config=split))),
        # one weight scale per output channel, in both GEMM modes and without adapters
        "per_channel": lambda: (
            fused.decode_lora_fp8_linear(x, weight, channel_scales, lora, batch),
            fused.fused_lora_w8a16_linear(x, weight, channel_scales, lora, batch),
            fused.fp8_gemm_from_bf16(x, weight, channel_scales)),
        "fused_delta_kernel": lambda: _with_env("EPILORA_DELTA_KERNEL", lambda: (
            fused.fused_lora_fp8_linear(*slots, k2_config=prefill),
            fused.fused_lora_fp8_linear(*slots_128, k2_config=dataclasses.replace(
                prefill, block_r=128)),
            fused.fused_lora_fp8_linear(*slots_8, k2_config=prefill))),
        "fused_epilogue_early": lambda: _with_env("EPILORA_EPILOGUE_EARLY", lambda: (
            fused.fused_lora_fp8_linear(*one_slot, k2_config=dataclasses.replace(
                prefill, num_warps=8)))),
        "expand": lambda: fused.lora_expand(
            torch.zeros(5, 128, dtype=torch.bfloat16), fused.lora_shrink(x, lora, batch), lora,
            batch),
    }
    compiled = {}
    for name, launch in launchers.items():
        calls = record_launches(launch)
        for kernel, args, kwargs in calls:
            compile_launch(kernel, args, kwargs)
        compiled[name] = len(calls)
        if name == "fused_epilogue_early":  # the K2 compiled is the early one
            compiled[name] = (len(calls), sum(bool(kw.get("EPILOGUE_EARLY")) for *_, kw in calls))
    # compile_only: the same kernels, arguments and grids as the launches, each a warmup
    for name in ("decode", "fused", "per_channel"):
        grids, only_grids, warmups = [], [], []
        launched = record_launches(launchers[name], grids)
        only = record_launches(functools.partial(_compile_only, launchers[name]), only_grids,
                               warmups)
        compiled[f"compile_only_{name}"] = {
            "warmups": sum(warmups), "launches": len(warmups),
            "same": (list(map(_signature, only)) == list(map(_signature, launched))
                     and only_grids == grids)}
    print(json.dumps(compiled))


def _with_env(name: str, launch):
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        return launch()
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _compile_only(launch):
    with epilora_kernels.compile_only():
        return launch()


def _signature(call) -> tuple:
    # What a launch compiles from: its kernel and each argument's type, layout and alignment,
    # or value (two launches' tensors are other objects with the same signature).
    kernel, args, kwargs = call
    def describe(value):
        if isinstance(value, TensorDescriptor):
            return ("desc", describe(value.base), tuple(value.block_shape))
        if isinstance(value, torch.Tensor):
            return (str(value.dtype), tuple(value.shape), value.stride(),
                    value.data_ptr() % 16 == 0)
        return value
    return (kernel.fn.__name__, tuple(map(describe, args)),
            tuple((k, describe(v)) for k, v in sorted(kwargs.items())))


if __name__ == "__main__":
    main()
