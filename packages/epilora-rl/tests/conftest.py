"""Without a GPU the kernels run in Triton's interpreter, which must be chosen before any
kernel is built (triton.jit reads TRITON_INTERPRET when it decorates)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
