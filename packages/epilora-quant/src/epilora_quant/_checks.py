"""Input validation at the public boundary: clear errors that name the offending value."""

import torch

FLOAT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_float_input(name: str, x: torch.Tensor, *, ndim: int | None = 2) -> None:
    """Reject tensors a quantizer cannot take: wrong type, rank, dtype, or non-finite values."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D, got shape {tuple(x.shape)}"
            + (" (flatten the leading dims to [tokens, features])" if ndim == 2 else "")
        )
    if x.dtype not in FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name}.dtype must be one of {FLOAT_INPUT_DTYPES}, got {x.dtype}")
    check_finite(name, x)


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise if x holds NaN or Inf: vLLM turns them into garbage codes, we refuse them."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s); first at index {first}: "
            f"{x[first].item()!r}"
        )


def check_scale(name: str, scale: torch.Tensor, *, numel: int | None = None) -> None:
    """A given scale must be a float32 tensor of finite, strictly positive values."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}.dtype must be torch.float32, got {scale.dtype}")
    if numel is not None and scale.numel() != numel:
        raise ValueError(f"{name} must have {numel} element(s), got shape {tuple(scale.shape)}")
    check_finite(name, scale)
    if bool((scale <= 0).any()):
        raise ValueError(f"{name} must be > 0, got min {scale.min().item()!r}")


def check_divisible(name: str, size: int, block: int) -> None:
    """A blocked dimension must hold whole blocks."""
    if size % block != 0:
        raise ValueError(f"{name}={size} must be divisible by the block size {block}")
