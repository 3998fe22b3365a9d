import json

import pytest

from epilora_testing.results import results_text


@pytest.mark.parametrize("rows", [[], [{"system": "cutlass", "value": 82.5}],
                                  [{"a": [1, 2], "b": None}, {"a": "x\ny", "b": 1e-7}]])
def test_results_text_round_trips_with_one_row_a_line(rows):
    meta = {"git_sha": "abc", "command": "python3 benchmarks/decode.py --out ..."}
    text = results_text(meta, rows)
    assert json.loads(text) == {"meta": meta, "rows": rows}
    lines = text.splitlines()
    start = lines.index('"rows": [')
    assert lines[start + 1:-1] == [json.dumps(row) + ("," if i < len(rows) - 1 else "")
                                   for i, row in enumerate(rows)]
    assert lines[-1] == "]}"


def test_update_results_replaces_its_part_and_keeps_the_others(tmp_path):
    from epilora_testing.results import update_results

    path = tmp_path / "rl.json"
    update_results(path, part="memory", meta={"git_sha": "a"}, rows=[{"value": 1}])
    update_results(path, part="accuracy", meta={"git_sha": "b"}, rows=[{"value": 2}])
    update_results(path, part="memory", meta={"git_sha": "c"}, rows=[{"value": 3}])
    data = json.loads(path.read_text())
    assert data["rows"] == [{"value": 2, "part": "accuracy"}, {"value": 3, "part": "memory"}]
    assert data["meta"]["git_sha"] == "c"
    assert data["meta"]["parts"] == {"accuracy": {"git_sha": "b"}, "memory": {"git_sha": "c"}}
