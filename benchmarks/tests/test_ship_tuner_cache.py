"""tools/ship_tuner_cache.py: a tuner cache's entries into a launch table, as the tuner wrote
them, the table's other entries kept, the runs stamped; a bad cache or another device's table
refused."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).parents[2] / "tools/ship_tuner_cache.py"
SHIP = runpy.run_path(str(TOOL))
SWAPPED = {"block_m": 16, "block_n": 64, "block_k": 128, "block_r": 64, "num_stages": 6,
           "swap_ab": True}
PLAIN = {"block_m": 16, "block_n": 64, "block_k": 128, "block_r": 64}
RUN = {"device": "NVIDIA H200", "tool": "epilora_kernels.tuner", "rank": 64, "slots": 1,
       "codes": True}


def _cache():
    return {"_meta": {"runs": [RUN]},
            "lora_gemm": {"4096x4096@r64/one-slot": {"1": SWAPPED, "32": SWAPPED}},
            "decode_shrink_codes": {"4096x4096@r64/one-slot": {"1": PLAIN}}}


def _table():
    return {"_meta": {"device": "NVIDIA H200", "runs": [{"git_sha": "abc"}]},
            "lora_gemm": {"4096x4096@r64/one-slot": {"1": PLAIN, "4": PLAIN},
                          "6144x4096": {"8": PLAIN}}}


def test_the_caches_shapes_replace_the_tables_whole_and_the_rest_stays():
    # An engine overlays the cache shape by shape: the table's 4-token entry of a tuned shape
    # was not what it ran (its 4 tokens took the cache's 32-token bucket), so it goes.
    merged, changes = SHIP["ship"](_cache(), _table(), "f00d")
    assert merged["lora_gemm"]["4096x4096@r64/one-slot"] == {"1": SWAPPED, "32": SWAPPED}
    assert merged["lora_gemm"]["6144x4096"] == {"8": PLAIN}
    assert merged["decode_shrink_codes"] == {"4096x4096@r64/one-slot": {"1": PLAIN}}
    assert merged["_meta"]["runs"] == [{"git_sha": "abc"}, {
        **RUN, "git_sha": "f00d", "shipped_by": "tools/ship_tuner_cache.py"}]
    assert len(changes) == 4 and all(" -> " in c for c in changes)
    assert "lora_gemm 4096x4096@r64/one-slot 4: " in "\n".join(changes)
    assert _table()["lora_gemm"]["4096x4096@r64/one-slot"]["1"] == PLAIN  # input untouched
    assert SHIP["ship"](_cache(), merged, "f00d")[1] == []  # shipped twice: nothing changes


def test_a_path_choice_goes_with_the_gemm_settings_it_was_timed_with():
    # The table's choice between the decode and fused paths for 8 slots was timed beside its
    # GEMM settings; a cache that replaces those settings without timing a choice drops it,
    # and one that brings its own choice replaces it.
    choice = {"16": {"path": "fused", "slots": 8}}
    qkv, o = "6144x4096@r64/several-slots", "4096x4096@r64/several-slots"  # the tuner's keys
    table = {**_table(), "path": {qkv: choice, o: choice}}
    cache = {**_cache(), "lora_gemm": {qkv: {"16": PLAIN}}}
    merged, changes = SHIP["ship"](cache, table, "f00d")
    assert merged["path"] == {o: choice}
    assert f"path {qkv} 16: {{'path': 'fused', 'slots': 8}} -> None" in changes
    own = {"16": {"path": "decode", "slots": 8}}
    merged, _ = SHIP["ship"]({**cache, "path": {qkv: own}}, table, "f00d")
    assert merged["path"] == {qkv: own, o: choice}


def test_a_cache_with_a_bad_entry_is_refused():
    cache = _cache()
    cache["lora_gemm"]["4096x4096@r64/one-slot"]["1"] = {**PLAIN, "block_q": 3}
    with pytest.raises(TypeError):
        SHIP["ship"](cache, _table(), "f00d")
    with pytest.raises(ValueError, match="unknown op"):
        SHIP["ship"]({"k9": {}}, _table(), "f00d")


def test_the_tool_writes_its_devices_table_and_refuses_another(tmp_path):
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps(_cache()))
    table = tmp_path / "NVIDIA_H200.json"
    table.write_text(json.dumps(_table()))
    run = [sys.executable, str(TOOL), str(cache), "--git-sha", "f00d", "--table"]
    done = subprocess.run([*run, str(table)], capture_output=True, text=True, check=True)
    assert "4 entries added or changed" in done.stdout
    assert json.loads(table.read_text())["lora_gemm"]["4096x4096@r64/one-slot"]["1"] == SWAPPED
    other = tmp_path / "NVIDIA_H100_80GB_HBM3.json"
    other.write_text(json.dumps(_table()))
    refused = subprocess.run([*run, str(other)], capture_output=True, text=True)
    assert refused.returncode != 0 and "tuned on NVIDIA H200" in refused.stderr
    assert json.loads(other.read_text()) == _table()
    missing = subprocess.run([*run, str(tmp_path / "none" / "NVIDIA_H200.json")],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "no such table" in missing.stderr
