"""Bitwise assertions: compare integer views, report the first mismatches in hex."""

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as an integer tensor of the same element size (on the CPU)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_INT_VIEW[t.element_size()])


def _hex(value: int, width: int) -> str:
    return f"0x{value & ((1 << (8 * width)) - 1):0{2 * width}x}"


def _describe(t: torch.Tensor, index: tuple[int, ...]) -> str:
    width = t.element_size()
    raw = int(bits(t)[index])
    if t.is_floating_point():
        return f"{_hex(raw, width)} ({float(t.detach().cpu()[index].float())!r})"
    return _hex(raw, width)


def bitwise_mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Indices `[n, ndim]` where the bits of got and want differ (shapes and dtypes must agree)."""
    return (bits(got) != bits(want)).nonzero()


def assert_bitwise_equal(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    name: str = "tensor",
    inputs: torch.Tensor | None = None,
    max_report: int = 8,
) -> None:
    """Assert got and want are identical bit for bit: same dtype, shape and bytes.

    -0.0 and +0.0 differ, and so do NaNs with different payloads. On failure the message gives
    the number of mismatches and, for the first `max_report`, the index, got and want in hex
    (with the float value), and the input row's bits when `inputs` is given (indexed by the
    mismatch's leading index).
    """
    if got.dtype != want.dtype:
        raise AssertionError(f"{name}: dtype {got.dtype} != expected {want.dtype}")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    wrong = bitwise_mismatches(got, want)
    if wrong.numel() == 0:
        return
    lines = [f"{name}: {wrong.shape[0]} of {got.numel()} elements differ bitwise"]
    for row in wrong[:max_report].tolist():
        index = tuple(row)
        line = f"  at {index}: got {_describe(got, index)}, want {_describe(want, index)}"
        if inputs is not None and inputs.ndim == got.ndim and inputs.shape == got.shape:
            line += f", input {_describe(inputs, index)}"
        lines.append(line)
    raise AssertionError("\n".join(lines))
