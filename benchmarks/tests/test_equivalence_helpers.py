"""benchmarks/equivalence.py's rows from engines' tokens (no engine)."""

import runpy
import sys
from pathlib import Path

import pytest

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


def test_collect_pairs_systems_within_each_run_only(tmp_path):
    import json

    def log(tokens):
        result = {"tokens": tokens, "texts": ["a"] * len(tokens), "gpu": "NVIDIA H200",
                  "torch": "2.11.0", "vllm": "0.26.0"}
        return f"INFO engine\nRESULT {json.dumps(result)}\n"

    first, second = tmp_path / "aaa", tmp_path / "bbb"
    first.mkdir(), second.mkdir()
    name = EQUIVALENCE["log_name"]
    (first / name("fp8-online", "epilora")).write_text(log([[1], [9]]))
    (first / name("fp8-online", "vllm-default")).write_text(log([[1], [2]]))
    (first / name("fp8-online", "vllm-eager")).write_text("a run cut off: no RESULT\n")
    (second / name("fp8-online", "epilora")).write_text(log([[1], [2]]))
    (second / name("fp8-online", "vllm-dual-stream")).write_text(log([[1], [2]]))
    assert set(EQUIVALENCE["collect"](first)) == {("fp8-online", "epilora"),
                                                  ("fp8-online", "vllm-default")}
    rows, env = EQUIVALENCE["collect_runs"]([first, second])
    pairs = {(r["run"], r["system"], r["against"]): r["value"] for r in rows
             if r["metric"] == "same_greedy_outputs"}
    # aaa's epilora against aaa's stock (1 of 2), bbb's against bbb's (2 of 2): never across
    assert pairs == {("aaa", "epilora", "vllm-default"): 1,
                     ("bbb", "epilora", "vllm-dual-stream"): 2}
    texts = [(r["run"], r["system"]) for r in rows if r["metric"] == "texts"]
    assert texts == [("aaa", "epilora"), ("aaa", "vllm-default"), ("bbb", "epilora"),
                     ("bbb", "vllm-dual-stream")]
    assert env["gpu"] == "NVIDIA H200"


def test_collect_refuses_a_folder_without_results_and_two_runs_of_one_name(tmp_path):
    (tmp_path / "a" / "run").mkdir(parents=True)
    (tmp_path / "b" / "run").mkdir(parents=True)
    with pytest.raises(ValueError, match="no engine log"):
        EQUIVALENCE["collect_runs"]([tmp_path / "a" / "run"])
    with pytest.raises(ValueError, match="two runs of one name"):
        EQUIVALENCE["collect_runs"]([tmp_path / "a" / "run", tmp_path / "b" / "run"])
