"""Compile the kernels for sm_90 without a GPU and print what the PTX uses (run as a script,
with TRITON_INTERPRET unset: see test_compile_sm90.py). The launches are the launchers' own,
recorded on CPU tensors (aot_launchers_sm90.py), with fixed launch settings."""

import dataclasses
import json
import re

import torch

import epilora_kernels as ek
from epilora_kernels import fused
from epilora_kernels.launch import LaunchConfig

from aot_launchers_sm90 import compile_launch, compile_launch_full, record_launches
from kernel_cases import make_problem

PATTERN = (r"(div\.[a-z.0-9]+|rcp\.[a-z.0-9]+|cvt\.rn\.satfinite\.e4m3x2\.f32|mma\.sync|wgmma"
           r"|griddepcontrol\.[a-z_]+|atom\.[a-z_.0-9]+|ld\.global\.gpu\.acquire"
           r"|prefetch\.global\.L2|%globaltimer|cp\.async\.c[ag]\.shared\.global"
           r"|fence\.proxy\.async\.global)")
K1 = LaunchConfig(block_m=16, block_k=128, block_r=64, split_k=8, num_stages=2)
K2 = LaunchConfig(block_m=16, block_n=32, block_k=256, block_r=64, num_stages=4)
K2_SPLIT = LaunchConfig(block_m=16, block_n=32, block_k=256, block_r=64, split_k=4,
                        num_stages=4)


def ptx_of(launch) -> list[str]:
    return [compile_launch(*call) for call in record_launches(launch)]


def found(ptx: str) -> list[str]:
    return sorted(set(re.findall(PATTERN, ptx)))


