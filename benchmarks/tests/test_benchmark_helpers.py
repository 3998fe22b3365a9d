"""The benchmark scripts' helpers that run without a GPU (benchmarks/, run on the GPU machine):
the decode K1 candidates the tuners offer, where the pipeline depths asked for
(`tune_layer.py --k1-stages`) multiply the same tiles and the default offers what every earlier
sweep did; and the parallel compile before a timed run (`--jobs`)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
import layer  # noqa: E402 (the benchmarks' folder on the path first)
import tune  # noqa: E402


def _tiles(configs):
    return [{k: v for k, v in c.__dict__.items() if k != "num_stages"} for c in configs]


@pytest.mark.parametrize(("rank", "k"), [(16, 4096), (64, 12288), (128, 4096), (128, 12288)])
def test_k1_stages_repeat_the_default_tiles_at_each_depth(rank, k):
    default = tune.k1_candidates(8, rank, k)
    assert {c.num_stages for c in default} == {2}
    deeper = tune.k1_candidates(8, rank, k, depths=(3, 4))
    assert sorted(map(str, _tiles(deeper))) == sorted(map(str, _tiles(default) * 2))
    assert sorted(c.num_stages for c in deeper) == [3] * len(default) + [4] * len(default)


def test_k1_stages_leave_prefill_candidates_alone():
    assert tune.k1_candidates(64, 128, 4096, depths=(3,)) == tune.k1_candidates(64, 128, 4096)


def test_compile_in_parallel_runs_every_case_and_reports_failures(tmp_path, capsys):
    # layer.compile_in_parallel (layer.py and decode.py --jobs): every case's arguments reach
    # one `--compile-only` process; a failing one is reported, not raised (the timed run then
    # compiles for itself).
    seen = tmp_path / "seen.txt"
    script = tmp_path / "fake_benchmark.py"
    script.write_text(
        "import sys\n"
        f"open({str(seen)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "sys.exit(3 if '4' in sys.argv else 0)\n")
    cases = [["--ranks", "16", "--tokens", str(tokens)] for tokens in (1, 4, 8)]
    layer.compile_in_parallel(str(script), cases, jobs=2)
    assert sorted(seen.read_text().splitlines()) == sorted(
        "--compile-only " + " ".join(case) for case in cases)
    out = capsys.readouterr().out
    assert "--tokens 4: failed (exit 3)" in out
    assert out.count(": compiled") == 2


def test_tune_decode_takes_the_layer_benchmarks_setups_and_refuses_bad_ones(capsys):
    # tune_decode.py --setups SLOTSxRANK: the (slots, rank) pairs as given, in order; a
    # malformed or non-positive one is a usage error naming it.
    import argparse

    import tune_decode

    parser = argparse.ArgumentParser()
    assert [tune_decode.parse_setup(s, parser) for s in ("1x64", "8x16", "32x64")] == [
        (1, 64), (8, 16), (32, 64)]
    for bad in ("8-16", "x16", "8x", "0x16", "8x0", "8x16x2"):
        with pytest.raises(SystemExit):
            tune_decode.parse_setup(bad, parser)
        assert repr(bad) in capsys.readouterr().err


def test_tune_decode_rows_carry_the_settings_the_tuner_chose(monkeypatch):
    # The "tuner-after" row of each cell names the K1 and K2 settings and the path the tuner
    # chose (a heuristic is read from them without the cache); "tuner-before" carries none, and
    # a cell whose settings in use failed gives no rows.
    import argparse

    import tune_decode

    k1, k2 = {"block_m": 16, "split_k": 8}, {"block_m": 32, "swap_ab": True}
    cells = [{"projection": "o", "tokens": 4, "before_us": 20.0, "after_us": 18.5,
              "k1": k1, "k2": k2, "path": None, "fused_us": None},
             {"projection": "o", "tokens": 8, "before_us": None, "after_us": 19.0,
              "k1": k1, "k2": k2, "path": "fused", "fused_us": 18.0}]
    report = {"cells": cells, "compile_s": 1.0, "seconds": {"o": 2.0}, "complete": True,
              "compile_errors": []}
    monkeypatch.setattr(tune_decode.tuner, "tune_decode", lambda *a, **kw: report)
    args = argparse.Namespace(budget=60.0, jobs=0, codes=False, tokens=[4, 8])
    rows = tune_decode.tune("qwen3-8b", 64, 1, args)
    cell_rows = [r for r in rows if r["metric"] == "decode_us"]
    assert [(r["system"], r["tokens"]) for r in cell_rows] == [("tuner-before", 4),
                                                               ("tuner-after", 4)]
    before, after = cell_rows
    assert (after["k1"], after["k2"], after["path"], after["value"]) == (k1, k2, None, 18.5)
    assert "k2" not in before


def test_the_layer_pages_tuner_section_names_the_buckets_its_file_timed():
    # tools/render_layer_models_docs.py says which buckets the tuner's run timed, from its rows
    # (the default buckets differ with one slot and several since 2026-12-07).
    import runpy

    tools = Path(__file__).parents[2] / "tools"
    sys.path.insert(0, str(tools))  # its layer_plots, as when run from tools/
    try:
        render = runpy.run_path(str(tools / "render_layer_models_docs.py"))
    finally:
        sys.path.remove(str(tools))

    def rows(*cells):
        return {"rows": [{"metric": "decode_us", "adapters": a, "tokens": t} for a, t in cells]
                + [{"metric": "tune_s", "adapters": 1}]}

    assert render["_buckets"](rows((1, 1), (1, 32), (8, 1), (8, 32))) == "1-32"
    assert render["_buckets"](rows((1, 1), (1, 64), (8, 1), (8, 32))) == "1-32, one slot 1-64"
    assert render["_buckets"](rows((1, 1), (1, 64))) == "1-64"


def test_each_layer_cell_is_over_the_cutlass_of_its_own_case():
    # benchmarks/layer.py times cutlass in every case and marks its rows' setup: a cell takes
    # its own case's baseline, not the last or first case's; a file from before (cutlass in the
    # first setup's cases only, no setup marked) gives every setup that one.
    tools = Path(__file__).parents[2] / "tools"
    sys.path.insert(0, str(tools))
    try:
        import layer_rows
    finally:
        sys.path.remove(str(tools))

    def row(system, setup, value, adapters=1, rank=64):
        return {"system": system, "model": "m", "tokens": 4, "adapters": adapters,
                "rank": rank, "value": value, **({"setup": setup} if setup else {})}

    rows = [row("cutlass", "1x64", 100.0, adapters=0), row("epilora", "1x64", 104.0),
            row("cutlass", "8x16", 90.0, adapters=0, rank=16),
            row("epilora", "8x16", 99.0, adapters=8, rank=16)]
    cutlass = layer_rows.cutlass_baselines(rows)
    assert [cutlass(r) for r in rows if r["system"] == "epilora"] == [100.0, 90.0]
    assert "its own case" in layer_rows.baseline_said(rows)
    older = [row("cutlass", None, 100.0, adapters=0), row("epilora", None, 104.0),
             row("epilora", None, 99.0, adapters=8, rank=16)]
    cutlass = layer_rows.cutlass_baselines(older)
    assert [cutlass(r) for r in older if r["system"] == "epilora"] == [100.0, 100.0]
    assert "earlier case" in layer_rows.baseline_said(older)
