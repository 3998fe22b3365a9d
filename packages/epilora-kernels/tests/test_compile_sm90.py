"""The kernels compile for sm_90 on a CPU machine (Triton bundles ptxas), and K1's PTX uses the
instructions its bit-exactness rests on: `div.full.f32` (Triton's division, as Inductor's
compiled quantizer uses) and the hardware round-to-nearest e4m3 conversion."""

from epilora_kernels.launch import SHARED_BYTES

from kernel_cases import run_sm90_script


def test_kernels_compile_for_sm90_with_the_expected_instructions():
    found = run_sm90_script("aot_sm90.py")
    assert "div.full.f32" in found["k1_quantize=True"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in found["k1_quantize=True"]
    assert all("mma.sync" in found[f"k2_mode={m}"] for m in (0, 1, 2))
    # The K loops are software-pipelined (asynchronous copies to shared memory, as on the GPU:
    # the compile marks 16-aligned arguments as Triton's launcher does); the expand has none.
    for kernel in ("k1_quantize=True", "k2_mode=0", "k2_mode=1", "k2_pdl", "gemm_only_mode=0"):
        assert "cp.async.cg.shared.global" in found[kernel], kernel
    assert "mma.sync" in found["gemm_only_mode=0"]
    # The decode path's PDL: K1 triggers its dependents and releases its count of quantized
    # rows; K2 acquires the count before its main loop, waits for K1 after it (so the GEMM
    # overlaps the shrink) and stores nothing before the wait (its counters are atomics).
    assert "griddepcontrol.launch_dependents" in found["k1_pdl"]
    assert "atom.global.gpu.release.add.u32" in found["k1_pdl"]
    assert "griddepcontrol.wait" in found["k2_pdl"]
    assert found["k2_pdl_acquire_before_mma"]
    assert found["k2_pdl_mma_before_wait"] and found["k2_pdl_no_store_before_wait"]
    # Only the decode path's K2 warms L2 with its weight rows, before its spin.
    assert found["k2_pdl_prefetch_before_acquire"]
    assert "prefetch.global.L2" not in found["k2_mode=0"]
    # An L2Prefetch of the next weight: issued past the K loop, before the wait for K1.
    assert found["k2_prefetch_next_after_mma_before_wait"]
    assert found["k2_no_prefetch_after_mma_without_next"]
    assert found["k2_prefetch_start_before_mma_only"]  # at="start": before the K loop only,
    assert found["k2_prefetch_evict_last_at_start_only"]  # its lines evicted last
    # K1 after the kernel before (EPILORA_DECODE_AFTER_PREVIOUS), on x and on the caller's
    # codes: it waits for that kernel before any load, store or atomic and before triggering
    # K2; without the setting K1 waits for nothing.
    assert found["k1_after_previous_waits_first"] and found["k1_waits_only_after_previous"]
    # The timeline's clocks (TRACE) are compiled out of every shipped launch.
    assert not any("%globaltimer" in ops for ops in found.values() if isinstance(ops, list))
    # Split-K: partials and the tile counter's acq_rel atomic only after the wait.
    assert "griddepcontrol.wait" in found["k2_pdl_split_k"]
    atomics = [op for op in found["k2_pdl_split_k"] if op.startswith("atom.global.gpu")]
    assert "atom.global.gpu.acq_rel.add.u32" in atomics
    assert found["k2_pdl_split_k_tile_counter_after_wait"]
    assert found["k2_pdl_split_k_no_store_before_wait"]
    # The proxy fences of the decode path's hand-off to TMA loads, and only there.
    assert found["k1_fence_before_release"] and found["k2_fence_after_acquire_before_tma"]
    assert found["no_fence_without_tma"]
    # K2 swapped (swap_ab): its K loop on wgmma's 64 x 16 tiles, the weight by TMA, in the
    # decode path's order (acquire, fence, TMA, MMA, then the wait for K1; no store before).
    assert found["k2_swap_ab_wgmma_n16"] and found["k2_swap_ab_order"]
    # Several slots: the epilogue's loop over adapter segments waits for each slice of B in
    # turn, or with LaunchConfig(segment_stages=8) keeps several in flight.
    assert found["k2_segment_loop_waits_1"] == [0], found["k2_segment_loop_waits_1"]
    assert max(found["k2_segment_loop_waits_8"]) >= 2, found["k2_segment_loop_waits_8"]
    assert found["k2_swap_ab_codes_loads"]
    # the promotion of each K tile's sum: a 64 x 16 fp32 tile over 128 threads, 8 FADDs each
    promoted, fast = found["k2_swap_ab_promotes"]
    assert promoted >= fast + 8, (promoted, fast)
    # W8A16 in FP8-sized swapped tiles, fitted to its bf16 activations: 7 of 8 stages, within
    # the 232,448 bytes of shared memory an sm_90 block may take (8 stages: 245,816)
    stages, shared = found["w8a16_swapped_fitted"]
    assert stages == 7 and shared <= 232448
    # EPILORA_DELTA_KERNEL=1: K2 waits for the delta kernel before its K loop
    assert found["k2_delta_serial_waits_before_mma"]


def test_every_launch_compiles_for_sm90_with_the_arguments_its_launcher_passes():
    launches = run_sm90_script("aot_launchers_sm90.py")
    # epilora_kernels.compile_only: every launch a compile without a run (Triton's warmup),
    # with the launch's own kernel, arguments and grid, so the launch then finds it compiled.
    compile_only = {name: launches.pop(name) for name in list(launches)
                    if name.startswith("compile_only_")}
    assert compile_only == {f"compile_only_{name}": {"warmups": n, "launches": n, "same": True}
                            for name, n in (("decode", 2), ("fused", 2), ("per_channel", 6))}
    assert launches == {"quantize": 1, "fp8_gemm_from_bf16": 2, "fused": 2, "fused_split_k": 2,
                        "decode": 2, "decode_split_k": 2, "decode_traced": 2,
                        "k1_eight_warps_wide": 1, "w8a16": 2, "decode_one_launch": 3,
                        "decode_gathered": 4,
                        "k1_slices_together": 4, "fused_delta_kernel": 9,
                        "fused_epilogue_early": [2, 1], "expand": 2,
                        "per_channel": 6}


def test_k1_shared_memory_is_what_the_tuner_counts_before_compiling():
    # The tuner drops K1 candidates whose buffers exceed an sm_90 block's shared memory
    # (`tuner.k1_shared_bytes`) instead of compiling them to fail: its count must be the
    # compile's, on bf16 x and on codes, below and from 64 rows, one slice a program or three,
    # and on tiles beyond the limit (those the H100 tuner run of e968ccc failed to load)
    found = run_sm90_script("aot_k1_shared_sm90.py")
    assert len(found) == 30
    assert sum(shared > SHARED_BYTES for shared, _ in found.values()) >= 5
    assert {tile: shared for tile, (shared, _) in found.items()} == {
        tile: counted for tile, (_, counted) in found.items()}
