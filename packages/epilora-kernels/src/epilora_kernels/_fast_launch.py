"""Launches of already compiled Triton kernels without `JITFunction.run`'s per-launch work.

`kernel[grid](**arguments)` binds and specializes every argument, builds its cache key from
them and the options, and checks the kernel's globals, at every launch: ~20 us of host time on
a fast host for K2's 48 arguments, more on slower ones, and a projection launches two kernels.
In a step vLLM runs outside CUDA graphs (prefill above its largest graph size) those launches
are most of the step's time: the GPU waits for the host.

A `Template` is one launch's arguments with every one fixed but its slots, the tensors and the
token count (the launchers make one per launch setting and shape, `epilora_kernels._launchers`,
so that an engine's steps of ever new token counts find their templates made): a launch through
it fills in the slots, and a launch whose slots specialize as an earlier one's did goes
straight to that launch's compiled kernel (its launcher, on the current stream); any other goes
through Triton, whose compiled kernel is remembered for the next. Only the slots are
specialized per launch: a tensor as Triton does, by its dtype and whether its address is
16-byte aligned; an int by whether it is 1, a multiple of 16 and 32-bit (as Triton specializes
an int, and finer than it does one marked `do_not_specialize`, as K1's and K2's T); a
tensor descriptor more finely than Triton (which keys on its dtype and block shape): by its
base's dtype and alignment, its strides, block shape and padding. The fixed arguments (ints,
flags, constexprs, each by value) and the launch options are the template's own. While a
Triton launch hook or a kernel's pre-run hook is installed (a profiler such as proton), or
Triton's debug or instrumentation mode is on, every launch goes through Triton, so they see it.

`launch` does the same for a launch given by name, each argument specialized per launch (the
launches that are not on the eager path of a projection).
"""

import inspect

import torch
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

_TENSOR = torch.Tensor
_COMPILED: dict[tuple, object] = {}  # `launch`'s key -> Triton's CompiledKernel
_MAX_COMPILED = 1 << 14  # a process launching ever new keys starts over past this
# kernel -> (((name, default), ...) in the kernel's parameter order, the names as a set)
_PARAMS: dict = {}


def _specialization(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, TensorDescriptor):
        return _descriptor_specialization(value)
    return value.__class__, value  # True and 1 are one key by value, two to Triton


def _descriptor_specialization(value: TensorDescriptor) -> tuple:
    # Triton keys a descriptor on its dtype and block shape; its base's alignment, strides and
    # padding besides, but not its shape (the rows: the token count), which is a runtime value.
    base = value.base
    return (base.dtype, base.data_ptr() % 16 == 0, tuple(value.strides),
            tuple(value.block_shape), value.padding)


def _slot_specialization(value) -> tuple:
    # A slot that is not a plain tensor: a descriptor, or an int (the token count), which Triton
    # specializes by whether it is 1, a multiple of 16, and 32-bit (by its width alone where
    # the kernel says `do_not_specialize`); this key by all three, at least as finely.
    if isinstance(value, TensorDescriptor):
        return _descriptor_specialization(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int, value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    return _specialization(value)


def _hooked(kernel) -> bool:
    # Whether Triton must see the launch: launch hooks (Triton 3.6 keeps them in chains, empty
    # for none; earlier Tritons a callable), the kernel's pre-run hooks, or the debug and
    # instrumentation modes (part of Triton's cache key, read by it at every launch).
    runtime = knobs.runtime
    return (any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook,
                                                          runtime.launch_exit_hook))
            or bool(getattr(kernel, "pre_run_hooks", None)) or bool(runtime.debug)
            or bool(knobs.compilation.instrumentation_mode))


def _params(kernel) -> tuple[tuple, frozenset]:
    # From the Python function's signature: a JITFunction and the interpreter's
    # InterpretedFunction both keep it as `fn`.
    known = _PARAMS.get(kernel)
    if known is None:
        params = inspect.signature(kernel.fn).parameters.values()
        known = _PARAMS[kernel] = (tuple((p.name, p.default) for p in params),
                                   frozenset(p.name for p in params))
    return known


def _run(compiled, grid: tuple, device: int, values) -> None:
    # What JITFunction.run does last: the compiled kernel's launcher on the current stream,
    # without launch metadata or hooks (none are installed: `_hooked`).
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_y, grid_z, driver.active.get_current_stream(device),
                 compiled.function, compiled.packed_metadata, None, None, None, *values)


