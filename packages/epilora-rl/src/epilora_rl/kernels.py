"""The training linear's kernels on the GPU (and in Triton's interpreter), twins of
`epilora_rl.reference`.

The forward is the matched engine's own kernel (epilora-kernels' W8A16 path, one adapter slot),
so the trainer's logits come from the same arithmetic as the rollouts'. The input's gradient
is a Triton kernel here: `grad_out @ W` reads the FP8 codes and widens them in registers, so no
bf16 copy of the weight exists at any moment, and adds the adapter's `grad_h @ A` to the same
fp32 sums before one rounding.
"""

import functools

import torch


def w8a16_lora_forward(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """See `epilora_rl.reference.w8a16_lora_forward`."""
    import epilora_kernels as ek

    n = weight.shape[0]
    lora = ek.LoraWeights((lora_a[None, None],), (lora_b[None, None],), (n,))
    return ek.fused_lora_w8a16_linear(x, weight, weight_scale, lora,
                                      _one_slot(x.shape[0], x.device),
                                      workspace=_workspace(x.device))


@functools.cache
def _workspace(device: torch.device):
    # The trainer's own counters: the engine in this process captured CUDA graphs with the
    # device's default workspace, which the trainer's batches need not share (same stream,
    # but a workspace sized for the engine's batches stays the engine's).
    import epilora_kernels as ek

    return ek.Workspace(device)


@functools.lru_cache(maxsize=64)
def _one_slot(tokens: int, device: torch.device):
    # Every token on the adapter's one slot. Building it syncs with the device (vLLM's
    # metadata recipe), so it is made once per batch size, not in every projection's call.
    import epilora_kernels as ek

    mapping = torch.zeros(tokens, dtype=torch.int32, device=device)
    return ek.AdapterBatch.from_token_mapping(mapping, 1)


def w8a16_lora_grad_input(grad_out: torch.Tensor, weight: torch.Tensor,
                          weight_scale: torch.Tensor, grad_h: torch.Tensor,
                          lora_a: torch.Tensor) -> torch.Tensor:
    """See `epilora_rl.reference.w8a16_lora_grad_input`. Per-tensor scales: bf16 products summed
    in fp32, the scale applied to the sums. Per-channel scales scale `grad_out` inside the
    reduction, so those products are tf32's (10 mantissa bits for `grad_out * scale`)."""
    import triton

    import epilora_kernels as ek

    t, n = grad_out.shape
    k = weight.shape[1]
    r = lora_a.shape[0]
    _check(grad_out, weight, weight_scale, grad_h, lora_a)
    out = torch.empty(t, k, dtype=grad_out.dtype, device=grad_out.device)
    block_t, block_k, block_n = 64, 128, 64
    grid = (triton.cdiv(t, block_t), triton.cdiv(k, block_k))
    _grad_input_kernel()[grid](
        grad_out, weight, weight_scale, grad_h, lora_a, out, t, n, k, r,
        grad_out.stride(0), weight.stride(0), grad_h.stride(0), lora_a.stride(0), out.stride(0),
        PER_CHANNEL=weight_scale.numel() > 1,
        INTERPRETER=ek.device_support(grad_out.device).interpreter,
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(r)), num_warps=4, num_stages=3)
    return out


def _check(grad_out, weight, weight_scale, grad_h, lora_a) -> None:
    t, n = grad_out.shape
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2 or weight.shape[0] != n \
            or weight.stride(1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn [{n}, K] with contiguous rows, got "
                         f"{weight.dtype} {tuple(weight.shape)} strides {weight.stride()}")
    if weight_scale.dtype != torch.float32 or weight_scale.numel() not in (1, n) \
            or not weight_scale.is_contiguous():
        raise ValueError(f"weight_scale must be contiguous fp32 with 1 or {n} values, got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    r, k = lora_a.shape
    if k != weight.shape[1] or tuple(grad_h.shape) != (t, r) or grad_h.dtype != torch.float32:
        raise ValueError(f"lora_a [r, {weight.shape[1]}] and fp32 grad_h [{t}, r] expected, got "
                         f"{tuple(lora_a.shape)} and {grad_h.dtype} {tuple(grad_h.shape)}")
    if grad_out.stride(1) != 1 or grad_h.stride(1) != 1 or lora_a.stride(1) != 1:
        raise ValueError("grad_out, grad_h and lora_a need contiguous rows")
    devices = {grad_out.device, weight.device, weight_scale.device, grad_h.device,
               lora_a.device}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


@functools.cache
def _grad_input_kernel():
    # Built on first use: importing this module imports no Triton.
    import triton
    import triton.language as tl

    @triton.jit
    def grad_input(g_ptr, w_ptr, s_ptr, gh_ptr, a_ptr, out_ptr, T, N, K, R,
                   stride_g, stride_w, stride_gh, stride_a, stride_out,
                   PER_CHANNEL: tl.constexpr, INTERPRETER: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr):
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        rows, cols = offs_t[:, None] < T, offs_k[None, :] < K
        acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            g = tl.load(g_ptr + offs_t[:, None] * stride_g + offs_n[None, :],
                        mask=rows & (offs_n[None, :] < N), other=0.0)
            w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                        mask=(offs_n[:, None] < N) & cols, other=0.0)
            if PER_CHANNEL:
                s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
                acc += tl.dot(g.to(tl.float32) * s[None, :], w.to(tl.float32),
                              input_precision="tf32")
            elif INTERPRETER:  # its bf16 dot is not exact: fp32 holds the same products
                acc += tl.dot(g.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(g, w.to(g.dtype))
        if not PER_CHANNEL:
            acc *= tl.load(s_ptr)
        offs_r = tl.arange(0, BLOCK_R)
        gh = tl.load(gh_ptr + offs_t[:, None] * stride_gh + offs_r[None, :],
                     mask=rows & (offs_r[None, :] < R), other=0.0)
        a = tl.load(a_ptr + offs_r[:, None] * stride_a + offs_k[None, :],
                    mask=(offs_r[:, None] < R) & cols, other=0.0)
        acc += tl.dot(gh, a.to(tl.float32), input_precision="tf32")
        tl.store(out_ptr + offs_t[:, None] * stride_out + offs_k[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=rows & cols)

    return grad_input
