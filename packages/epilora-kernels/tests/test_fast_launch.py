"""`_fast_launch` on a stand-in kernel and driver (CPU): which launches go through Triton and
which straight to the remembered compiled kernel, with which arguments. On the H200,
tests/gpu/test_api_gpu.py checks the real launches' outputs bit for bit."""

from types import SimpleNamespace

import pytest
import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from epilora_kernels import _fast_launch


class _Compiled:
    packed_metadata = "packed"
    function = 7

    def __init__(self, runs: list) -> None:
        self._runs = runs

    def run(self, *args) -> None:
        self._runs.append(args)


def _kernel_function(x_ptr, T, FLAG=False):
    pass


class _Kernel:
    """A JITFunction's surface: `fn`, and `kernel[grid](**arguments)` (Triton's launch)."""

    __name__ = "_kernel_function"

    def __init__(self) -> None:
        self.fn = _kernel_function
        self.triton_launches: list = []
        self.runs: list = []

    def __getitem__(self, grid):
        def launch(**arguments):
            self.triton_launches.append((grid, arguments))
            return _Compiled(self.runs)
        return launch


@pytest.fixture
def kernel(monkeypatch):
    _fast_launch.clear()
    device = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 99)
    monkeypatch.setattr(_fast_launch, "driver", SimpleNamespace(active=device))
    yield _Kernel()
    _fast_launch.clear()


def _buffer(offset_bytes: int) -> torch.Tensor:
    # int32 elements `offset_bytes` into a 16-byte aligned buffer (torch allocates aligned).
    return torch.zeros(64, dtype=torch.int32)[offset_bytes // 4:]


def test_a_repeated_launch_skips_triton_with_the_arguments_in_parameter_order(kernel):
    x = _buffer(0)
    _fast_launch.launch(kernel, (3,), {"T": 5, "x_ptr": x, "num_warps": 4})
    _fast_launch.launch(kernel, (4, 2), {"T": 5, "x_ptr": x, "num_warps": 4})
    assert len(kernel.triton_launches) == 1
    (run,) = kernel.runs
    assert run[:9] == (4, 2, 1, 99, 7, "packed", None, None, None)
    assert run[9] is x and run[10:] == (5, False)  # the flag's default filled in


@pytest.mark.parametrize("change", ["alignment", "dtype", "int", "flag", "option"])
def test_a_launch_that_specializes_differently_goes_through_triton(kernel, change):
    base = {"T": 16, "x_ptr": _buffer(0), "num_warps": 4}
    other = dict(base)
    if change == "alignment":
        other["x_ptr"] = _buffer(8)
    elif change == "dtype":
        other["x_ptr"] = torch.zeros(8, dtype=torch.float32)
    elif change == "int":
        other["T"] = 17
    elif change == "flag":
        other["FLAG"] = True
    else:
        other["num_warps"] = 8
    _fast_launch.launch(kernel, (1,), base)
    _fast_launch.launch(kernel, (1,), other)
    assert len(kernel.triton_launches) == 2 and not kernel.runs
    _fast_launch.launch(kernel, (1,), other)  # now remembered too
    assert len(kernel.triton_launches) == 2 and len(kernel.runs) == 1


def test_tensor_descriptors_by_block_strides_and_base_alignment_not_shape(kernel):
    # Triton keys a descriptor on its dtype and block shape; its shape (a token count's rows)
    # is a runtime value, so fewer rows take the same kernel.
    base = torch.zeros(64, 64, dtype=torch.bfloat16)
    first = TensorDescriptor.from_tensor(base, [16, 16])
    same = TensorDescriptor.from_tensor(base.clone(), [16, 16])
    fewer_rows = TensorDescriptor.from_tensor(base[:40], [16, 16])
    other_block = TensorDescriptor.from_tensor(base, [16, 32])
    other_strides = TensorDescriptor.from_tensor(
        torch.zeros(64, 128, dtype=base.dtype)[:, :64], [16, 16])
    for desc in (first, same, fewer_rows, other_block, other_strides):
        _fast_launch.launch(kernel, (1,), {"T": 1, "x_ptr": desc})
    assert len(kernel.triton_launches) == 3 and len(kernel.runs) == 2


@pytest.mark.parametrize(("first", "then", "same_kernel"), [
    (300, 301, True), (40, 7, True), (32, 48, True), (300, 304, False), (2, 1, False),
    (5, 2**31, False), (True, 1, False)])
def test_an_int_slot_specializes_as_triton_does(kernel, first, then, same_kernel):
    # Triton compiles an int argument apart where it is 1, a multiple of 16, or beyond 32 bits:
    # a template's int slot (the token count) takes an earlier launch's kernel only where
    # none of those differ.
    template = _fast_launch.Template(kernel, {}, ("T", "x_ptr"))
    x = _buffer(0)
    template.launch((1,), (first, x))
    template.launch((1,), (then, x))
    assert len(kernel.triton_launches) == (1 if same_kernel else 2)
    assert len(kernel.runs) == (1 if same_kernel else 0)
    if same_kernel:
        assert kernel.runs[0][9:11] == (x, then)


def test_every_launch_goes_through_triton_while_a_launch_hook_is_installed(kernel):
    arguments = {"T": 2, "x_ptr": _buffer(0)}
    _fast_launch.launch(kernel, (1,), arguments)

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _fast_launch.launch(kernel, (1,), arguments)
        _fast_launch.launch(kernel, (1,), arguments)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.triton_launches) == 3 and not kernel.runs
    _fast_launch.launch(kernel, (1,), arguments)
    assert len(kernel.triton_launches) == 3 and len(kernel.runs) == 1


