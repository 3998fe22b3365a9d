"""Launches of already compiled Triton kernels without `JITFunction.run`'s per-launch work.

`kernel[grid](**arguments)` binds and specializes every argument, builds its cache key from
them and the options, and checks the kernel's globals, at every launch: ~20 us of host time on
a fast host for K2's 48 arguments, more on slower ones, and a projection launches two kernels.
In a step vLLM runs outside CUDA graphs (prefill above its largest graph size) those launches
are most of the step's time: the GPU waits for the host.

Here a launch whose arguments specialize as an earlier launch's did goes straight to that
launch's compiled kernel (its launcher, on the current stream); any other launch goes through
Triton, whose compiled kernel is remembered for the next. The key is at least as fine as
Triton's own: a tensor by its dtype and whether its address is 16-byte aligned (what Triton
specializes a pointer on), a tensor descriptor by its base's dtype and alignment, its shape,
strides, block shape and padding, every other argument (ints, flags, constexprs) by its value,
and the launch options by theirs. While a Triton launch hook is installed (a profiler such as
proton), every launch goes through Triton, so the hooks see it.
"""

import inspect

import torch
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

_COMPILED: dict[tuple, object] = {}  # key -> Triton's CompiledKernel
_MAX_COMPILED = 1 << 14  # a process launching ever new keys starts over past this
# kernel -> (((name, default), ...) in the kernel's parameter order, the names as a set)
_PARAMS: dict = {}


def _specialization(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, TensorDescriptor):
        base = value.base
        return (base.dtype, base.data_ptr() % 16 == 0, tuple(value.shape),
                tuple(value.strides), tuple(value.block_shape), value.padding)
    return value


def _hooked() -> bool:
    # Triton 3.6 keeps its launch hooks in chains (empty: none); earlier Tritons a callable.
    runtime = knobs.runtime
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook,
                                                         runtime.launch_exit_hook))


def launch(kernel, grid: tuple, arguments: dict) -> None:
    """`kernel[grid](**arguments)`, the same kernel on the same stream, with Triton's own launch
    only the first time its arguments specialize so."""
    known = _PARAMS.get(kernel)
    if known is None:
        known = _PARAMS[kernel] = (tuple((p.name, p.default) for p in kernel.params),
                                   frozenset(p.name for p in kernel.params))
    params, names = known
    values = [arguments[name] if name in arguments else default for name, default in params]
    options = tuple(item for item in arguments.items() if item[0] not in names)
    device = driver.active.get_current_device()
    key = (kernel, device, options, *map(_specialization, values))
    compiled = _COMPILED.get(key)
    if compiled is None or _hooked():
        compiled = kernel[grid](**arguments)
        if (not _hooked() and hasattr(compiled, "packed_metadata")
                and inspect.Parameter.empty not in values):
            if len(_COMPILED) >= _MAX_COMPILED:
                _COMPILED.clear()
            _COMPILED[key] = compiled
        return
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_y, grid_z, driver.active.get_current_stream(device),
                 compiled.function, compiled.packed_metadata, None, None, None, *values)


def clear() -> None:
    """Forget every compiled kernel remembered here (the next launch of each goes through
    Triton again)."""
    _COMPILED.clear()