def _remember(cache: dict, key: tuple, kernel, compiled) -> None:
    if not _hooked(kernel) and hasattr(compiled, "packed_metadata"):  # not a compile future
        if len(cache) >= _MAX_COMPILED:
            cache.clear()
        cache[key] = compiled


class Template:
    """`kernel`'s launch with `arguments` (by name, launch options included), every argument
    fixed but those named in `slots` (tensors, descriptors, ints), which each launch gives in
    that order."""

    def __init__(self, kernel, arguments: dict, slots: tuple[str, ...]) -> None:
        params, names = _params(kernel)
        order = [name for name, _ in params]
        missing = [slot for slot in slots if slot not in names]
        if missing:
            raise ValueError(f"{missing} are not parameters of {kernel.__name__}")
        self.kernel, self.slots = kernel, slots
        self._names = order
        self._positions = tuple(order.index(slot) for slot in slots)
        self._values = [arguments[name] if name in arguments else default
                        for name, default in params]
        for position in self._positions:  # the template keeps no tensor alive
            self._values[position] = None
        fixed_tensors = [name for name, value in zip(order, self._values, strict=True)
                         if isinstance(value, (torch.Tensor, TensorDescriptor))]
        if fixed_tensors:  # a buffer fixed by the first launch would serve every later one
            raise ValueError(f"{fixed_tensors} are tensors: name them in the template's slots")
        self._options = {k: v for k, v in arguments.items() if k not in names}
        self._compiled: dict[tuple, object] = {}

    def bind(self, **tensors) -> "Template":
        """This launch with the slots named here fixed to these tensors, for a caller that
        launches it with the same ones every time (an engine's weights and adapter buffers,
        `epilora_kernels.projection`): they are specialized once, here, and each launch gives
        the remaining slots, in their order. The bound template keeps them alive."""
        unknown = [name for name in tensors if name not in self.slots]
        if unknown:
            raise ValueError(f"{unknown} are not slots of this template ({self.slots})")
        bound = object.__new__(Template)
        bound.kernel, bound._names, bound._options = self.kernel, self._names, self._options
        bound._values = self._values.copy()
        for name, tensor in tensors.items():
            bound._values[self._names.index(name)] = tensor
        bound.slots = tuple(slot for slot in self.slots if slot not in tensors)
        bound._positions = tuple(self._names.index(slot) for slot in bound.slots)
        bound._compiled = {}  # its launches' keys leave out the bound tensors
        return bound

    def _filled(self, tensors) -> list:
        # Every argument in the kernel's parameter order, these tensors in their slots.
        values = self._values.copy()
        for position, tensor in zip(self._positions, tensors, strict=True):
            values[position] = tensor
        return values

    def arguments(self, tensors) -> dict:
        """The launch's arguments by name (options included) with these tensors."""
        return dict(zip(self._names, self._filled(tensors), strict=True)) | self._options

    def launch(self, grid: tuple, tensors) -> None:
        """`kernel[grid](**self.arguments(tensors))`, past Triton once it has compiled the
        kernel for slot values that specialize so."""
        device = driver.active.get_current_device()
        # _specialization inlined for plain tensors (most of them): a call a tensor is most of
        # this launch's host time.
        key = (device, *[(t.dtype, t.data_ptr() % 16 == 0) if t.__class__ is _TENSOR
                         else _slot_specialization(t) for t in tensors])
        compiled = self._compiled.get(key)
        if compiled is None or _hooked(self.kernel):
            _remember(self._compiled, key, self.kernel,
                      self.kernel[grid](**self.arguments(tensors)))
            return
        _run(compiled, grid, device, self._filled(tensors))


def launch(kernel, grid: tuple, arguments: dict) -> None:
    """`kernel[grid](**arguments)`, the same kernel on the same stream, with Triton's own launch
    only the first time its arguments (every one, by value or as a tensor) specialize so."""
    params, names = _params(kernel)
    values = [arguments[name] if name in arguments else default for name, default in params]
    options = tuple(item for item in arguments.items() if item[0] not in names)
    device = driver.active.get_current_device()
    key = (kernel, device, options, *map(_specialization, values))
    compiled = _COMPILED.get(key)
    if compiled is None or _hooked(kernel):
        _remember(_COMPILED, key, kernel, kernel[grid](**arguments))
        return
    _run(compiled, grid, device, values)


def clear() -> None:
    """Forget the compiled kernels `launch` remembers (templates keep their own)."""
    _COMPILED.clear()
