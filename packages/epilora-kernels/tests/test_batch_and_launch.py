import dataclasses
import functools
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from epilora_kernels.batch import AdapterBatch, LoraWeights
from epilora_kernels.launch import LaunchConfig, heuristic_config, validate_table


@pytest.fixture
def gpu_table(tmp_path, monkeypatch):
    """`install(table)`: the launchers read `table` as device "Test GPU"'s shipped table (again
    after each call); the table cache is cleared before and after."""
    from epilora_kernels import launch

    (tmp_path / "configs").mkdir()
    monkeypatch.setattr(launch.resources, "files", lambda _pkg: tmp_path)

    def install(table: dict) -> None:
        (tmp_path / "configs" / "Test_GPU.json").write_text(json.dumps(table))
        launch._load_table.cache_clear()

    yield install
    launch._load_table.cache_clear()


def test_metadata_matches_vllm_layout():
    batch = AdapterBatch.from_token_mapping(torch.tensor([2, -1, 0, 2, -1], dtype=torch.int32), 4)
    assert batch.sorted_token_indices.tolist() == [1, 4, 2, 0, 3]
    assert batch.lora_ids.tolist() == [-1, 0, 2, -1, -1]
    assert batch.num_tokens_per_lora.tolist() == [2, 1, 2, 0, 0]
    assert batch.lora_token_start.tolist() == [0, 2, 3, 5, 5, 5]


def test_metadata_from_a_strided_mapping_is_contiguous():
    # A column of a wider tensor (int32 already, so `.to` returns the same strided view).
    mapping = torch.tensor([[2, 9], [-1, 9], [0, 9]], dtype=torch.int32)[:, 0]
    batch = AdapterBatch.from_token_mapping(mapping, 4)
    assert batch.token_lora_mapping.is_contiguous()
    assert batch.token_lora_mapping.tolist() == [2, -1, 0]


def test_metadata_rejects_slots_out_of_range():
    with pytest.raises(ValueError, match=r"\[-1, 3\]"):
        AdapterBatch.from_token_mapping(torch.tensor([4]), 4)


def test_lora_weights_check_shapes():
    a = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    b = torch.zeros(2, 1, 32, 8, dtype=torch.bfloat16)
    LoraWeights((a,), (b,), (32,))
    with pytest.raises(ValueError, match="does not match"):
        LoraWeights((a,), (b,), (16,))
    with pytest.raises(ValueError, match="1..3 slices"):
        LoraWeights((a,) * 4, (b,) * 4, (32,) * 4)


def test_launch_config_validation_and_heuristic():
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(block_m=24)
    for tokens in (1, 8, 32, 64, 256):
        for rank in (1, 16, 64, 128):
            for slices in ((6144,), (4096, 1024, 1024), (4096, 1040, 1040), (96, 48)):
                k2 = heuristic_config("lora_gemm", tokens, sum(slices), 4096, rank, slices)
                # K2 holds the whole rank in its epilogue and never straddles two slices; it
                # splits K only where K is at least twice N, always at 1-16 tokens (where it
                # splits, it keeps its plain tiles there)
                deep = 4096 >= 2 * sum(slices)
                assert k2.block_r >= rank and k2.split_k in ((1, 2) if deep else (1,)), k2
                assert tokens > 16 or k2.split_k == (2 if deep else 1), (tokens, k2)
                assert all(width % k2.block_n == 0 for width in slices[:-1]), (slices, k2)
                k1 = heuristic_config("quantize_shrink", tokens, sum(slices), 4096, rank)
                # the split K loop covers K in whole BLOCK_K steps of at least 256 each
                assert k1.split_k * k1.block_k <= 4096 and 4096 // k1.split_k >= 256, k1
    with pytest.raises(ValueError, match="unknown op"):
        heuristic_config("gemm", 1, 64, 64, 16)


def test_decode_k2_swaps_its_tiles_where_plain_ones_leave_sms_idle():
    # 2-16 tokens: swapped 64-row weight tiles (wgmma, the one-wave pipeline) where the plain
    # 32-wide tiles are fewer programs than 132 SMs (o: 128; Qwen2.5-7B's o: 112), plain
    # where they give each SM one (qkv 192, down 128 x 2 split, gate_up); one token plain
    for tokens in (2, 4, 8, 16):
        for n, k in ((4096, 4096), (3584, 3584)):
            cfg = heuristic_config("lora_gemm", tokens, n, k, 64)
            assert (cfg.swap_ab, cfg.block_n, cfg.block_k, cfg.split_k) == (True, 64, 256, 1)
        for n, k, slices in ((6144, 4096, (4096, 1024, 1024)), (4096, 12288, ()),
                             (24576, 4096, (12288, 12288))):
            assert not heuristic_config("lora_gemm", tokens, n, k, 64, slices).swap_ab
    assert not heuristic_config("lora_gemm", 1, 4096, 4096, 64).swap_ab
    # a plain tile that splits K (K >= 2N) stays plain: unsplit, the swapped tile would be a
    # quarter of its programs (a small model's down, 1536 x 8960: 96 plain, 24 swapped)
    down = heuristic_config("lora_gemm", 8, 1536, 8960, 64)
    assert (down.swap_ab, down.split_k, down.block_n) == (False, 2, 32), down
    # without sm_90's shared memory (sm_89) nothing is swapped
    assert not heuristic_config("lora_gemm", 4, 4096, 4096, 64, large_tiles=False).swap_ab