def test_a_template_fills_in_its_tensors_and_keeps_its_fixed_arguments(kernel):
    template = _fast_launch.Template(kernel, {"T": 7, "FLAG": True, "num_warps": 4}, ("x_ptr",))
    x = _buffer(0)
    assert template.arguments((x,)) == {"x_ptr": x, "T": 7, "FLAG": True, "num_warps": 4}
    template.launch((2,), (x,))
    template.launch((3,), (_buffer(16),))  # aligned too: the same kernel
    assert kernel.triton_launches == [((2,), {"x_ptr": x, "T": 7, "FLAG": True,
                                              "num_warps": 4})]
    (run,) = kernel.runs
    assert run[:9] == (3, 1, 1, 99, 7, "packed", None, None, None) and run[10:] == (7, True)
    template.launch((3,), (_buffer(8),))  # unaligned: through Triton
    assert len(kernel.triton_launches) == 2 and len(kernel.runs) == 1


def test_a_bound_template_launches_its_tensors_and_the_remaining_slots(kernel):
    # `bind` fixes slots once (a projection's weight): each launch gives the rest, in order,
    # and reaches the kernel with the bound tensor in its place; the parent is unchanged.
    template = _fast_launch.Template(kernel, {"FLAG": True}, ("T", "x_ptr"))
    x = _buffer(0)
    bound = template.bind(x_ptr=x)
    assert bound.slots == ("T",) and template.slots == ("T", "x_ptr")
    assert bound.arguments((5,)) == {"x_ptr": x, "T": 5, "FLAG": True}
    bound.launch((1,), (5,))
    bound.launch((2,), (6,))  # past Triton: the bound tensor in its place
    assert len(kernel.triton_launches) == 1 and kernel.runs[0][9:11] == (x, 6)
    with pytest.raises(ValueError, match="not slots"):
        template.bind(FLAG=False)


def test_a_bound_descriptor_reaches_every_launch(kernel):
    # A projection binds its weight's TMA descriptor: each launch passes that very descriptor
    # (Triton's launcher expands it), the token count filled in per launch.
    desc = TensorDescriptor.from_tensor(torch.zeros(64, 64, dtype=torch.bfloat16), [16, 16])
    bound = _fast_launch.Template(kernel, {"FLAG": False}, ("T", "x_ptr")).bind(x_ptr=desc)
    bound.launch((1,), (3,))
    bound.launch((1,), (5,))
    assert kernel.triton_launches[0][1]["x_ptr"] is desc
    assert len(kernel.triton_launches) == 1 and kernel.runs[0][9:12] == (desc, 5, False)


def test_a_template_refuses_slots_the_kernel_does_not_have(kernel):
    with pytest.raises(ValueError, match="y_ptr"):
        _fast_launch.Template(kernel, {"T": 1}, ("x_ptr", "y_ptr"))


def test_a_template_refuses_a_tensor_among_its_fixed_arguments(kernel):
    with pytest.raises(ValueError, match="x_ptr"):
        _fast_launch.Template(kernel, {"x_ptr": _buffer(0), "T": 1}, ())


@pytest.mark.parametrize("mode", ["debug", "instrumentation", "pre-run hook"])
def test_every_launch_goes_through_triton_in_tritons_debug_modes(kernel, monkeypatch, mode):
    template = _fast_launch.Template(kernel, {"T": 3}, ("x_ptr",))
    x = _buffer(0)
    template.launch((1,), (x,))
    if mode == "debug":
        monkeypatch.setattr(knobs.runtime, "debug", True)
    elif mode == "instrumentation":
        monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "fpsan")
    else:
        kernel.pre_run_hooks = [lambda *args, **kwargs: None]
    template.launch((1,), (x,))
    assert len(kernel.triton_launches) == 2 and not kernel.runs
