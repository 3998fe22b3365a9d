"""benchmarks/equivalence.py's rows from engines' tokens (no engine)."""

import runpy
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1]
sys.path.insert(0, str(BENCHMARKS))  # the script imports the serving benchmark's helpers
EQUIVALENCE = runpy.run_path(str(BENCHMARKS / "equivalence.py"))


def test_first_difference_finds_the_position_and_counts_a_shorter_answer():
    first = EQUIVALENCE["first_difference"]
    assert first([1, 2, 3], [1, 2, 3]) is None
    assert first([1, 2, 3], [1, 5, 3]) == 1
    assert first([1, 2], [1, 2, 3]) == 2  # one stopped early (EOS)


def test_pair_rows_count_identical_requests_for_every_pair_that_finished():
    tokens = {"epilora": [[1, 2], [3, 4], [5]], "vllm-default": [[1, 2], [3, 9], [5]],
              "vllm-eager": [[1, 2], [3, 4], [5]]}
    rows = {(r["system"], r["against"]): r for r in EQUIVALENCE["pair_rows"]("fp8-online",
                                                                            tokens)}
    assert set(rows) == {("epilora", "vllm-default"), ("epilora", "vllm-eager"),
                         ("vllm-default", "vllm-eager")}
    ours = rows[("epilora", "vllm-default")]
    assert (ours["value"], ours["n"], ours["first_difference"]) == (2, 3, [None, 1, None])
    assert rows[("epilora", "vllm-eager")]["value"] == 3
