"""Where vLLM 0.26.0's own quantization paths disagree with each other, measured on a GPU.

Runs each pair of vLLM implementations of the same quantizer on the same inputs (seeded normal
activations of Qwen3-8B widths plus the named special cases) and records how many rows differ,
with the first counterexamples in hex. Writes the JSON that docs/formats/vllm-paths.md is
rendered from (tools/render_quant_docs.py).

Usage (on the GPU machine, vLLM importable):
    python3 tools/vllm_quant_paths.py --out benchmarks/results/h200/quant_paths.json
"""

import argparse
import datetime
import subprocess

import torch

from epilora_testing import vllm_oracles as vllm
from epilora_testing.assertions import bits
from epilora_testing.corpora import special_activations
from epilora_testing.results import results_text


def _hex(t: torch.Tensor) -> list[str]:
    width = t.element_size() * 2
    mask = (1 << (4 * width)) - 1
    return [f"0x{int(v) & mask:0{width}x}" for v in bits(t).flatten().tolist()]


def _inputs(dtype: torch.dtype, seeds: int) -> list[tuple[str, torch.Tensor]]:
    out = [(f"special:{name}", x) for name, x in special_activations(dtype, 8, 256).items()]
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        width = (4096, 12288)[seed % 2]
        x = torch.randn(64, width, generator=gen) * 2.0 ** (seed % 7 - 3)
        out.append((f"randn:seed={seed}:width={width}", x.to(dtype)))
    return out


def compare(name: str, run_a, run_b, inputs, *, max_examples: int = 3) -> dict:
    """Run two implementations; count differing rows (codes or scales) and keep examples."""
    rows = differing = scale_differing = 0
    examples = []
    for label, x in inputs:
        xc = x.cuda()
        (qa, sa), (qb, sb) = run_a(xc), run_b(xc)
        if sa.numel() != sb.numel():  # e.g. group scales in another layout: compare transposed
            sb = sb.t().contiguous() if sb.t().shape == sa.shape else sb
        qa, qb = bits(qa.reshape(x.shape[0], -1)), bits(qb.reshape(x.shape[0], -1))
        sa, sb = bits(sa.float().reshape(-1)), bits(sb.float().reshape(-1))
        row_codes = (qa != qb).any(dim=1)
        rows += x.shape[0]
        differing += int(row_codes.sum())
        scales_differ = sa.shape != sb.shape or bool((sa != sb).any())
        if sa.shape == sb.shape:
            scale_rows = (sa != sb).reshape(x.shape[0], -1) if sa.numel() % x.shape[0] == 0 \
                else (sa != sb).reshape(1, -1)
            scale_differing += int(scale_rows.any(dim=1).sum()) * (
                1 if scale_rows.shape[0] == x.shape[0] else x.shape[0])
        if (row_codes.any() or scales_differ) and len(examples) < max_examples:
            r = int(row_codes.nonzero()[0]) if row_codes.any() else 0
            cols = (qa[r] != qb[r]).nonzero().flatten()[:4]
            examples.append({
                "input": label, "row": r, "cols": cols.tolist(),
                "x": _hex(x[r, cols]), "a": _hex(qa[r, cols]), "b": _hex(qb[r, cols]),
                "scale_a": _hex(sa[: min(r + 1, sa.numel())][-1:]),
                "scale_b": _hex(sb[: min(r + 1, sb.numel())][-1:]),
            })
    return {"pair": name, "rows": rows, "rows_differing": differing,
            "rows_scale_differing": scale_differing, "examples": examples}


class _Tally:
    """Rows compared, rows that differ, and the first few differing elements as hex."""

    def __init__(self, pair: str) -> None:
        self.result = {"pair": pair, "rows": 0, "rows_differing": 0, "examples": []}

    def add(self, label: str, a: torch.Tensor, b: torch.Tensor, shown: torch.Tensor,
            shown_name: str, **extra) -> None:
        row_diff = (a != b).any(dim=1)
        self.result["rows"] += a.shape[0]
        self.result["rows_differing"] += int(row_diff.sum())
        if row_diff.any() and len(self.result["examples"]) < 3:
            r = int(row_diff.nonzero()[0])
            cols = (a[r] != b[r]).nonzero().flatten()[:4]
            self.result["examples"].append(
                {"input": label, "row": r, "cols": cols.tolist(),
                 shown_name: _hex(shown[r, cols]), "a": _hex(a[r, cols]),
                 "b": _hex(b[r, cols]), **extra})


