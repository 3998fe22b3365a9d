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
