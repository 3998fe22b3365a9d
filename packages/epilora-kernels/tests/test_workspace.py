"""The caller-owned workspace (interpreter): sized once, frozen before capture, never left with a
counter set by a failed launch, and large enough by construction for every launch setting."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import epilora_kernels as ek
from epilora_kernels import _launchers, _tiling, fused
from epilora_kernels.workspace import READY, TILES

from kernel_cases import make_problem


def test_grows_until_frozen_then_refuses_with_the_size_it_needs():
    ws = ek.Workspace("cpu", tiles=8)
    first = ws.counters(8)
    assert ws.counters(4) is first
    grown = ws.counters(10_000)
    assert grown is not first and ws.tiles >= 10_000 and ws.is_clean()
    assert ws._kept == []  # never captured: the old buffer is not kept
    ws.freeze()
    assert ws.counters(ws.tiles) is grown
    with pytest.raises(ek.WorkspaceTooSmall, match=r"needs 40000 .*frozen.*tiles=40000"):
        ws.counters(40_000)
    with pytest.raises(ValueError, match="tiles must be >= 0"):
        ek.Workspace("cpu", tiles=-1)


def test_tile_counters_view_each_buffer_past_ready_and_passed_made_once():
    ws = ek.Workspace("cpu", tiles=8)
    first = ws.counters(8)
    tiles = ws.tile_counters(first)
    assert tiles.data_ptr() == first[TILES:].data_ptr() and tiles.numel() == ws.tiles
    assert ws.tile_counters(first) is tiles
    grown = ws.counters(10_000)
    again = ws.tile_counters(grown)
    assert again is not tiles and again.data_ptr() == grown[TILES:].data_ptr()
    assert again.numel() == ws.tiles


BLOCKS = st.sampled_from([16, 32, 64, 128])


@given(tokens=st.integers(1, 600), n=st.integers(1, 30000), rank=st.integers(1, 128),
       slots=st.integers(1, 32), slices=st.integers(1, 3), block_m=BLOCKS, block_n=BLOCKS,
       block_r=BLOCKS, split_k=st.integers(1, 16))
def test_for_batches_covers_every_launch_setting(tokens, n, rank, slots, slices, block_m,
                                                 block_n, block_r, split_k):
    ws = ek.Workspace.for_batches("cpu", max_tokens=600, max_out_features=30000, max_rank=128,
                                  max_loras=32)
    lora = ek.LoraWeights(*((torch.empty(slots, 1, rank, 16, dtype=torch.bfloat16),) * slices,
                            (torch.empty(slots, 1, 16, rank, dtype=torch.bfloat16),) * slices),
                          (16,) * slices)
    batch = ek.AdapterBatch.from_token_mapping(
        torch.arange(tokens, dtype=torch.int32) % slots, slots)
    cfg = ek.LaunchConfig(block_m=block_m, block_n=block_n, block_r=block_r, split_k=split_k)
    need = max(_tiling.k1_tiles(tokens, lora, batch, cfg),
               _tiling.k2_tiles(0, tokens, n, cfg))
    assert need <= ws.tiles


def test_a_k2_that_fails_after_k1_leaves_no_count_behind(monkeypatch):
    # K1 of the decode path counts its quantized rows for K2; a K2 that never launches must not
    # leave that count for the next K2 on the workspace (it would pass its wait at once).
    x, weight, w_scale, lora, batch = make_problem(0, 5, 64, (32,), 8, 2, "mixed_with_base")
    ws = ek.Workspace("cpu")
    seen = []

    def failing_k2(support, workspace, *args, **kwargs):
        seen.append(int(workspace.counters(0)[READY]))
        raise RuntimeError("compile failed")

    monkeypatch.setattr(_launchers, "launch_k2", failing_k2)
    with pytest.raises(RuntimeError, match="compile failed"):
        fused._linear(0, x, weight, w_scale, lora, batch, None, None, decode=True, pdl=True,
                      workspace=ws)
    assert seen == [5]  # K1 had counted every row (the interpreter runs it to completion)
    assert ws.is_clean()
    monkeypatch.undo()
    want = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=False)
    again = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, workspace=ws)
    assert torch.equal(again.view(torch.int16), want.view(torch.int16)) and ws.is_clean()


def test_bad_k2_settings_are_refused_before_k1_launches(monkeypatch):
    x, weight, w_scale, lora, batch = make_problem(1, 5, 64, (32, 32), 64, 2, "one_adapter")
    launched = []
    monkeypatch.setattr(_launchers, "launch_k1", lambda *a, **kw: launched.append(1))
    for k2, message in ((ek.LaunchConfig(block_n=32, block_r=32), "must cover the adapters'"),
                        (ek.LaunchConfig(block_n=64, block_r=64), "must divide the slice")):
        with pytest.raises(ValueError, match=message):
            ek.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=k2)
    assert launched == []


def test_the_callers_workspace_serves_both_kernels(monkeypatch):
    x, weight, w_scale, lora, batch = make_problem(2, 17, 40, (96,), 8, 1, "one_adapter")
    ws = ek.Workspace("cpu", tiles=0)
    used = []
    counters = ek.Workspace.counters
    monkeypatch.setattr(ek.Workspace, "counters",
                        lambda self, tiles: used.append(self) or counters(self, tiles))
    k1 = ek.LaunchConfig(block_m=16, block_k=32, block_r=16, split_k=2)
    k2 = ek.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=2)
    ek.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1, k2_config=k2,
                              workspace=ws)
    assert used and all(w is ws for w in used) and ws.is_clean()
    assert int(ws.counters(0)[TILES:].count_nonzero()) == 0
    with pytest.raises(ValueError, match="workspace is on meta"):
        ek.lora_linear(x, weight, w_scale, lora, batch, workspace=ek.Workspace("meta"))


def test_set_default_workspace_hands_an_engines_workspace_to_calls_without_one():
    from epilora_kernels import workspace as module

    ws = ek.Workspace("cpu")
    saved = dict(module._defaults)
    try:
        first = ek.default_workspace(torch.device("cpu"))
        ek.set_default_workspace(ws)
        assert ek.default_workspace(torch.device("cpu")) is ws
        assert module._replaced[-1] is first  # kept alive: a graph may have captured it
    finally:
        module._defaults.clear()
        module._defaults.update(saved)
