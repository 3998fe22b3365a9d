"""Wave fitting of K2 at the decode token counts (`_tiling.fit_waves`): the arithmetic of the
waves, the candidates it may choose among, and its choice from measured occupancies (a stand-in
for the compiled kernels' blocks per SM, which need a GPU: tests/gpu/test_api_gpu.py runs the
real one)."""

import dataclasses
import json

import pytest

from epilora_kernels import _tiling, launch
from epilora_kernels.launch import LaunchConfig

SMS = 132
DECODE_K2 = LaunchConfig(block_m=16, block_n=64, block_k=256, block_r=64, num_stages=3)


def test_blocks_per_sm_is_bound_by_registers_shared_memory_and_threads():
    # 146 registers x 128 threads: 19 456 registers a block after rounding, 3 in 65 536.
    assert _tiling.blocks_per_sm(146, 40960, 4) == 3
    assert _tiling.blocks_per_sm(128, 40960, 4) == 4  # 16 384 a block
    assert _tiling.blocks_per_sm(32, 110 * 1024, 4) == 2  # shared memory: 2 x 111 KB
    assert _tiling.blocks_per_sm(16, 0, 32) == 2  # 1024 threads a block, 2048 an SM


@pytest.mark.parametrize("programs, per_sm, expected", [
    (384, 3, 1.0),          # Qwen3-8B's gate_up in 64-wide tiles: one wave of 396
    (448, 3, 448 / 792),    # Llama-3.1-8B's: a second wave of 52
    (224, 2, 1.0),          # the same in 128-wide tiles, 2 blocks an SM: one wave
    (66, 4, 0.5),           # fewer programs than SMs: half of them idle
    (1184, 3, 1184 / 1188),  # three nearly full waves
    (10, 0, 0.0),           # fits no SM
])
def test_wave_efficiency(programs, per_sm, expected):
    assert _tiling.wave_efficiency(programs, per_sm, SMS) == pytest.approx(expected)


def test_wave_candidates_keep_tiles_within_slices_and_splits_deep_enough():
    qkv = (4096, 512, 512)  # slice boundaries 4096 and 4608: 128-wide tiles stay within one
    cands = _tiling.wave_candidates(DECODE_K2, 4096, qkv)
    assert cands[0] == DECODE_K2
    assert {c.block_n for c in cands} == {32, 64, 128}
    assert {c.split_k for c in cands} == {1, 2}
    assert all(c.num_stages in (3,) for c in cands)
    # Slices 4096 + 96: only 32-wide tiles stay within one slice (96 % 64 != 0).
    narrow = _tiling.wave_candidates(DECODE_K2, 4096, (96, 4096))
    assert {c.block_n for c in narrow[1:]} == {32}
    # K = 256: one K tile, no split.
    shallow = _tiling.wave_candidates(DECODE_K2, 256, (4096,))
    assert {c.split_k for c in shallow} == {1}


