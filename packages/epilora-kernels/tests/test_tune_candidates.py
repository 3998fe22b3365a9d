"""The decode K1 candidates the tuners offer (benchmarks/tune.py, run on the GPU machine): the
pipeline depths asked for (`tune_layer.py --k1-stages`) multiply the same tiles, and the default
offers what every earlier sweep did."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))
tune = pytest.importorskip("tune")


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