def test_several_slots_take_swapped_decode_tiles_where_the_swapped_grid_is_wide_enough():
    # Several slots at 2-16 tokens: the swapped tile (64 weight rows, K whole) on every shape
    # whose swapped grid has SWAP_MIN_PROGRAMS programs, where one slot keeps plain tiles
    # (qkv, gate_up, down split in two), 256 deep but 128 deep where the grid is larger than
    # the SMs (gate_up's 384 programs); one token, a small model's down (24 swapped
    # programs) and sm_89 keep theirs; select_config passes the rule on for several slots only
    from epilora_kernels import launch

    shapes = ((6144, 4096, (4096, 1024, 1024)), (4096, 12288, ()), (24576, 4096, (12288, 12288)),
              (3584, 18944, ()))
    for tokens in (2, 4, 8, 16):
        for n, k, slices in shapes:
            one = heuristic_config("lora_gemm", tokens, n, k, 16, slices)
            several = heuristic_config("lora_gemm", tokens, n, k, 16, slices, several_slots=True)
            assert not one.swap_ab
            deep = 128 if -(-n // 64) > launch.H200_SMS else 256
            assert (several.swap_ab, several.block_n, several.block_k, several.split_k) == (
                True, 64, deep, 1), (tokens, n, several)
            assert launch.select_config(None, "lora_gemm", tokens, n, k, 16, slices,
                                        one_slot=False) == several
            assert launch.select_config(None, "lora_gemm", tokens, n, k, 16, slices,
                                        one_slot=True) == one
            assert launch.select_config(None, "lora_gemm", tokens, n, k, 16, slices,
                                        one_slot=None) == one
    assert -(-1536 // 64) < launch.SWAP_MIN_PROGRAMS <= -(-3584 // 64)
    # 17-32 tokens: gate_up's swapped grid is larger than the SMs with one slot too, where
    # the tile stays 256 deep
    halves = (12288, 12288)
    for tokens in (17, 32):
        one = heuristic_config("lora_gemm", tokens, 24576, 4096, 16, halves)
        several = heuristic_config("lora_gemm", tokens, 24576, 4096, 16, halves,
                                   several_slots=True)
        assert (one.swap_ab, one.block_k, several.swap_ab, several.block_k) == (
            True, 256, True, 128)
        assert several == launch.swap_candidate(one, 24576, 4096, halves, tokens, block_k=128)
    small_down = heuristic_config("lora_gemm", 8, 1536, 8960, 16, several_slots=True)
    assert (small_down.swap_ab, small_down.split_k) == (False, 2)
    assert not heuristic_config("lora_gemm", 1, 6144, 4096, 16, several_slots=True).swap_ab
    assert not heuristic_config("lora_gemm", 8, 6144, 4096, 16, large_tiles=False,
                                several_slots=True).swap_ab


def test_prefill_k2_takes_prefill_tiles_unless_a_bucket_covers_the_batch(gpu_table):
    from epilora_kernels import launch

    prefill = launch.PREFILL_MIN_TOKENS + 1
    k2 = heuristic_config("lora_gemm", prefill, 6144, 4096, 64, (4096, 1024, 1024))
    assert (k2.block_m, k2.block_n, k2.block_k, k2.num_warps) == (128, 256, 128, 8), k2
    # 512 x 4096 in 128 x 256 tiles is 64 programs, half a wave of 132 SMs: 128-wide tiles
    assert heuristic_config("lora_gemm", 512, 4096, 4096, 64).block_n == 128
    assert heuristic_config("lora_gemm", 2048, 4096, 4096, 64).block_n == 256
    k1 = heuristic_config("quantize_shrink", prefill, 6144, 4096, 64)
    assert (k1.block_m, k1.block_r, k1.split_k) == (64, 32, 4), k1
    # Several slices, and a grid that still gives each of 132 SMs a program: every slice in
    # one program, in 64-deep K steps of 4 stages; one slice, or fewer programs, the plain tile
    qkv = (4096, 1024, 1024)
    for op in ("quantize_shrink", "shrink"):
        together = heuristic_config(op, 2048, 6144, 4096, 64, qkv)
        assert (together.slices_together, together.block_k, together.num_stages,
                together.block_m, together.block_r, together.split_k) == (
            True, 64, 4, 64, 32, 4), together
        assert heuristic_config(op, 2048, 4096, 4096, 64, (4096,)) == k1
        # 512 tokens: 8 row tiles x 2 rank tiles x split 4 = 64 programs, under 132
        assert not heuristic_config(op, 512, 6144, 4096, 64, qkv).slices_together
        # rank 16 (one rank tile) at 2048 tokens: 128 programs together, under 132
        assert not heuristic_config(op, 2048, 6144, 4096, 16, qkv).slices_together
        assert heuristic_config(op, 4096, 6144, 4096, 16, qkv).slices_together
    # sm_89's blocks get 99 KB of shared memory: no prefill tiles there
    from epilora_kernels import _launchers, _tiling, fused
    from epilora_kernels.arch import INTERPRETER, DeviceSupport
    l40s = DeviceSupport("NVIDIA L40S", (8, 9), fp8_mma=True, pdl=False, tma=False,
                         interpreter=False)
    assert _tiling.shape_config(l40s, "lora_gemm", 2048, 6144, 4096, 64, ()).block_m == 64
    assert _tiling.shape_config(INTERPRETER, "lora_gemm", 2048, 6144, 4096, 64, ()).block_m == 128
    # W8A16's bf16 operands would overflow the wide tile's shared memory: 128-wide, 3 stages
    weight = torch.zeros(512, 64, dtype=torch.float8_e4m3fn)
    lora = LoraWeights((torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16),),
                       (torch.zeros(2, 1, 512, 16, dtype=torch.bfloat16),), (512,))
    batch = AdapterBatch.from_token_mapping(torch.zeros(prefill, dtype=torch.int32), 2)
    fp8, w8a16 = (fused._k2_config(INTERPRETER, mode, dtype, weight, torch.ones(1), lora,
                                   batch, None, pdl=False)
                  for mode, dtype in ((_launchers.FP8, torch.float8_e4m3fn),
                                      (_launchers.W8A16, torch.bfloat16)))
    assert (fp8.block_n, w8a16.block_n, w8a16.num_stages) == (256, 128, 3), (fp8, w8a16)
    # a slice boundary that 256 does not divide narrows the tile, never straddled
    assert heuristic_config("lora_gemm", prefill, 768, 4096, 64, (640, 128)).block_n == 128
    assert heuristic_config("lora_gemm", launch.PREFILL_MIN_TOKENS, 6144, 4096, 64).block_m == 64
    table = {"lora_gemm": {"64x32": {"256": {"block_m": 64, "block_n": 32}}}}
    gpu_table(table)
    # the 256-token bucket serves 256 tokens and is not stretched to 257
    assert launch.select_config("Test GPU", "lora_gemm", 256, 64, 32, 16).block_n == 32
    assert (launch.select_config("Test GPU", "lora_gemm", prefill, 64, 32, 16)
            == heuristic_config("lora_gemm", prefill, 64, 32, 16))
    table["lora_gemm"]["64x32"]["4096"] = {"block_m": 128, "block_n": 16}
    gpu_table(table)
    assert launch.select_config("Test GPU", "lora_gemm", prefill, 64, 32, 16).block_n == 16


def test_table_schema_is_checked():
    good = {"_meta": {"device": "NVIDIA H200"},
            "lora_gemm": {"6144x4096": {"16": {"block_m": 16, "block_n": 32}}}}
    validate_table(json.loads(json.dumps(good)))
    with pytest.raises(ValueError, match="unknown op"):
        validate_table({"gemm": {}})
    with pytest.raises(ValueError, match="shape key"):
        validate_table({"lora_gemm": {"6144": {}}})
    with pytest.raises(TypeError):
        validate_table({"lora_gemm": {"6144x4096": {"16": {"blockm": 16}}}})


def test_table_lookup_picks_the_smallest_bucket_at_or_above(gpu_table):
    from epilora_kernels import launch

    table = {"lora_gemm": {"64x32": {"16": {"block_m": 16}, "64": {"block_m": 64}}}}
    gpu_table(table)
    assert launch.table_config("Test GPU", "lora_gemm", 1, 64, 32).block_m == 16
    assert launch.table_config("Test GPU", "lora_gemm", 17, 64, 32).block_m == 64
    assert launch.table_config("Test GPU", "lora_gemm", 999, 64, 32).block_m == 64
    assert launch.table_config("Test GPU", "lora_gemm", 1, 512, 32) is None  # not near
    assert launch.table_config("Other GPU", "lora_gemm", 1, 64, 32) is None


def test_decode_k1_beyond_its_buckets_takes_a_covering_bucket_else_a_rule(gpu_table):
    from epilora_kernels import launch

    table = {"decode_shrink": {"64x32": {"16": {"split_k": 16}, "32": {"split_k": 8}},
                               "64x32@r128": {"256": {"split_k": 2}}},
             "quantize_shrink": {"64x32": {"256": {"split_k": 4}}}}
    gpu_table(table)
    max_t = launch.DECODE_SHRINK_MAX_TOKENS
    assert launch.select_config("Test GPU", "decode_shrink", max_t, 64, 32, 64).split_k == 8
    # rank 64: no decode bucket covers 33 tokens, so neither the 32-token entry stretched nor,
    # with one slot, the fused path's entry: the heuristic's rule for the decode path's K1
    assert (launch.select_config("Test GPU", "decode_shrink", max_t + 1, 64, 32, 64,
                                 one_slot=True)
            == launch.heuristic_config("decode_shrink", max_t + 1, 64, 32, 64))
    # (several slots: the fused path's entry)
    assert launch.select_config("Test GPU", "decode_shrink", max_t + 1, 64, 32, 64).split_k == 4
    assert launch.table_config("Test GPU", "decode_shrink", 999, 64, 32, cover=True) is None
    # rank 128: its 256-token bucket covers 33-256 tokens, and none covers more: beyond, the
    # fused path's, where the heuristic's prefill tiles replace the 256-token entry stretched
    assert launch.select_config("Test GPU", "decode_shrink", max_t + 1, 64, 32, 128).split_k == 2
    assert launch.select_config("Test GPU", "decode_shrink", 256, 64, 32, 128).split_k == 2
    assert (launch.select_config("Test GPU", "decode_shrink", 257, 64, 32, 128)
            == launch.heuristic_config("quantize_shrink", 257, 64, 32, 128))
    # no table: beyond DECODE_K1_RULE_MAX_RANK the heuristic's fused settings, with one slot
    # in 4 stages up to the decode path's DECODE_MAX_TOKENS_ONE_SLOT tokens
    fused = launch.heuristic_config("quantize_shrink", max_t + 1, 64, 32, 128)
    assert fused.num_stages == 2
    assert launch.select_config(None, "decode_shrink", max_t + 1, 64, 32, 128) == fused
    assert launch.select_config(None, "decode_shrink", max_t + 1, 64, 32, 128,
                                one_slot=None) == fused
    for tokens in (max_t + 1, launch.DECODE_MAX_TOKENS_ONE_SLOT):
        assert (launch.select_config(None, "decode_shrink", tokens, 64, 32, 128, one_slot=True)
                == dataclasses.replace(fused, num_stages=4))
    past = launch.DECODE_MAX_TOKENS_ONE_SLOT + 1
    assert (launch.select_config(None, "decode_shrink", past, 64, 32, 128, one_slot=True)
            == launch.heuristic_config("quantize_shrink", past, 64, 32, 128))


@pytest.mark.parametrize("rank", [16, 32, 64])
@pytest.mark.parametrize("tokens", [33, 48, 64])
def test_the_decode_paths_k1_past_the_decode_buckets_leaves_room_for_k2(rank, tokens):
    # One slot's 33-64 tokens without a bucket of their own: 16-row tiles, 256 deep, at most 64
    # programs of whole K steps (the fused path's settings, which this rule replaced, launch
    # 64-192 there on these shapes), every slice of every projection of the three models.
    from epilora_kernels import dispatch, launch

    for n, k, slices in ((6144, 4096, (4096, 1024, 1024)), (4096, 4096, (4096,)),
                         (24576, 4096, (12288, 12288)), (4096, 12288, (4096,)),
                         (4608, 3584, (3584, 512, 512)), (3584, 18944, (3584,))):
        cfg = launch.select_config(None, "decode_shrink", tokens, n, k, rank, slices, True)
        assert (cfg.block_m, cfg.block_k, cfg.block_r) == (16, 256, launch.rank_block(rank))
        programs = -(-tokens // 16) * len(slices) * cfg.split_k
        steps = math.ceil(math.ceil(k / cfg.split_k) / 256)  # 256-deep K steps a program
        assert programs <= 64 and 1 <= steps <= 5 and cfg.split_k <= 16, (n, k, cfg)
        # on the codes too; with several slots the fused path's settings, and beyond rank 64
        # those in 4 stages
        assert launch.select_config(None, "decode_shrink_codes", tokens, n, k, rank, slices,
                                    True) == cfg
        fused = launch.heuristic_config("quantize_shrink", tokens, n, k, 128, slices)
        assert (launch.select_config(None, "decode_shrink", tokens, n, k, rank, slices, False)
                == launch.heuristic_config("quantize_shrink", tokens, n, k, rank, slices))
        assert (launch.select_config(None, "decode_shrink", tokens, n, k, 128, slices, True)
                == dataclasses.replace(fused, num_stages=4))
    # up to the decode path's largest one-slot batch, and no further
    past = dispatch.DECODE_MAX_TOKENS_ONE_SLOT + 1
    assert (launch.select_config(None, "decode_shrink", past, 4096, 4096, rank, (4096,), True)
            == launch.heuristic_config("quantize_shrink", past, 4096, 4096, rank, (4096,)))


def test_decode_sizes_take_a_bucket_up_to_32_tokens_else_the_heuristic(gpu_table):
    # Up to DECODE_SHRINK_MAX_TOKENS a batch takes a bucket at or above it only up to there: not
    # a prefill-sized bucket's tiles (64-row K2 tiles for 17 tokens), not a smaller bucket's
    # stretched; the heuristic instead. Beyond, buckets cover as before.
    from epilora_kernels import launch

    table = {"lora_gemm": {"64x32": {"16": {"block_m": 16, "block_k": 512},
                                     "64": {"block_m": 64, "block_k": 64}}},
             "decode_shrink": {"64x32": {"8": {"split_k": 3}, "32": {"split_k": 5}}},
             "decode_shrink_codes": {"64x32": {"64": {"split_k": 7}}},
             "quantize_shrink": {"64x32": {"16": {"split_k": 2}, "64": {"split_k": 6}}},
             "shrink": {"64x32": {"64": {"split_k": 9}}}}
    gpu_table(table)
    max_t = launch.DECODE_SHRINK_MAX_TOKENS
    assert launch.select_config("Test GPU", "lora_gemm", 16, 64, 32, 16).block_k == 512
    for tokens in (17, max_t):
        assert (launch.select_config("Test GPU", "lora_gemm", tokens, 64, 32, 16)
                == launch.heuristic_config("lora_gemm", tokens, 64, 32, 16))
        assert launch.select_config("Test GPU", "decode_shrink", tokens, 64, 32, 16).split_k == 5
        # the codes' own entries only from a bucket up to 32, else decode_shrink's
        assert (launch.select_config("Test GPU", "decode_shrink_codes", tokens, 64, 32, 16)
                .split_k == 5)
        assert (launch.select_config("Test GPU", "quantize_shrink", tokens, 64, 32, 16)
                == launch.heuristic_config("quantize_shrink", tokens, 64, 32, 16))
        # the hybrid path's shrink keeps its 64-token entry there, as before
        assert launch.select_config("Test GPU", "shrink", tokens, 64, 32, 16).split_k == 9
    assert launch.select_config("Test GPU", "lora_gemm", max_t + 1, 64, 32, 16).block_k == 64
    assert launch.select_config("Test GPU", "quantize_shrink", max_t + 1, 64, 32, 16).split_k == 6
    assert (launch.select_config("Test GPU", "decode_shrink_codes", max_t + 1, 64, 32, 16)
            .split_k == 7)
    assert launch.select_config("Test GPU", "decode_shrink", 9, 64, 32, 16).split_k == 5


def test_the_shipped_tables_32_token_bucket_is_retired():
    # Its entries (a sweep from before swapped K2 tiles) lost to the heuristic in 13 of 15
    # 32-token cells of the three-models page at ba2f1be: at 17-32 tokens the shipped table
    # leaves the batch to the heuristic (or the tuner's cache, which none is here).
    from epilora_kernels import launch

    for op, n, k in (("lora_gemm", 6144, 4096), ("decode_shrink", 24576, 4096),
                     ("quantize_shrink", 4096, 12288)):
        assert launch.table_config("NVIDIA H200", op, 32, n, k, max_bucket=32, cover=True) is None
        assert launch.table_config("NVIDIA H200", op, 16, n, k, max_bucket=32,
                                   cover=True) is not None


def test_entries_tuned_at_a_rank_are_preferred_for_that_rank_tile(gpu_table):
    from epilora_kernels import launch

    table = {"shrink": {"64x32": {"1": {"block_r": 16}, "16": {"block_r": 32},
                                  "256": {"block_r": 32}},
                        "64x32@r128": {"16": {"block_r": 128}},
                        "64x32@r64": {"64": {"block_r": 64}}}}
    validate_table(table)
    gpu_table(table)
    assert launch.table_config("Test GPU", "shrink", 4, 64, 32, rank=128).block_r == 128
    assert launch.table_config("Test GPU", "shrink", 4, 64, 32, rank=65).block_r == 128
    assert launch.table_config("Test GPU", "shrink", 4, 64, 32, rank=64).block_r == 32
    assert launch.table_config("Test GPU", "shrink", 4, 64, 32).block_r == 32
    assert launch.select_config("Test GPU", "shrink", 4, 64, 32, 128).block_r == 128
    # Only at the buckets the rank tile was tuned at: the others' entries elsewhere.
    assert launch.table_config("Test GPU", "shrink", 1, 64, 32, rank=128).block_r == 16
    assert launch.table_config("Test GPU", "shrink", 999, 64, 32, rank=128).block_r == 32
    assert launch.table_config("Test GPU", "shrink", 1, 64, 32, rank=64).block_r == 16
    assert launch.table_config("Test GPU", "shrink", 17, 64, 32, rank=64).block_r == 64
    launch._load_table.cache_clear()
    with pytest.raises(ValueError, match="6144x4096@r128"):
        validate_table({"shrink": {"64x32@rx": {}}})


def test_one_slot_and_several_slot_entries_serve_only_their_batches(gpu_table):
    from epilora_kernels import _tiling, launch
    from epilora_kernels.arch import DeviceSupport

    table = {"lora_gemm": {"64x32": {"16": {"block_n": 16}, "32": {"block_n": 16},
                                     "64": {"block_n": 16}},
                           "64x32@r64": {"32": {"block_n": 32}},
                           f"64x32@r64{launch.ONE_SLOT}": {"16": {"block_n": 64},
                                                            "32": {"block_n": 128}},
                           f"64x32@r64{launch.SEVERAL_SLOTS}": {"64": {"block_n": 64}}}}
    validate_table(table)
    gpu_table(table)
    block_n = {(tokens, one_slot): launch.select_config("Test GPU", "lora_gemm", tokens, 64, 32,
                                                       64, one_slot=one_slot).block_n
               for tokens in (16, 32, 64) for one_slot in (False, True)}
    assert block_n == {(16, False): 16, (16, True): 64, (32, False): 32, (32, True): 128,
                       (64, False): 64, (64, True): 16}
    assert launch.shape_key(64, 32, 64, one_slot=False) == f"64x32@r64{launch.SEVERAL_SLOTS}"
    # another rank tile's batches never see them
    assert launch.select_config("Test GPU", "lora_gemm", 16, 64, 32, 16, one_slot=True).block_n \
        == 16
    # K2's launchers ask for them by the batch's entries (its slots and the no-adapter entry)
    gpu = DeviceSupport("Test GPU", (9, 0), fp8_mma=True, pdl=True, tma=True, interpreter=False)
    lora = LoraWeights((torch.zeros(4, 1, 64, 32, dtype=torch.bfloat16),),
                       (torch.zeros(4, 1, 64, 64, dtype=torch.bfloat16),), (64,))
    mapping = torch.zeros(16, dtype=torch.int32)
    assert _tiling.gemm_config(gpu, AdapterBatch.from_token_mapping(mapping, 1), lora,
                               None).block_n == 64
    assert _tiling.gemm_config(gpu, AdapterBatch.from_token_mapping(mapping, 4), lora,
                               None).block_n == 16
    launch._load_table.cache_clear()
    with pytest.raises(ValueError, match="under a rank key"):
        launch.shape_key(64, 32, one_slot=True)
    for bad in ("64x32@r64/two-slots", "64x32@r64/several-slots/one-slot"):
        with pytest.raises(ValueError, match="several-slots"):
            validate_table({"lora_gemm": {bad: {}}})
    # K2 without adapters asks for no slots' entries: plain and rank keys only
    assert launch.select_config("Test GPU", "lora_gemm", 64, 64, 32, 64, one_slot=None).block_n \
        == 16


def test_vllm_meta_args_round_trip():
    batch = AdapterBatch.from_token_mapping(torch.tensor([1, -1, 1], dtype=torch.int32), 2)
    args = batch.vllm_meta_args()
    back = AdapterBatch.from_vllm_meta_args(args)
    for field in ("token_lora_mapping", "sorted_token_indices", "lora_ids",
                  "num_tokens_per_lora", "lora_token_start"):
        assert torch.equal(getattr(back, field), getattr(batch, field)), field
    assert args[5].tolist() == [False] and args[6].tolist() == [3]
    none = AdapterBatch.from_token_mapping(torch.tensor([-1, -1], dtype=torch.int32), 2)
    assert none.vllm_meta_args()[5].tolist() == [True]


def test_the_shipped_h200_table_is_valid_and_covers_the_benchmark_shapes():
    from epilora_kernels.launch import _load_table, table_config

    table = _load_table("NVIDIA H200")
    assert table is not None and "lora_gemm" in table
    slices = {6144: (4096, 1024, 1024), 4096: (4096,), 24576: (12288, 12288)}
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        for tokens in (1, 7, 64, 300):  # (no 32-token bucket: the heuristic serves 17-32)
            cfg = table_config("NVIDIA H200", "lora_gemm", tokens, n, k)
            # a K2 tile never straddles two of the projection's slices
            assert cfg is not None and all(w % cfg.block_n == 0 for w in slices[n][:-1]), cfg
            for op in ("quantize_shrink", "shrink", "decode_shrink"):
                assert table_config("NVIDIA H200", op, tokens, n, k) is not None
    assert table_config("NVIDIA H200", "shrink", 1, 512, 512) is None  # nothing near: heuristic


def test_shrink_heuristics_split_small_batches():
    from epilora_kernels.launch import heuristic_config

    # Up to 32 tokens K split into at most 16 parts, each at least 256 deep, for the fused and
    # hybrid paths' K1; the decode path's K1, which K2 hides, into parts about 1024 deep with
    # rank tiles of at most 64.
    for op in ("shrink", "quantize_shrink"):
        assert heuristic_config(op, 16, 4096, 4096, 64).split_k == 16
        assert heuristic_config(op, 1, 4096, 12288, 64).split_k == 16
        assert heuristic_config(op, 32, 4096, 2048, 64).split_k == 8
        assert heuristic_config(op, 1, 64, 128, 16).split_k == 1
    # The decode path's K1: two K steps a program (256 deep up to 16 tokens, 128 at 32), K
    # in at most 16 parts of whole steps (18944 / 16 rounded up to 1280: 15 parts)
    assert [heuristic_config("decode_shrink", 8, 4096, k, 128).split_k
            for k in (4096, 12288, 18944, 3584, 512, 256)] == [8, 16, 15, 7, 1, 1]
    assert [heuristic_config("decode_shrink", 32, 4096, k, 128).split_k
            for k in (4096, 3584, 512)] == [16, 14, 2]
    assert heuristic_config("decode_shrink", 8, 4096, 4096, 128).block_r == 64
    assert heuristic_config("decode_shrink", 8, 4096, 4096, 16).block_r == 16
    for op in ("shrink", "quantize_shrink"):
        # Beyond 32 tokens: 16-row tiles, K in at most 8 parts each at least 512 deep (the
        # decode path's K1 up to rank 64 has a rule of its own at 33-64 tokens, tested apart).
        assert [heuristic_config(op, t, 4096, k, 64).split_k
                for t, k in ((64, 4096), (256, 12288), (2048, 2048), (64, 256))] == [8, 8, 4, 1]
        assert heuristic_config(op, 256, 4096, 4096, 64).block_m == 16
    for op in ("shrink", "quantize_shrink", "decode_shrink"):
        # K1 takes rank 128 in 32-wide tiles there; K2's epilogue needs it whole.
        assert heuristic_config(op, 64, 4096, 4096, 128).block_r == 32
        assert heuristic_config(op, 64, 4096, 4096, 16).block_r == 16
    assert heuristic_config("lora_gemm", 64, 4096, 4096, 128).block_r == 128


def test_select_config_is_the_table_with_k2_rank_else_the_heuristic():
    from epilora_kernels.launch import heuristic_config, select_config, table_config

    tuned = table_config("NVIDIA H200", "lora_gemm", 1, 24576, 4096)
    assert select_config("NVIDIA H200", "lora_gemm", 1, 24576, 4096, 128).block_r == 128
    assert select_config("NVIDIA H200", "lora_gemm", 1, 24576, 4096, 128).block_n == tuned.block_n
    assert select_config(None, "shrink", 64, 4096, 4096, 128) == heuristic_config(
        "shrink", 64, 4096, 4096, 128)


@given(st.lists(st.integers(-1, 7), min_size=1, max_size=300), st.sampled_from([16, 32, 64]))
def test_k1_launches_a_program_for_every_row_tile_of_every_entry(mapping, block_m):
    # K1 lays the entries' row tiles end to end and launches a bound on their number (tight
    # where it matters, never short: a missing program would leave rows of h unwritten).
    from epilora_kernels import _tiling

    batch = AdapterBatch.from_token_mapping(torch.tensor(mapping, dtype=torch.int32), 8)
    a = torch.zeros(8, 1, 64, 16, dtype=torch.bfloat16)
    b = torch.zeros(8, 1, 32, 64, dtype=torch.bfloat16)
    lora = LoraWeights((a, a), (b, b), (32, 32))
    cfg = LaunchConfig(block_m=block_m, block_r=32, split_k=3)
    counts = batch.num_tokens_per_lora.tolist()
    row_tiles = sum(-(-c // block_m) for c in counts)
    per_row_tile = 2 * 2 * 3  # rank tiles x slices x splits
    launched = _tiling.shrink_programs(len(mapping), lora, batch, cfg)
    assert row_tiles * per_row_tile <= launched
    assert launched <= min(9 * -(-len(mapping) // block_m), row_tiles + 8) * per_row_tile


def test_write_table_checks_before_it_writes(tmp_path):
    from epilora_kernels.launch import write_table

    good = {"lora_gemm": {"64x32": {"4": {"split_k": 2}}}}
    write_table(good, tmp_path / "good.json")
    assert json.loads((tmp_path / "good.json").read_text()) == good
    with pytest.raises(ValueError, match="unknown op"):
        write_table({"gemm": {}}, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3",
                                  "NVIDIA H100 PCIe", "NVIDIA GH200 480GB"])
def test_every_sm90_part_finds_the_sm90_table(name):
    from epilora_kernels.launch import table_device

    assert table_device(name, "sm90") == "NVIDIA H200"
    assert table_device(name, "sm89") == ("NVIDIA H200" if name == "NVIDIA H200" else None)
    assert table_device("NVIDIA L40S", "sm89") is None  # no table: the heuristic


def test_an_untuned_shape_takes_its_nearest_tuned_shapes_entries():
    from epilora_kernels.launch import _load_table, nearest_shape, select_config, table_config

    shapes = _load_table("NVIDIA H200")["lora_gemm"]
    assert nearest_shape(shapes, 24576, 4096) == (24576, 4096)  # tuned: itself
    assert nearest_shape(shapes, 28672, 4096) == (24576, 4096)  # Llama-3.1-8B gate_up
    assert nearest_shape(shapes, 4096, 14336) == (4096, 12288)  # Llama-3.1-8B down
    assert nearest_shape(shapes, 4608, 3584) == (4096, 4096)  # Qwen2.5-7B qkv
    assert nearest_shape(shapes, 37888, 3584) == (24576, 4096)  # Qwen2.5-7B gate_up
    assert nearest_shape(shapes, 1024, 4096) is None  # beyond a factor of two in N
    assert table_config("NVIDIA H200", "lora_gemm", 4, 28672, 4096) == table_config(
        "NVIDIA H200", "lora_gemm", 4, 24576, 4096)
    # K2's tile still fits the slices of the shape it serves (Qwen2.5-7B's qkv: 3584, 512, 512)
    for tokens in (1, 16, 64, 256):
        cfg = select_config("NVIDIA H200", "lora_gemm", tokens, 4608, 3584, 64, (3584, 512, 512))
        assert 3584 % cfg.block_n == 0 and 512 % cfg.block_n == 0 and cfg.block_r == 64


def test_heuristic_decode_gemm_rules():
    from epilora_kernels.launch import heuristic_config

    # gate_up-wide N: 64-wide tiles in 3 stages; else 32-wide in 5; down (K >= 2N): split 2
    wide = heuristic_config("lora_gemm", 8, 28672, 4096, 64, (14336, 14336))
    assert (wide.block_n, wide.num_stages, wide.split_k, wide.block_k) == (64, 3, 1, 256)
    down = heuristic_config("lora_gemm", 8, 4096, 14336, 64, (4096,))
    assert (down.block_n, down.num_stages, down.split_k) == (32, 5, 2)
    qkv = heuristic_config("lora_gemm", 1, 4608, 3584, 16, (3584, 512, 512))
    assert (qkv.block_n, qkv.split_k, qkv.block_r) == (32, 1, 16)


def test_heuristic_swaps_32_row_decode_tiles_on_sm90():
    # 17-32 tokens: the swapped tile (64 weight rows, 256 deep, K whole, the one-wave pipeline)
    # where 64-wide tiles fit the slices and the blocks may take sm_90's shared memory
    from epilora_kernels.launch import heuristic_config, swap_candidate

    for tokens in (17, 32):
        for n, k, slices in ((6144, 4096, (4096, 1024, 1024)), (4096, 14336, (4096,)),
                             (37888, 3584, (18944, 18944))):
            k2 = heuristic_config("lora_gemm", tokens, n, k, 64, slices)
            assert (k2.block_m, k2.block_n, k2.block_k, k2.split_k, k2.swap_ab) == (
                32, 64, 256, 1, True), (tokens, n, k2)
            unswapped = heuristic_config("lora_gemm", tokens, n, k, 64, slices,
                                         large_tiles=False)
            assert not unswapped.swap_ab and swap_candidate(unswapped, n, k, slices,
                                                            tokens) == k2
    # one grid of 96 programs holds 8 stages; 16 tokens and slices 64-wide tiles straddle: not
    assert heuristic_config("lora_gemm", 32, 6144, 4096, 64, (4096, 1024, 1024)).num_stages == 8
    assert not heuristic_config("lora_gemm", 16, 6144, 4096, 64, (4096, 1024, 1024)).swap_ab
    assert not heuristic_config("lora_gemm", 32, 144, 4096, 16, (96, 48)).swap_ab


def test_heuristic_mid_gemm_fills_the_sms_in_one_wave_of_deep_pipelines():
    # 33-256 tokens: 64-row tiles whose grid gives every SM a program (32-wide N tiles where
    # 64-wide do not, K split in two where K >= 2N and the grid is still short), 256 deep in
    # the deepest pipeline of 3-4 stages the whole grid holds at once, else 128 deep in 4;
    # from 129 tokens 128 x 128 tiles in 8 warps where they fill the SMs.
    from epilora_kernels.launch import H200_SMS, SHARED_BYTES, heuristic_config

    shapes = [(6144, 4096, (4096, 1024, 1024)), (4096, 4096, (4096,)),
              (28672, 4096, (14336, 14336)), (4096, 14336, (4096,)),
              (4608, 3584, (3584, 512, 512)), (3584, 18944, (3584,)), (2048, 2048, (2048,))]
    for tokens in (33, 64, 100, 128, 129, 200, 256):
        for n, k, slices in shapes:
            cfg = heuristic_config("lora_gemm", tokens, n, k, 64, slices)
            programs = -(-tokens // cfg.block_m) * -(-n // cfg.block_n) * cfg.split_k
            if cfg.block_m == 128:
                assert tokens >= 129 and cfg.num_warps == 8 and programs >= H200_SMS, cfg
                continue
            assert cfg.block_m == 64 and cfg.num_warps == 4 and not cfg.swap_ab, cfg
            narrower = -(-tokens // 64) * (n // 64) < H200_SMS
            assert cfg.block_n == (32 if narrower else 64), (tokens, n, cfg)
            unsplit = programs // cfg.split_k
            assert cfg.split_k == (2 if k >= 2 * n and unsplit < H200_SMS else 1), cfg
            per_sm = -(-programs // H200_SMS)
            stage = (64 + cfg.block_n) * cfg.block_k
            if cfg.block_k == 256:
                assert 3 <= cfg.num_stages <= 4
                assert per_sm * cfg.num_stages * stage <= SHARED_BYTES, cfg
                assert cfg.num_stages == 4 or per_sm * 4 * stage > SHARED_BYTES, cfg
            else:  # no 3-stage 256-deep pipeline holds the whole grid at once
                assert (cfg.block_k, cfg.num_stages) == (128, 4)
                assert per_sm * 3 * (64 + cfg.block_n) * 256 > SHARED_BYTES, cfg
    # e.g. Llama-3.1-8B's down at 64 tokens: 128 programs of 32-wide tiles, split in two
    down = heuristic_config("lora_gemm", 64, 4096, 14336, 64, (4096,))
    assert (down.block_n, down.block_k, down.split_k, down.num_stages) == (32, 256, 2, 4)
    gate_up = heuristic_config("lora_gemm", 256, 28672, 4096, 64, (14336, 14336))
    assert (gate_up.block_m, gate_up.block_n, gate_up.num_warps) == (128, 128, 8)
    # without sm_90's shared memory: 128-deep tiles in 4 stages, 64 rows
    small = heuristic_config("lora_gemm", 256, 28672, 4096, 64, (14336, 14336),
                             large_tiles=False)
    assert (small.block_m, small.block_k, small.num_stages) == (64, 128, 4)
    # beyond 256 tokens without it: 64 x 64 x 128 in 4 stages, as before the mid rule
    for n, k, slices in shapes:
        cfg = heuristic_config("lora_gemm", 512, n, k, 64, slices, large_tiles=False)
        assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_stages) == (
            64, 64, 128, 1, 4), cfg


def test_decode_only_entries_do_not_give_prefill_batches_decode_tiles():
    # A shape the tuner cached at the decode buckets only: batches above them take a near
    # shape's prefill entry, not its 32-token tiles; its own entries still serve decode.
    from epilora_kernels.launch import table_entry

    table = {"lora_gemm": {
        "28672x4096@r64/one-slot": {"1": {"block_n": 32}, "32": {"block_m": 32, "block_n": 32}},
        "24576x4096": {"16": {"block_n": 16}, "256": {"block_m": 128, "block_n": 128}}}}
    entry = functools.partial(table_entry, table, "lora_gemm", n=28672, k=4096, rank=64,
                              one_slot=True)
    assert entry(tokens=8).block_m == 32 and entry(tokens=1).block_n == 32  # its own
    assert entry(tokens=200).block_m == 128  # the near shape's bucket covers it
    assert entry(tokens=4096).block_m == 128  # no bucket covers it: the largest of any
    assert entry(tokens=4096, cover=True) is None
    # a several-slot batch never saw the one-slot entries
    assert table_entry(table, "lora_gemm", 8, 28672, 4096, 64).block_n == 16


def test_a_swapped_entry_serves_slices_its_tiles_do_not_fit_unswapped(gpu_table):
    # A tuned swapped tile (64 weight rows) given to a shape whose slices take 32-wide tiles
    # only: narrowed, it is no longer a wgmma tile, so it is served unswapped, not refused.
    from epilora_kernels import launch

    swapped = {"block_m": 16, "block_n": 64, "block_k": 128, "num_stages": 8, "swap_ab": True}
    table = {"lora_gemm": {"128x64": {"16": swapped}}}
    gpu_table(table)
    fits = launch.select_config("Test GPU", "lora_gemm", 4, 128, 64, 16, (64, 64))
    assert (fits.block_n, fits.swap_ab, fits.num_stages) == (64, True, 8)
    narrow = launch.select_config("Test GPU", "lora_gemm", 4, 128, 64, 16, (96, 32))
    assert (narrow.block_n, narrow.swap_ab, narrow.num_stages) == (32, False, 8)


def test_w8a16_fits_fp8_sized_pipelines_to_its_bf16_activations():
    # W8A16 reads the FP8 GEMM's tuned tiles, which its bf16 activations make larger: the
    # tuner's deepest swapped tile (8 stages of 32 x 64 x 256, the weight by TMA) keeps 7; the
    # shipped table's entries, which fit, are kept as they are (the same tiles: the same bits).
    from epilora_kernels import fused

    deep = LaunchConfig(block_m=32, block_n=64, block_k=256, block_r=64, num_stages=8,
                        swap_ab=True)
    assert fused._w8a16_tiles(deep, w_by_tma=True).num_stages == 7
    assert fused._w8a16_tiles(deep, w_by_tma=False).num_stages == 8  # 7 buffers of each fit
    from epilora_kernels.launch import _load_table

    for entries in _load_table("NVIDIA H200")["lora_gemm"].values():
        for fields in entries.values():
            cfg = LaunchConfig(**fields)
            assert fused._w8a16_tiles(cfg, w_by_tma=cfg.block_m >= 64) == cfg, cfg