def nvfp4_compare(inputs) -> dict:
    """vLLM's NVFP4 torch reference vs its Triton quant-dequant (both quantize, then dequantize)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant,
    )

    def reference_qdq(x, g):
        values, scales = ref_nvfp4_quant(x, g, 16)
        m, k = x.shape
        out = values.reshape(m, k // 16, 16) * (scales.unsqueeze(-1) / g)
        return out.reshape(m, k).to(x.dtype)

    tally = _Tally("nvfp4 quant-dequant: torch reference vs Triton kernel")
    for label, x in inputs:
        xc = x.cuda()
        g = (448.0 * 6.0 / xc.abs().amax().float().clamp(min=2.0**-100)).reshape(1)
        a, b = bits(reference_qdq(xc, g)), bits(vllm.ref_nvfp4_quant_dequant(xc, g))
        tally.add(label, a, b, x, "x", global_scale=_hex(g.cpu()))
    return tally.result


def nvfp4_dequant_compare(inputs) -> dict:
    """vLLM's NVFP4 weight dequantization: torch code vs its Triton kernel (linear scales)."""
    import epilora_quant as eq

    tally = _Tally("nvfp4 weight dequantize_to_dtype: torch (swizzled) vs Triton (linear)")
    for label, x in inputs:
        xc = x.cuda()
        g = (448.0 * 6.0 / xc.abs().amax().float().clamp(min=2.0**-100)).reshape(1)
        packed, scales = eq.quantize_nvfp4(xc, g, swizzle=False)
        swizzled = eq.swizzle_nvfp4_scales(scales)
        w2 = (1.0 / g).float()
        # On a CUDA machine vLLM's torch path takes swizzled scales on CPU tensors (linear scales
        # go to Triton, and its torch code indexes a CPU table).
        a = bits(vllm.dequantize_to_dtype(packed.cpu(), swizzled.cpu(), w2.cpu(), x.dtype,
                                          swizzled=True))
        b = bits(vllm.dequantize_to_dtype(packed, scales, w2, x.dtype, swizzled=False))
        tally.add(label, a, b, eq.unpack_e2m1(packed.cpu()), "codes")
    return tally.result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--git-sha", default=None, help="commit measured (no .git on the device)")
    args = parser.parse_args()

    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    results = []
    for dtype in (torch.bfloat16, torch.float16):
        inputs = _inputs(dtype, args.seeds)
        tag = str(dtype).removeprefix("torch.")
        pairs = {
            "per-token: forward_native on the CPU vs forward_native eager on CUDA": (
                lambda x: vllm.quant_fp8_native(x.cpu(), "token"),
                lambda x: vllm.quant_fp8_native(x, "token")),
            "per-token: forward_native eager vs CUDA kernel": (
                lambda x: vllm.quant_fp8_native(x, "token"),
                lambda x: vllm.scaled_fp8_quant_cuda(x, per_token=True)),
            "per-token: vLLM compiled QuantFP8 vs CUDA kernel": (
                lambda x: vllm.quant_fp8_compiled(x, "token"),
                lambda x: vllm.scaled_fp8_quant_cuda(x, per_token=True)),
            "per-token: vLLM compiled QuantFP8 vs forward_native eager": (
                lambda x: vllm.quant_fp8_compiled(x, "token"),
                lambda x: vllm.quant_fp8_native(x, "token")),
            "per-tensor dynamic: forward_native eager vs CUDA kernel": (
                lambda x: vllm.quant_fp8_native(x, "tensor"),
                lambda x: vllm.scaled_fp8_quant_cuda(x)),
            "per-group 1x128: forward_native eager vs CUDA per_token_group_quant_fp8": (
                lambda x: vllm.quant_fp8_native(x, "128"),
                lambda x: per_token_group_quant_fp8(x, 128)),
        }
        for name, (a, b) in pairs.items():
            result = compare(name, a, b, inputs)
            result["dtype"] = tag
            results.append(result)
            print(f"{tag:9s} {name:75s} {result['rows_differing']:5d} / {result['rows']} rows")
        for result in (nvfp4_compare(inputs), nvfp4_dequant_compare(inputs)):
            result["dtype"] = tag
            results.append(result)
            print(f"{tag:9s} {result['pair']:75s} {result['rows_differing']:5d} / "
                  f"{result['rows']} rows")

    import vllm as vllm_pkg

    sha = args.git_sha or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {
        "git_sha": sha or "unknown",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "vllm": vllm_pkg.__version__,
        "command": f"python3 tools/vllm_quant_paths.py --out {args.out} --seeds {args.seeds}",
    }
    with open(args.out, "w") as f:
        f.write(results_text(meta, results))


if __name__ == "__main__":
    main()