def _grid(cfg: LaunchConfig, t: int, n: int) -> int:
    return -(-t // cfg.block_m) * -(-n // cfg.block_n) * cfg.split_k


def test_fit_waves_keeps_a_setting_that_fills_its_waves_and_measures_nothing_else():
    measured = []

    def measure(cfg):
        measured.append(cfg)
        return _grid(cfg, 1, 24576), 3  # Qwen3-8B's gate_up: 384 programs, one wave

    cands = _tiling.wave_candidates(DECODE_K2, 4096, (12288, 12288))
    assert _tiling.fit_waves(DECODE_K2, cands, measure, SMS) == DECODE_K2
    assert measured == [DECODE_K2]


def test_fit_waves_moves_a_straggling_grid_into_one_wave():
    # Llama-3.1-8B's gate_up: 64-wide tiles hold B in registers (3 blocks an SM: 448 programs
    # for 396 places); 128-wide tiles load B after the K loop and fit 2 an SM (224 for 264).
    def measure(cfg):
        per_sm = {32: 4, 64: 3, 128: 2}[cfg.block_n]
        return _grid(cfg, 1, 28672), per_sm

    cands = _tiling.wave_candidates(DECODE_K2, 4096, (14336, 14336))
    chosen = _tiling.fit_waves(DECODE_K2, cands, measure, SMS)
    assert (chosen.block_n, chosen.split_k) == (128, 1)
    assert dataclasses.replace(chosen, block_n=64) == DECODE_K2  # nothing else changed


def test_fit_waves_prefers_full_waves_then_no_split_and_skips_what_does_not_compile():
    def measure(cfg):
        if cfg.block_n == 32:
            return None  # does not compile or fit
        return _grid(cfg, 1, 37888), {64: 3, 128: 2}[cfg.block_n]  # Qwen2.5-7B's gate_up

    cands = _tiling.wave_candidates(DECODE_K2, 3584, (18944, 18944))
    chosen = _tiling.fit_waves(DECODE_K2, cands, measure, SMS)
    # 64-wide split in two: 1184 programs in three nearly full waves of 396.
    assert (chosen.block_n, chosen.split_k) == (64, 2)

    def equal(cfg):
        return 132 * cfg.split_k, 1  # every candidate one full wave per split
    assert _tiling.fit_waves(DECODE_K2, cands[1:], equal, SMS).split_k == 1
    assert _tiling.fit_waves(DECODE_K2, cands, lambda cfg: None, SMS) == DECODE_K2


def test_tuned_exactly_tells_a_shapes_own_entries_from_a_nearer_shapes(tmp_path,
                                                                       monkeypatch):
    table = {"lora_gemm": {"4096x4096": {"1": {}}, "8192x4096@r64/one-slot": {"1": {}},
                           "16384x1024": {"1": {}}, "16384x1536": {"64": {"block_m": 64}}}}
    monkeypatch.setattr(launch.resources, "files", lambda _: tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "Fake_GPU.json").write_text(json.dumps(table))
    monkeypatch.setenv("EPILORA_CACHE_DIR", str(tmp_path / "cache"))
    launch.clear_table_cache()
    try:
        assert launch.tuned_exactly("Fake GPU", "lora_gemm", 4096, 4096)
        assert not launch.tuned_exactly("Fake GPU", "lora_gemm", 4608, 4096)  # nearest only
        assert launch.tuned_exactly("Fake GPU", "lora_gemm", 8192, 4096, 64, one_slot=True)
        assert not launch.tuned_exactly("Fake GPU", "lora_gemm", 8192, 4096, 64)
        assert not launch.tuned_exactly("Fake GPU", "lora_gemm", 8192, 4096, 16, one_slot=True)
        # the nearest-shape lookup itself still lends 4096x4096's entries to 4608x4096
        assert launch.table_config("Fake GPU", "lora_gemm", 1, 4608, 4096) is not None
        # Given the batch's tokens, an entry the launchers take for it: 4096x4096's one bucket
        # (1) covers one token; at 2-32 tokens they take the heuristic's (no bucket up to 32
        # covers them), at 33-256 the largest bucket, beyond the heuristic's prefill tiles.
        assert [launch.tuned_exactly("Fake GPU", "lora_gemm", 4096, 4096, tokens=t)
                for t in (1, 2, 32, 33, 256, 257)] == [True, False, False, True, True, False]
        assert launch.select_config("Fake GPU", "lora_gemm", 2, 4096, 4096, 16) == (
            launch.select_config(None, "lora_gemm", 2, 4096, 4096, 16))  # the heuristic's
        # At 64 tokens 16384x1024's own largest bucket (1) gives way to the near 16384x1536's
        # 64-token one, which the launchers take
        assert not launch.tuned_exactly("Fake GPU", "lora_gemm", 16384, 1024, tokens=64)
        assert launch.select_config("Fake GPU", "lora_gemm", 64, 16384, 1024, 16).block_m == 64
        assert launch.tuned_exactly("Fake GPU", "lora_gemm", 16384, 1024, tokens=1)
    finally:
        launch.clear_table_cache()


def test_fit_waves_keeps_the_setting_in_use_where_nothing_fills_the_waves_better():
    # Every candidate fills 600 / (3 x 264) = 0.76 of its waves: the setting in use stays,
    # though an unsplit, deeper candidate would win the other ties.
    cands = _tiling.wave_candidates(dataclasses.replace(DECODE_K2, split_k=2), 4096,
                                    (12288, 12288))
    assert _tiling.fit_waves(cands[0], cands, lambda cfg: (600, 2), SMS) == cands[0]
    assert cands[0].split_k == 2
