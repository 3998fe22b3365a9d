"""Compile the kernels for sm_90 without a GPU and print what the PTX uses (run as a script,
with TRITON_INTERPRET unset: see test_compile_sm90.py)."""

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from epilora_kernels._fused_kernels import _lora_gemm_kernel, _quantize_shrink_kernel

TARGET = GPUTarget("cuda", 90, 32)
K1 = {"x_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "h_ptr": "*fp32",
      "a0_ptr": "*bf16", "a1_ptr": "*bf16", "a2_ptr": "*bf16", "sorted_ptr": "*i32",
      "lora_ids_ptr": "*i32", "counts_ptr": "*i32", "start_ptr": "*i32", "counter_ptr": "*i32",
      "T": "i32", "K": "i32", "R": "i32", "stride_x": "i32",
      "NUM_COUNTERS": "i32"}
K2 = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
      "y_ptr": "*bf16", "h_ptr": "*fp32", "b0_ptr": "*bf16", "b1_ptr": "*bf16", "b2_ptr": "*bf16",
      "sorted_ptr": "*i32", "lora_ids_ptr": "*i32", "start_ptr": "*i32", "partial_ptr": "*fp32",
      "counter_ptr": "*i32", "T": "i32", "N": "i32",
      "K": "i32", "R": "i32", "NUM_ENTRIES": "i32", "stride_a": "i32", "stride_y": "i32",
      "N_OFF1": "i32", "N_OFF2": "i32"}
PATTERN = (r"(div\.[a-z.0-9]+|rcp\.[a-z.0-9]+|cvt\.rn\.satfinite\.e4m3x2\.f32|mma\.sync|wgmma"
           r"|griddepcontrol\.[a-z_]+|atom\.[a-z_.0-9]+)")


def compile_ptx(fn, signature, constexprs, **options) -> str:
    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    source = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(source, target=TARGET, options=options).asm["ptx"]


def main() -> None:
    out = {}
    for quantize in (True, False):
        ptx = compile_ptx(_quantize_shrink_kernel, K1, dict(
            QUANTIZE=quantize, NUM_SLICES=3, SPLIT_K=8, BLOCK_M=16, BLOCK_R=64, BLOCK_K=128,
            QUANT_BLOCK=4096, INTERPRETER=False), num_warps=4)
        out[f"k1_quantize={quantize}"] = sorted(set(re.findall(PATTERN, ptx)))
    for mode in (0, 1, 2):
        sig = dict(K2)
        if mode:
            sig["a_ptr"] = "*bf16"
        ptx = compile_ptx(_lora_gemm_kernel, sig, dict(
            MODE=mode, HAS_LORA=True, NUM_SLICES=3, H_PLANES=8, SPLIT_K=1, BLOCK_M=16, BLOCK_N=32,
            BLOCK_K=256, BLOCK_R=64, INTERPRETER=False), num_warps=4, num_stages=4)
        out[f"k2_mode={mode}"] = sorted(set(re.findall(PATTERN, ptx)))
    for mode in (0,):  # the GEMM without adapters
        sig = dict(K2)
        ptx = compile_ptx(_lora_gemm_kernel, sig, dict(
            MODE=mode, HAS_LORA=False, NUM_SLICES=1, H_PLANES=1, SPLIT_K=1, BLOCK_M=16, BLOCK_N=32,
            BLOCK_K=256, BLOCK_R=16, INTERPRETER=False), num_warps=4, num_stages=4)
        out[f"gemm_only_mode={mode}"] = sorted(set(re.findall(PATTERN, ptx)))
    # The decode path: the shrink triggers its dependents; K2 waits after its K loop.
    ptx = compile_ptx(_quantize_shrink_kernel, K1, dict(
        QUANTIZE=False, NUM_SLICES=3, SPLIT_K=8, BLOCK_M=16, BLOCK_R=64, BLOCK_K=128,
        QUANT_BLOCK=4096, INTERPRETER=False, USE_PDL=True), num_warps=4)
    out["k1_pdl"] = sorted(set(re.findall(PATTERN, ptx)))
    sig = dict(K2)
    ptx = compile_ptx(_lora_gemm_kernel, sig, dict(
        MODE=0, HAS_LORA=True, NUM_SLICES=3, H_PLANES=8, SPLIT_K=1, BLOCK_M=16, BLOCK_N=32,
        BLOCK_K=256, BLOCK_R=64, INTERPRETER=False, USE_PDL=True), num_warps=4, num_stages=4)
    out["k2_pdl"] = sorted(set(re.findall(PATTERN, ptx)))
    # Where the wait sits: after main-loop MMAs (the overlap), before any global store.
    wait = ptx.find("griddepcontrol.wait")
    out["k2_pdl_mma_before_wait"] = 0 <= ptx.find("mma.sync") < wait
    out["k2_pdl_no_store_before_wait"] = wait > 0 and "st.global" not in ptx[:wait]
    # Split-K at decode: the partial stores and the tile counter's atomic come after the wait.
    ptx = compile_ptx(_lora_gemm_kernel, sig, dict(
        MODE=0, HAS_LORA=True, NUM_SLICES=3, H_PLANES=8, SPLIT_K=4, BLOCK_M=16, BLOCK_N=32,
        BLOCK_K=256, BLOCK_R=64, INTERPRETER=False, USE_PDL=True), num_warps=4, num_stages=4)
    wait = ptx.find("griddepcontrol.wait")
    out["k2_pdl_split_k"] = sorted(set(re.findall(PATTERN, ptx)))
    out["k2_pdl_split_k_atomic_after_wait"] = 0 < wait < ptx.find("atom.")
    out["k2_pdl_split_k_no_store_before_wait"] = wait > 0 and "st.global" not in ptx[:wait]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