def main() -> None:
    x, weight, w_scale, lora, batch = make_problem(0, 5, 256, (64, 32, 32), 64, 4,
                                                   "mixed_with_base")
    k1_quantize, k2_mode0 = ptx_of(lambda: fused.fused_lora_fp8_linear(
        x, weight, w_scale, lora, batch, k1_config=K1, k2_config=K2))
    k1_shrink, k2_mode1 = ptx_of(lambda: fused.fused_lora_w8a16_linear(
        x, weight, w_scale, lora, batch, k1_config=K1, k2_config=K2))
    h = torch.zeros(K1.split_k, 3, 5, 64)
    (k2_mode2,) = ptx_of(lambda: fused.lora_expand(
        torch.zeros(5, 128, dtype=torch.bfloat16), h, lora, batch, config=K2))
    codes, scales = torch.zeros(5, 256, dtype=torch.float8_e4m3fn), torch.ones(5, 1)
    (gemm_only,) = ptx_of(lambda: fused.fp8_gemm(codes, scales, weight, w_scale, config=K2))
    out = {"k1_quantize=True": found(k1_quantize), "k1_quantize=False": found(k1_shrink),
           "k2_mode=0": found(k2_mode0), "k2_mode=1": found(k2_mode1),
           "k2_mode=2": found(k2_mode2), "gemm_only_mode=0": found(gemm_only)}
    # The decode path: K1 triggers its dependents and releases its count of quantized rows;
    # K2 acquires that count before its K loop, waits for K1 after it (the overlap), and
    # writes nothing but those counters (atomics) before the wait.
    k1_pdl, k2_pdl = ptx_of(lambda: fused.decode_lora_fp8_linear(
        x, weight, w_scale, lora, batch, k1_config=K1, k2_config=K2))
    out["k1_pdl"], out["k2_pdl"] = found(k1_pdl), found(k2_pdl)
    wait = k2_pdl.find("griddepcontrol.wait")
    mma = k2_pdl.find("mma.sync")
    out["k2_pdl_acquire_before_mma"] = 0 <= k2_pdl.find("ld.global.gpu.acquire") < mma
    out["k2_pdl_mma_before_wait"] = 0 <= mma < wait
    out["k2_pdl_no_store_before_wait"] = wait > 0 and "st.global" not in k2_pdl[:wait]
    # The L2 warming of its weight rows is issued before the spin, not after.
    out["k2_pdl_prefetch_before_acquire"] = (
        0 <= k2_pdl.find("prefetch.global.L2") < k2_pdl.find("ld.global.gpu.acquire"))
    # With an L2Prefetch of the next weight: those prefetches come after the K loop's MMAs and
    # before the wait for K1 (they depend on nothing and store nothing); without one, K2's only
    # prefetches are its own rows', before the loop.
    next_weight = torch.zeros(96, 256, dtype=torch.float8_e4m3fn)
    k2_next = ptx_of(lambda: fused.decode_lora_fp8_linear(
        x, weight, w_scale, lora, batch, k1_config=K1, k2_config=K2,
        prefetch=ek.L2Prefetch(next_weight, 96 * 256)))[-1]
    wait_next = k2_next.find("griddepcontrol.wait")
    before_wait = k2_next[:wait_next]  # the epilogue's MMAs come after the wait
    out["k2_prefetch_next_after_mma_before_wait"] = (
        wait_next > 0 and 0 <= before_wait.rfind("mma.sync") < before_wait.rfind(
            "prefetch.global.L2"))
    # at="start", on the caller's codes (no warming of its own rows): before the first MMA,
    # none between the K loop and the wait.
    codes_given = (torch.zeros(5, 256, dtype=torch.float8_e4m3fn), torch.ones(5, 1))
    k2_early = ptx_of(lambda: fused.decode_lora_fp8_linear(
        None, weight, w_scale, lora, batch, k1_config=K1, k2_config=K2, x_quantized=codes_given,
        prefetch=ek.L2Prefetch(next_weight, 96 * 256, at="start")))[-1]
    wait_early = k2_early.find("griddepcontrol.wait")
    out["k2_prefetch_start_before_mma_only"] = (
        wait_early > 0 and 0 <= k2_early.find("prefetch.global.L2") < k2_early.find("mma.sync")
        and k2_early[:wait_early].rfind("prefetch.global.L2")
        < k2_early[:wait_early].rfind("mma.sync"))
    out["k2_prefetch_evict_last_at_start_only"] = (
        "prefetch.global.L2::evict_last" in k2_early
        and "prefetch.global.L2::evict_last" not in k2_next)
    out["k2_no_prefetch_after_mma_without_next"] = (
        k2_pdl.rfind("prefetch.global.L2") < k2_pdl.find("mma.sync"))
    # EPILORA_DECODE_AFTER_PREVIOUS=1: K1 waits for the kernel before it (griddepcontrol.wait)
    # before anything else, K2's trigger included: no load, store or atomic before the wait.
    import os

    os.environ["EPILORA_DECODE_AFTER_PREVIOUS"] = "1"
    try:
        k1_after_codes, _ = ptx_of(lambda: fused.decode_lora_fp8_linear(
            None, weight, w_scale, lora, batch, k1_config=K1, k2_config=K2,
            x_quantized=codes_given))
        k1_after_x, _ = ptx_of(lambda: fused.decode_lora_fp8_linear(
            x, weight, w_scale, lora, batch, k1_config=K1, k2_config=K2))
    finally:
        del os.environ["EPILORA_DECODE_AFTER_PREVIOUS"]

    def waits_first(ptx: str) -> bool:
        wait = ptx.find("griddepcontrol.wait")
        return 0 <= wait < ptx.find("griddepcontrol.launch_dependents") and not any(
            op in ptx[:wait] for op in ("ld.global", "st.global", "atom.", "cp.async"))

    out["k1_after_previous_waits_first"] = (waits_first(k1_after_codes)
                                            and waits_first(k1_after_x))
    out["k1_waits_only_after_previous"] = "griddepcontrol.wait" not in k1_pdl
    # Split-K at decode: the partial stores and the tile counter's atomic come after the wait
    # (before it, the same counter atomics as without split-K).
    k2_split = ptx_of(lambda: fused.decode_lora_fp8_linear(
        x, weight, w_scale, lora, batch, k1_config=K1, k2_config=K2_SPLIT))[-1]
    split_wait = k2_split.find("griddepcontrol.wait")
    out["k2_pdl_split_k"] = found(k2_split)
    out["k2_pdl_split_k_tile_counter_after_wait"] = (
        0 < split_wait < k2_split.rfind("atom.global.gpu.acq_rel")
        and k2_split[:split_wait].count("atom.") == k2_pdl[:wait].count("atom."))
    out["k2_pdl_split_k_no_store_before_wait"] = (
        split_wait > 0 and "st.global" not in k2_split[:split_wait])
    # Beyond 32 tokens with 64-row K2 tiles the decode path's K2 reads K1's codes by TMA (the
    # async proxy) after acquiring their count, which orders generic accesses only: K1 fences
    # its codes before the release, K2 after the acquire and before its first TMA load.
    big = make_problem(0, 70, 256, (64, 32, 32), 64, 4, "mixed_with_base")
    k2_tma = LaunchConfig(block_m=64, block_n=32, block_k=64, block_r=64, num_stages=3)
    k1_sorted, k2_sorted = ptx_of(lambda: fused.decode_lora_fp8_linear(
        *big, k1_config=K1, k2_config=k2_tma))
    fence = "fence.proxy.async.global"
    out["k1_fence_before_release"] = 0 <= k1_sorted.find(fence) < k1_sorted.find(
        "atom.global.gpu.release")
    acquire = k2_sorted.find("ld.global.gpu.acquire")
    out["k2_fence_after_acquire_before_tma"] = 0 <= acquire < k2_sorted.find(fence) < \
        k2_sorted.find("cp.async.bulk.tensor")
    out["no_fence_without_tma"] = fence not in k1_pdl and fence not in k2_pdl
    # K2 swapped (`swap_ab`) in the decode path: the K loop on wgmma's 64-row tiles (the
    # weight's side; 16 tokens are its n) with the weight by TMA, K1's sorted codes by TMA
    # after the acquire and the fence; the wait for K1 still after the loop, no store before.
    wide = make_problem(0, 5, 256, (128, 64, 64), 64, 4, "mixed_with_base")
    swapped = LaunchConfig(block_m=16, block_n=64, block_k=128, block_r=64, num_stages=4,
                           swap_ab=True)
    _, k2_swap = ptx_of(lambda: fused.decode_lora_fp8_linear(*wide, k1_config=K1,
                                                             k2_config=swapped))
    _, k2_swap_codes = ptx_of(lambda: fused.decode_lora_fp8_linear(
        None, *wide[1:], k1_config=K1, k2_config=swapped, x_quantized=(
            torch.zeros(5, 256, dtype=torch.float8_e4m3fn), torch.ones(5, 1))))
    out["k2_swap_ab"], out["k2_swap_ab_codes"] = found(k2_swap), found(k2_swap_codes)
    wgmma = "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"
    swap_wait = k2_swap.find("griddepcontrol.wait")
    out["k2_swap_ab_wgmma_n16"] = wgmma in k2_swap and wgmma in k2_swap_codes
    out["k2_swap_ab_order"] = (
        0 <= k2_swap.find("ld.global.gpu.acquire") < k2_swap.find(fence)
        < k2_swap.find("cp.async.bulk.tensor") < k2_swap.find(wgmma) < swap_wait
        and "st.global" not in k2_swap[:swap_wait])
    # Each K tile's FP8 sum promoted to fp32: FADDs in the K loop (before the wait for K1)
    # that the same launch without the promotion lacks (dev/launch_variants' swap-ab-fast-acc)
    from epilora_kernels import _launchers

    _launchers.SWAP_AB_PROMOTE = False
    _launchers._K2_TEMPLATES.clear()  # made with the constant in force
    try:
        _, k2_fast_acc = ptx_of(lambda: fused.decode_lora_fp8_linear(*wide, k1_config=K1,
                                                                     k2_config=swapped))
    finally:
        _launchers.SWAP_AB_PROMOTE = True
        _launchers._K2_TEMPLATES.clear()

    def loop_adds(ptx: str) -> int:
        return len(re.findall(r"\badd\.f32", ptx[:ptx.find("griddepcontrol.wait")]))

    out["k2_swap_ab_promotes"] = [loop_adds(k2_swap), loop_adds(k2_fast_acc)]
    # on the caller's codes: the weight by TMA, the codes by asynchronous copies
    out["k2_swap_ab_codes_loads"] = ("cp.async.bulk.tensor" in k2_swap_codes
                                     and "cp.async.cg.shared.global" in k2_swap_codes
                                     and fence not in k2_swap_codes)
    # W8A16 in the tuner's deepest swapped tiles (FP8-sized: 8 stages of 32 x 64 x 256), as
    # fused._w8a16_tiles fits them (7 stages): within an sm_90 block's shared memory.
    deep = LaunchConfig(block_m=32, block_n=64, block_k=256, block_r=64, num_stages=8,
                        swap_ab=True)
    fitted = fused._w8a16_tiles(deep, w_by_tma=True)
    (w8a16_swapped,) = [compile_launch_full(*call) for call in record_launches(
        lambda: fused.lora_w8a16_gemm(wide[0], wide[1], wide[2], torch.zeros(1, 3, 5, 64),
                                      wide[3], wide[4], config=fitted))]
    out["w8a16_swapped_fitted"] = [fitted.num_stages, w8a16_swapped.metadata.shared]
    # Several slots: eight tokens, each its own adapter, meet a decode tile as eight segments.
    # The epilogue's loop over them waits for each slice of B in turn (cp.async.wait_group 0
    # only), or with segment_stages=8 keeps several in flight (it waits with 6 pending).
    tenants = make_problem(0, 8, 256, (64, 32, 32), 16, 8, "one_token_each")
    for stages in (1, 8):
        _, k2_tenants = ptx_of(lambda stages=stages: fused.decode_lora_fp8_linear(
            *tenants, k1_config=K1, k2_config=dataclasses.replace(K2, segment_stages=stages)))
        tail = k2_tenants[k2_tenants.find("griddepcontrol.wait"):]
        out[f"k2_segment_loop_waits_{stages}"] = sorted({int(n) for n in re.findall(
            r"cp\.async\.wait_group\s+(\d+)", tail)})
    # EPILORA_DELTA_KERNEL=1 on the fused path (several slots, 64-row K2 tiles): K2, the
    # delta kernel's PDL dependent, waits for it (and so all of K1) before its first MMA.
    slots = make_problem(0, 70, 256, (64, 32, 32), 64, 4, "mixed_with_base")
    k2_rows64 = LaunchConfig(block_m=64, block_n=32, block_k=64, block_r=64, num_stages=3)
    os.environ["EPILORA_DELTA_KERNEL"] = "1"
    try:
        _, _, k2_serial = ptx_of(lambda: fused.fused_lora_fp8_linear(
            *slots, k1_config=K1, k2_config=k2_rows64))
    finally:
        del os.environ["EPILORA_DELTA_KERNEL"]
    serial_mma = min(i for i in (k2_serial.find("mma.sync"), k2_serial.find("wgmma")) if i >= 0)
    out["k2_delta_serial_waits_before_mma"] = (
        0 <= k2_serial.find("griddepcontrol.wait") < serial_mma)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
