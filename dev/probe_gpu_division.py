"""Characterize fp32 division as Triton (and so Inductor) computes it on this GPU.

Inductor lowers `x.reciprocal()` to Triton `1 / x`, and Triton lowers `/` to PTX `div.full.f32`,
an approximation, not the correctly rounded quotient torch computes. To reproduce vLLM's
compiled quantizer bit for bit without a GPU we need to know exactly where the two differ:

1. `1 / x` for every fp32 mantissa (x in [1, 2)), against the correctly rounded reciprocal;
2. whether that pattern is the same in every binade (x * 2^e), so one table describes all x;
3. whether `a / b` equals `a * (1 / b)` (one approximate reciprocal, then a rounded product).

Writes a JSON with the counts and the full list of differing mantissas.

    python3 dev/probe_gpu_division.py --out out/gpu_division.json
"""

import argparse
import json

import torch
import triton
import triton.language as tl

MANTISSAS = 1 << 23


@triton.jit
def _divide(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=1.0)
    b = tl.load(b_ptr + offs, mask=mask, other=1.0)
    tl.store(out_ptr + offs, a / b, mask=mask)


@triton.jit
def _reciprocal_times(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=1.0)
    b = tl.load(b_ptr + offs, mask=mask, other=1.0)
    r = 1 / b
    tl.store(out_ptr + offs, a * r, mask=mask)


@triton.jit
def _to_e4m3(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, x.to(tl.float8e4nv), mask=mask)


def probe_e4m3_conversion(dev) -> dict:
    """Triton's fp32 -> e4m3 cast against torch's (round to nearest even), for every fp32 value
    of magnitude 2^-12 .. 448 (both signs), and against a cast that first rounds to fp16."""
    out = {"values": 0, "differ_from_torch": 0, "equal_to_via_fp16": True, "by_binade": {}}
    for e in range(-12, 9):
        bits = torch.arange(1 << 23, device=dev, dtype=torch.int32) | ((e + 127) << 23)
        x = bits.view(torch.float32)
        x = torch.cat([x, -x])
        x = x[x.abs() <= 448.0]
        got = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=dev)
        _to_e4m3[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
        want = x.to(torch.float8_e4m3fn)
        via16 = x.to(torch.float16).to(torch.float8_e4m3fn)
        g, w, v = (t.view(torch.uint8) for t in (got, want, via16))
        differ = int((g != w).sum())
        out["values"] += x.numel()
        out["differ_from_torch"] += differ
        out["equal_to_via_fp16"] &= bool((g == v).all())
        out["by_binade"][e] = {"differ_from_torch": differ,
                               "differ_from_via_fp16": int((g != v).sum())}
    return out


def triton_divide(a: torch.Tensor, b: torch.Tensor, kernel=_divide) -> torch.Tensor:
    out = torch.empty_like(b)
    n = b.numel()
    kernel[(triton.cdiv(n, 1024),)](a, b, out, n, BLOCK=1024)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dev = torch.device("cuda")
    ones = torch.ones(MANTISSAS, device=dev)
    base_bits = torch.arange(MANTISSAS, device=dev, dtype=torch.int32) | 0x3F800000
    x = base_bits.view(torch.float32)  # every mantissa of [1, 2)
    approx = triton_divide(ones, x)
    exact = torch.div(ones, x)  # torch CUDA: a correctly rounded quotient
    diff = (approx.view(torch.int32) - exact.view(torch.int32))
    differing = diff.nonzero().flatten()
    result = {
        "device": torch.cuda.get_device_name(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "reciprocal_mantissas_differing": int(differing.numel()),
        "reciprocal_max_ulp": int(diff.abs().max()),
        "reciprocal_differing_mantissas": differing.cpu().tolist(),
        "reciprocal_differing_ulp": diff[differing].cpu().tolist(),
    }
    print(f"1/x, x in [1,2): {differing.numel()} of {MANTISSAS} mantissas differ from the "
          f"correctly rounded reciprocal, max {result['reciprocal_max_ulp']} ulp")

    # 2. binade independence: 1/(x * 2^e) == (1/x) * 2^-e while the result stays normal.
    binades = {}
    for e in list(range(-125, 126, 5)) + [-126, 126, 127]:
        xe = x * (2.0**e)
        ae = triton_divide(ones, xe)
        want = approx * (2.0 ** (-e))
        normal = want.abs() >= torch.finfo(torch.float32).tiny
        same = (ae.view(torch.int32) == want.view(torch.int32)) | ~normal
        binades[e] = {"mismatch": int((~same).sum()), "nonnormal_results": int((~normal).sum())}
    result["binades"] = binades
    bad = {e: v for e, v in binades.items() if v["mismatch"]}
    print(f"binade independence: {len(binades) - len(bad)} of {len(binades)} binades follow the "
          f"[1,2) table; exceptions: {bad}")

    # 3. a / b against a * (1 / b), on random normal operands and on e4m3 divisors.
    gen = torch.Generator(device=dev).manual_seed(0)
    n = 1 << 24
    a = torch.randn(n, device=dev, generator=gen) * torch.exp2(
        torch.randint(-60, 60, (n,), device=dev, generator=gen).float())
    b = torch.randn(n, device=dev, generator=gen) * torch.exp2(
        torch.randint(-60, 60, (n,), device=dev, generator=gen).float())
    e4m3 = torch.arange(1, 127, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn).float()
    b_e4m3 = e4m3[torch.randint(0, e4m3.numel(), (n,), device=dev, generator=gen)]
    for name, divisor in (("random", b), ("e4m3", b_e4m3)):
        q = triton_divide(a, divisor)
        qr = triton_divide(a, divisor, _reciprocal_times)
        rn = torch.div(a, divisor)
        result[f"div_{name}"] = {
            "pairs": n,
            "div_ne_a_times_rcp": int((q.view(torch.int32) != qr.view(torch.int32)).sum()),
            "div_ne_correctly_rounded": int((q.view(torch.int32) != rn.view(torch.int32)).sum()),
        }
        print(f"a / b ({name} b): {result[f'div_{name}']}")
    e4m3_rcp = triton_divide(torch.ones_like(e4m3), e4m3)
    result["e4m3_reciprocals_exact"] = bool(
        (e4m3_rcp.view(torch.int32) == torch.div(torch.ones_like(e4m3), e4m3).view(torch.int32))
        .all())
    result["e4m3_conversion"] = probe_e4m3_conversion(dev)
    print(f"fp32 -> e4m3 in Triton: {result['e4m3_conversion']}")
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
